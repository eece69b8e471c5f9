// Session construction (config, weights, backend, KV cache sizing) and result collection.
#include "runtime/session.h"

#include "model/dflash2_drafter.h"
#include "model/dflash_drafter.h"
#include "runtime/kernel_environment.h"

#include <unistd.h>

#include <algorithm>
#include <thread>

namespace dflash {
namespace runtime {

namespace {

int64_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : (int64_t{8} << 30);
}

// The CUDA per-step arena: activations of the largest step, the logits it can produce, taps
// and metadata, with headroom.
double scratch_bytes_estimate(const ModelConfig& c, const SessionConfig& s, int64_t num_taps,
                              int64_t spec_tokens, const DraftConfig* draft) {
  const double rows = std::max<int64_t>(s.max_num_batched_tokens, s.max_num_seqs * (spec_tokens + 1));
  const double logit_rows = std::max<int64_t>(s.max_num_seqs * (spec_tokens + 1), 1);
  // Per row of the target forward: residual, taps, and the layer scratch (normed, fused qkv and
  // q/k/v split from it, attention out, projection, gate_up, act), with room to spare.
  const double width = c.hidden_size * (4 + num_taps) + 2 * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim +
                       2 * c.num_heads * c.head_dim + 3 * c.intermediate_size;
  const double activations = rows * width * 2;
  const double logits = logit_rows * c.vocab_size * 4 * 2;
  double context_update = 0;
  if (draft != nullptr) {
    // The drafter's context update runs in the same step as the target forward over the same
    // committed rows (a whole prefill chunk): fc out and its norm [H_d] each, and the K/V of every
    // drafter layer [L_d * 2 * kv_heads * head_dim] (bf16).
    const ModelConfig& g = draft->geometry;
    context_update = rows * (2 * g.hidden_size + g.num_layers * 2 * g.num_kv_heads * g.head_dim) * 2;
  }
  double selector = 0;
  if (draft != nullptr && draft->arch == DraftArch::kDFlash2) {
    // Per draft row: edges [K, K], candidates and unary [K], the gate [rank] (fp32), the top-K
    // partials (<= one K list of (key, id) per 4096 vocabulary entries); per block row: the conv's
    // input and deltas [2 T H / g] (bf16). draft_head="fp8" needs nothing more: its FP8 logits
    // take the exact head's logit rows (counted in `logits`), the re-score works in place.
    const DFlash2Config& d = draft->dflash2;
    const double draft_rows = static_cast<double>(s.max_num_seqs) * spec_tokens, k = d.selector_top_k;
    selector = draft_rows * (k * k * 4 + k * 12 + d.selector_rank * 4 + (c.vocab_size / 4096 + 2) * k * 8) +
               static_cast<double>(s.max_num_seqs) * (spec_tokens + 1) *
                   (draft->geometry.hidden_size * 2 + 2 * d.conv_kernel_size * (draft->geometry.hidden_size /
                                                                                  d.conv_group_size) * 2);
  }
  return activations + logits + context_update + selector + static_cast<double>(64ll << 20);
}

// The arena size, refused (before anything is allocated) when it is beyond any device.
size_t scratch_bytes(const ModelConfig& c, const SessionConfig& s, int64_t num_taps, int64_t spec_tokens,
                     const DraftConfig* draft) {
  const double bytes = scratch_bytes_estimate(c, s, num_taps, spec_tokens, draft);
  DFLASH_ARG_CHECK(bytes < static_cast<double>(int64_t{1} << 50), "a step of max_num_seqs=", s.max_num_seqs,
                   ", max_num_batched_tokens=", s.max_num_batched_tokens, " needs a per-step workspace of ", bytes,
                   " bytes; lower them");
  return static_cast<size_t>(bytes);
}

// The KV bytes of one token: K and V of every layer of the target and of the drafter.
int64_t kv_bytes_per_token(const ModelConfig& c, const DraftConfig* draft, DType dtype) {
  int64_t bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype_size(dtype);
  if (draft) bytes += 2 * draft->geometry.num_layers * draft->geometry.num_kv_heads * draft->geometry.head_dim *
                      dtype_size(dtype);
  return bytes;
}

// An explicit kv_cache_tokens must fit the memory of the device (the host on the CPU): a clear
// error before anything of the cache is allocated.
void kv_cache_check_fits(int64_t kv_tokens, int64_t bytes_per_token, const Backend& backend) {
  if (kv_tokens == 0) return;  // sized from the free memory below
  size_t free_bytes = 0, total_bytes = 0;
  const bool device = backend.device_memory(&free_bytes, &total_bytes);
  const int64_t memory = device ? static_cast<int64_t>(total_bytes) : host_memory_bytes();
  int64_t bytes = 0;
  const bool overflow = __builtin_mul_overflow(kv_tokens, bytes_per_token, &bytes);
  DFLASH_ARG_CHECK(!overflow && bytes <= memory, "kv_cache_tokens=", kv_tokens, " needs ",
                   overflow ? std::string("more than 2^63") : std::to_string(bytes), " bytes of KV cache (",
                   bytes_per_token, " per token), more than the ", memory, " bytes of ", device ? "GPU" : "host",
                   " memory; lower kv_cache_tokens");
}



double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

Session::Session(const std::string& model_dir, const SessionConfig& config)
    : session_config_(config) {
  DFLASH_ARG_CHECK(config.block_size >= 1 && config.block_size <= 1024,
                   "block_size must be in [1, 1024], got ", config.block_size);
  DFLASH_ARG_CHECK(config.max_num_seqs >= 1, "max_num_seqs must be >= 1");
  DFLASH_ARG_CHECK(config.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1");
  DFLASH_ARG_CHECK(config.max_model_len >= 0, "max_model_len must be positive");
  DFLASH_ARG_CHECK(config.kv_cache_tokens >= 0, "kv_cache_tokens must be positive");
  DFLASH_ARG_CHECK(config.gpu_memory_utilization > 0.0 && config.gpu_memory_utilization <= 1.0,
                   "gpu_memory_utilization must be in (0, 1], got ", config.gpu_memory_utilization);
  DFLASH_ARG_CHECK(config.draft_head == "exact" || config.draft_head == "fp8",
                   "draft_head must be 'exact' or 'fp8', got '", config.draft_head, "'");
  DFLASH_ARG_CHECK(config.draft_head == "exact" || !config.draft_dir.empty(),
                   "draft_head='fp8' needs a draft model (it is the drafter's copy of the LM head)");
  config_ = model_config_load(model_dir);
  int threads = config.num_threads > 0
                    ? config.num_threads
                    : std::max(1u, std::thread::hardware_concurrency());
  std::vector<int> taps = config.tap_layers;
  DraftConfig draft_config;
  if (!config.draft_dir.empty()) {
    DFLASH_ARG_CHECK(taps.empty(), "tap_layers come from the draft model; do not pass both");
    draft_config = draft_config_load(config.draft_dir);
    draft_config_check_target(draft_config, config_, model_dir);
    taps = draft_config.target_layer_ids;
    const int64_t n = config.num_speculative_tokens;
    DFLASH_ARG_CHECK(n >= 0 && n <= draft_config.block_size - 1, "num_speculative_tokens must be in [1, ",
                     draft_config.block_size - 1, "] for a drafter of block_size ", draft_config.block_size,
                     ", got ", n);
  } else {
    DFLASH_ARG_CHECK(config.num_speculative_tokens == 0, "num_speculative_tokens needs a draft model");
  }
  const int64_t spec_tokens = config.draft_dir.empty() ? 0
                              : config.num_speculative_tokens > 0 ? config.num_speculative_tokens
                                                                  : draft_config.block_size - 1;
  // The target's files are validated (header layout, tensor set, shapes) before the backend
  // allocates anything.
  checkpoint_ = std::make_unique<Checkpoint>(model_dir);
  transformer_check_checkpoint(config_, *checkpoint_);
  const KernelOptions kernels = kernel_options_with_environment(config.kernels);
  DFLASH_ARG_CHECK(!kernels.batch_invariant || config.device == "cuda",
                   "deterministic (batch-invariant kernels) is implemented by the CUDA backend only, not on device '",
                   config.device, "'");
  batch_invariant_ = kernels.batch_invariant;
  backend_ = backend_create(config.device, threads,
                            scratch_bytes(config_, config, static_cast<int64_t>(taps.size()), spec_tokens,
                                          config.draft_dir.empty() ? nullptr : &draft_config),
                            kernels);
  if (backend_->kind() == DeviceKind::kCUDA) {
    auto check_head_dim = [](int64_t hd, const std::string& what) {
      DFLASH_ARG_CHECK(hd == 64 || hd == 128, "the CUDA backend supports head_dim 64 and 128; ", what,
                       " has head_dim ", hd);
    };
    check_head_dim(config_.head_dim, model_dir);
    if (!config.draft_dir.empty()) check_head_dim(draft_config.geometry.head_dim, config.draft_dir);
  }
  const int64_t bytes_per_token = kv_bytes_per_token(config_, config.draft_dir.empty() ? nullptr : &draft_config,
                                                     backend_->compute_dtype());
  kv_cache_check_fits(config.kv_cache_tokens, bytes_per_token, *backend_);
  model_ = std::make_unique<Transformer>(config_, *checkpoint_, *backend_, taps);
  if (!config.draft_dir.empty()) {
    drafter_ = drafter_create(draft_config, config.draft_dir, *backend_, *model_, model_dir);
  }
  DFLASH_ARG_CHECK(config.draft_sampling == "auto" || config.draft_sampling == "greedy" ||
                       config.draft_sampling == "probabilistic",
                   "draft_sampling must be 'auto', 'greedy' or 'probabilistic', got '", config.draft_sampling, "'");
  if (config.draft_sampling == "probabilistic") {
    DFLASH_ARG_CHECK(drafter_ != nullptr, "draft_sampling='probabilistic' needs a draft model");
  }
  if (drafter_) {
    auto* v1 = dynamic_cast<DFlashDrafter*>(drafter_.get());
    const bool is_v1 = v1 != nullptr && draft_config.arch == DraftArch::kDFlash;
    DFLASH_ARG_CHECK(is_v1 || config.draft_sampling != "probabilistic", config.draft_dir,
                     ": draft_sampling='probabilistic' applies to DFlash (v1) drafters; a DFlash2 drafter walks its "
                     "candidates (sampled at temperature > 0 by default, draft_sampling='greedy' for the argmax walk)");
    // "auto": probabilistic DFlash drafts, the higher acceptance at T = 1 (identical drafts at T = 0);
    // the sampled walk for DFlash2. "greedy": argmax drafts / the argmax walk at every temperature.
    const bool probabilistic = is_v1 && config.draft_sampling != "greedy";
    if (probabilistic) v1->set_probabilistic(true);
    const bool greedy_walk = !is_v1 && config.draft_sampling == "greedy";
    if (greedy_walk) {
      auto* v2 = dynamic_cast<DFlash2Drafter*>(drafter_.get());
      DFLASH_CHECK(v2 != nullptr, config.draft_dir, ": a DFlash2 drafter that is not a DFlash2Drafter");
      v2->set_greedy_walk(true);
    }
    draft_sampling_ = is_v1 ? (probabilistic ? "probabilistic" : "greedy") : (greedy_walk ? "greedy_walk" : "walk");
  }
  if (config.draft_head == "fp8") {
    auto* drafter = dynamic_cast<DFlashDrafter*>(drafter_.get());  // DFlash and DFlash2
    DFLASH_CHECK(drafter != nullptr, config.draft_dir, ": draft_head='fp8': a drafter that is not a DFlashDrafter");
    drafter->set_draft_head_fp8();  // before the KV cache is sized: its bytes come out of the budget
  }
  if (backend_->kind() == DeviceKind::kCPU) {
    checkpoint_.reset();  // weights were copied to fp32; drop the mappings
  }

  max_model_len_ = config.max_model_len > 0 ? config.max_model_len
                                            : config_.max_position_embeddings;
  int64_t kv_tokens = config.kv_cache_tokens;
  size_t free_bytes = 0, total_bytes = 0;
  if (kv_tokens == 0 && backend_->device_memory(&free_bytes, &total_bytes)) {
    // GPU: what is left of gpu_memory_utilization x total after weights and workspaces.
    const double keep = (1.0 - config.gpu_memory_utilization) * static_cast<double>(total_bytes);
    const double budget = static_cast<double>(free_bytes) - keep;
    kv_tokens = budget > 0 ? static_cast<int64_t>(budget / bytes_per_token) : 0;
    kv_tokens = std::min<int64_t>(kv_tokens, std::max<int64_t>(max_model_len_, 1) * 4096);
    DFLASH_ARG_CHECK(kv_tokens >= max_model_len_, "GPU memory left for the KV cache holds ", kv_tokens,
                     " tokens, less than max_model_len=", max_model_len_,
                     "; raise gpu_memory_utilization or lower max_model_len");
  } else if (kv_tokens == 0) {
    // Enough for one request of max_model_len and for batching; pages are touched lazily,
    // but stay within 40 % of host memory.
    const int64_t budget = host_memory_bytes() * 2 / 5 / bytes_per_token;
    kv_tokens = std::max<int64_t>(max_model_len_, 32768);
    kv_tokens = std::min(kv_tokens, budget);
    DFLASH_ARG_CHECK(kv_tokens >= std::min<int64_t>(max_model_len_, 4096),
                     "not enough memory for a KV cache of max_model_len=", max_model_len_,
                     " tokens; pass a smaller max_model_len");
  }
  const int64_t num_blocks = BlockTable::blocks_for(kv_tokens, config.block_size);
  allocator_ = std::make_unique<BlockAllocator>(num_blocks, config.enable_prefix_caching);
  DFLASH_ARG_CHECK(config.speculation == "fixed" || config.speculation == "adaptive",
                   "speculation must be 'fixed' or 'adaptive', got '", config.speculation, "'");
  DFLASH_ARG_CHECK(drafter_ || config.speculation == "fixed", "speculation='adaptive' needs a draft model");
  DFLASH_ARG_CHECK(config.speculation == "adaptive" ||
                       (config.draft_lengths.empty() && config.spec_cost_table.empty() &&
                        config.spec_length_schedule.empty()),
                   "draft_lengths (and the speculation cost table / schedule test hooks) need speculation='adaptive'");
  Speculator spec;
  if (drafter_) {
    spec.drafter = drafter_.get();
    spec.pool = &draft_pool_;
    spec.num_spec_tokens =
        config.num_speculative_tokens > 0 ? config.num_speculative_tokens : drafter_->config().block_size - 1;
    spec.adaptive = config.speculation == "adaptive";
    if (spec.adaptive) {
      spec.lengths = spec_lengths_normalize(config.draft_lengths, spec.num_spec_tokens);
      if (!config.spec_cost_table.empty()) spec.costs = SpecCostTable::from_rows(spec.lengths, config.spec_cost_table);
      spec.length_schedule = config.spec_length_schedule;
    }
  }
  // Past the allocator's blocks: the blocks that padding rows of decode steps write.
  const int64_t pool_blocks = num_blocks + Engine::trash_blocks(spec, config.block_size);
  pool_ = model_->make_kv_pool(pool_blocks, config.block_size);
  if (drafter_) draft_pool_ = drafter_->make_kv_pool(pool_blocks, config.block_size);  // same block ids

  kv_cache_tokens_ = num_blocks * config.block_size;
  SchedulerConfig sched;
  sched.block_size = config.block_size;
  sched.max_num_seqs = config.max_num_seqs;
  sched.max_num_batched_tokens = config.max_num_batched_tokens;
  sched.chunked_prefill = config.enable_chunked_prefill;
  EngineOptions options;
  options.cuda_graphs = config.cuda_graphs && backend_->kind() == DeviceKind::kCUDA;
  options.pad_batches = config.pad_decode_batches || backend_->kind() == DeviceKind::kCUDA;
  options.trash_block = static_cast<int32_t>(num_blocks);
  options.async_decode = config.async_decode;
  const Clock::time_point t0 = Clock::now();
  engine_ = std::make_unique<Engine>(*model_, *backend_, pool_, *allocator_, sched, max_model_len_, spec, options);
  graph_capture_s_ =
      options.cuda_graphs ? seconds_between(t0, Clock::now()) - engine_->stats().time_measure_costs_s : 0.0;
}

RequestResult Session::take_result(int64_t id) {
  std::unique_ptr<Request> r = engine_->take_finished(id);
  DFLASH_ARG_CHECK(r != nullptr, "request ", id, " is not finished (or was already taken)");
  RequestResult out;
  out.request_id = r->id;
  out.prompt = std::move(r->input.prompt);
  out.token_ids = std::move(r->output);
  out.finish_reason = r->finish_reason;
  out.metrics = r->metrics;
  out.metrics.generated_tokens = static_cast<int64_t>(out.token_ids.size());
  if (!out.token_ids.empty()) {
    out.metrics.time_to_first_token_s = seconds_between(r->arrival, r->first_token);
    const double decode_s = seconds_between(r->first_token, r->finished_at);
    if (out.token_ids.size() > 1 && decode_s > 0) {
      out.metrics.decode_tokens_per_s = (out.token_ids.size() - 1) / decode_s;
    }
  }
  out.metrics.total_time_s = seconds_between(r->arrival, r->finished_at);
  out.logits = std::move(r->logits);
  out.taps = std::move(r->taps);
  return out;
}

std::vector<RequestResult> Session::generate(std::vector<RequestInput> inputs) {
  std::vector<int64_t> ids;
  try {
    for (auto& in : inputs) ids.push_back(add_request(std::move(in)));
    while (has_unfinished()) step();
  } catch (...) {
    for (int64_t id : ids) {
      engine_->abort(id);
      engine_->take_finished(id);
    }
    throw;
  }
  std::vector<RequestResult> out;
  for (int64_t id : ids) out.push_back(take_result(id));
  return out;
}

std::vector<int32_t> Session::block_ref_counts() const {
  std::vector<int32_t> out(allocator_->num_blocks());
  for (int64_t b = 0; b < allocator_->num_blocks(); ++b) out[b] = allocator_->ref_count(static_cast<int32_t>(b));
  return out;
}

SessionStats Session::stats() const {
  SessionStats s;
  s.device = backend_->name();
  s.weight_bytes = static_cast<int64_t>(model_->weight_bytes());
  s.kv_cache_bytes = static_cast<int64_t>(pool_.k.nbytes() + pool_.v.nbytes());
  s.block_size = session_config_.block_size;
  s.num_blocks = allocator_->num_blocks();  // the reserved padding blocks are not counted
  s.num_free_blocks = allocator_->num_free();
  s.prefix_caching = allocator_->prefix_caching();
  s.num_cached_blocks = allocator_->num_cached();
  s.num_evictable_blocks = allocator_->num_evictable();
  s.num_evicted_blocks = allocator_->num_evictions();
  s.prefix_cache_query_tokens = engine_->scheduler().prefix_cache_stats().query_tokens;
  s.prefix_cache_hit_tokens = engine_->scheduler().prefix_cache_stats().hit_tokens;
  s.kv_cache_tokens = s.num_blocks * s.block_size;
  s.max_model_len = max_model_len_;
  s.num_threads = backend_->num_threads();
  s.workspace_bytes = static_cast<int64_t>(backend_->workspace_bytes());
  s.num_running_requests = engine_->scheduler().num_running();
  s.num_waiting_requests = engine_->scheduler().num_waiting();
  s.engine = engine_->stats();
  s.cuda_graphs = engine_->cuda_graphs();
  s.deterministic = batch_invariant_;
  s.async_decode = engine_->async_decode();
  s.graph_batch_sizes = engine_->graph_batch_sizes();
  s.graph_capture_s = graph_capture_s_;
  if (drafter_) {
    s.draft_weight_bytes = static_cast<int64_t>(drafter_->weight_bytes());
    s.draft_kv_cache_bytes = static_cast<int64_t>(draft_pool_.k.nbytes() + draft_pool_.v.nbytes());
    s.num_speculative_tokens = engine_->num_spec_tokens();
    s.draft_sampling = draft_sampling_;
    s.speculation = engine_->adaptive() ? "adaptive" : "fixed";
    s.draft_lengths = engine_->draft_lengths();
    const SpecCostTable costs = engine_->spec_costs();
    s.spec_cost_batch_sizes = costs.batch_sizes;
    s.spec_cost_lengths = costs.lengths;
    const size_t n = costs.lengths.size();
    for (size_t i = 0; i < costs.batch_sizes.size(); ++i) {
      s.spec_cost_seconds.emplace_back(costs.seconds.begin() + i * n, costs.seconds.begin() + (i + 1) * n);
    }
  }
  return s;
}

}  // namespace runtime
}  // namespace dflash
