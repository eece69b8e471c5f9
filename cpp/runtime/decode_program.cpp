// Decode programs: static buffers, staging, the op sequence and graph capture (see
// decode_program.h).
#include "runtime/decode_program.h"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace dflash {

int64_t DecodePrograms::trash_blocks(int64_t rows_per_request, int64_t block_size) {
  return BlockTable::blocks_for(rows_per_request, block_size);
}

DecodePrograms::DecodePrograms(Backend& backend, Transformer& target, KVPool& target_pool, Drafter* drafter,
                               KVPool* draft_pool, const DecodeProgramConfig& config)
    : backend_(backend),
      target_(target),
      target_pool_(target_pool),
      drafter_(drafter),
      draft_pool_(draft_pool),
      config_(config) {
  DFLASH_CHECK(config_.max_batch >= 1, "decode programs need max_batch >= 1");
  DFLASH_CHECK(!config_.graphs || (config_.pad && backend_.graphs_supported()),
               "CUDA graphs need the CUDA backend (and padded batch sizes)");
  DFLASH_CHECK((config_.num_spec_tokens > 0) == (drafter_ != nullptr), "speculative programs need a drafter");
  n_ = config_.num_spec_tokens;
  q_ = n_ + 1;
  lengths_ = drafter_ && !config_.draft_lengths.empty() ? config_.draft_lengths : std::vector<int64_t>{n_};
  std::sort(lengths_.begin(), lengths_.end());
  lengths_.erase(std::unique(lengths_.begin(), lengths_.end()), lengths_.end());
  DFLASH_CHECK(lengths_.front() >= 0 && lengths_.back() <= n_, "decode program draft lengths must be in [0, ", n_,
               "]");
  width_ = BlockTable::blocks_for(config_.max_model_len + q_, config_.block_size);
  width_ = std::max<int64_t>(width_, trash_blocks(q_, config_.block_size));
  if (config_.pad) {
    for (int64_t s : {1, 2, 4, 8}) sizes_.push_back(s);
    for (int64_t s = 16; s <= 64; s += 8) sizes_.push_back(s);
    for (int64_t s = 96; s <= 4096; s += 32) sizes_.push_back(s);
    sizes_.erase(std::remove_if(sizes_.begin(), sizes_.end(), [&](int64_t s) { return s >= config_.max_batch; }),
                 sizes_.end());
    sizes_.push_back(config_.max_batch);
  }

  const int64_t bmax = config_.max_batch, rows = bmax * q_;
  StepInputs<int64_t> in_capacity{};
  in_capacity.ids = in_capacity.verify_ids = in_capacity.positions = in_capacity.slots = rows;
  in_capacity.query_start = bmax + 1;
  in_capacity.kv_len = in_capacity.use_override = in_capacity.feed = in_capacity.anchors = bmax;
  in_capacity.logit_rows = in_capacity.override_drafts = bmax * n_;
  in_capacity.params = bmax * kSampleParamWords;
  in_capacity.block_table = bmax * width_;
  in_layout_ = StepInputLayout(in_capacity);
  StepOutputs<int64_t> out_capacity{};
  out_capacity.tokens = out_capacity.num_accepted = out_capacity.next_token = bmax;
  out_capacity.drafts = bmax * n_;
  out_capacity.nonfinite = rows;
  out_layout_ = StepOutputLayout(out_capacity);
  in_dev_ = backend_.zeros({in_layout_.words()}, DType::kI32);
  out_dev_ = backend_.zeros({out_layout_.words()}, DType::kI32);
  in_ = in_layout_.device(in_dev_);
  out_ = out_layout_.device(out_dev_);
  for (int slot = 0; slot < 2; ++slot) {
    in_host_[slot] = backend_.host_alloc(static_cast<size_t>(in_layout_.words()) * 4);
    std::memset(in_host_[slot].get(), 0, static_cast<size_t>(in_layout_.words()) * 4);
    out_host_[slot] = backend_.host_alloc(static_cast<size_t>(out_layout_.words()) * 4);
    std::memset(out_host_[slot].get(), 0, static_cast<size_t>(out_layout_.words()) * 4);
  }
  if (n_ > 0) proposed_ = backend_.zeros({bmax * n_}, DType::kI32);
  const int64_t k = drafter_ ? drafter_->proposal_width() : 0;
  if (k > 0) realized_ = backend_.zeros({bmax * n_ * k}, DType::kF32);
  if (drafter_ && drafter_->proposal_kind() == ProposalKind::kCandidates) {
    cand_ids_ = backend_.zeros({bmax * n_ * k}, DType::kI32);
  }
}

DecodePrograms::~DecodePrograms() = default;

int64_t DecodePrograms::padded(int64_t rows) const {
  DFLASH_CHECK(rows >= 1 && rows <= config_.max_batch, "decode step over ", rows, " requests (max ",
               config_.max_batch, ")");
  if (!config_.pad) return rows;
  return *std::lower_bound(sizes_.begin(), sizes_.end(), rows);
}

// Mirrors the ragged layout of ragged_batch_append (ragged_batch.h) in fixed shapes: b sequences of q rows.
void DecodePrograms::stage(const std::vector<DecodeRow>& rows, int64_t b, int64_t n, int slot) {
  const StepInputs<int32_t*> h = host_inputs(slot);
  const int64_t bs = config_.block_size, q = drafter_ ? n + 1 : 1;
  const int32_t mask = drafter_ ? static_cast<int32_t>(drafter_->config().mask_token_id) : 0;
  for (int64_t r = 0; r < b; ++r) {
    const bool real = r < static_cast<int64_t>(rows.size());
    const DecodeRow pad_row{};
    const DecodeRow& row = real ? rows[r] : pad_row;
    const int64_t q0 = real ? row.q0 : 0;
    for (int64_t j = 0; j < q; ++j) {
      const int64_t i = r * q + j;
      h.ids[i] = j == 0 ? row.anchor : mask;
      h.verify_ids[i] = j == 0 ? row.anchor : 0;
      h.positions[i] = static_cast<int32_t>(q0 + j);
      h.slots[i] = real ? row.blocks->slot(q0 + j) : static_cast<int32_t>(config_.trash_block * bs + j);
    }
    h.query_start[r] = static_cast<int32_t>(r * q);
    h.kv_len[r] = static_cast<int32_t>(q0 + q);
    for (int64_t j = 0; j < n; ++j) {
      h.logit_rows[r * n + j] = static_cast<int32_t>(r * q + 1 + j);
      h.override_drafts[r * n + j] = row.override_drafts ? row.override_drafts[j] : 0;
    }
    h.use_override[r] = row.override_drafts ? 1 : 0;
    DFLASH_CHECK(row.feed < 0 || config_.feed, "a fed row needs decode programs built with feed");
    h.feed[r] = row.feed;
    h.anchors[r] = row.anchor;
    DFLASH_CHECK(!row.override_drafts || !drafter_ || drafter_->proposal_kind() == ProposalKind::kOneHot,
                 "override drafts (a test hook) are one-hot proposals; this drafter proposes distributions");
    SampleRow s = real ? row.sample : SampleRow{};
    if (!real) s.position = 1;
    std::memcpy(h.params + r * kSampleParamWords, &s, sizeof(s));
    int32_t* table = h.block_table + r * width_;
    if (real) {
      const std::vector<int32_t>& blocks = row.blocks->blocks();
      DFLASH_CHECK(static_cast<int64_t>(blocks.size()) <= width_, "a request holds ", blocks.size(),
                   " KV blocks, more than the decode program's ", width_);
      std::copy(blocks.begin(), blocks.end(), table);
      std::fill(table + blocks.size(), table + width_, 0);
    } else {
      for (int64_t k = 0; k < width_; ++k) {
        table[k] = k < trash_blocks(q, bs) ? static_cast<int32_t>(config_.trash_block + k) : 0;
      }
    }
  }
  h.query_start[b] = static_cast<int32_t>(b * q);
  // The block table is the last field: the copy covers its first b rows only.
  const int64_t words = in_layout_.offsets().block_table + b * width_;
  backend_.copy_to_device(in_dev_, in_host_[slot].get(), static_cast<size_t>(words) * 4);
}

void DecodePrograms::issue(int64_t b, int64_t n, const std::function<void(int)>& phase) {
  const int64_t q = drafter_ ? n + 1 : 1, t = b * q;
  DeviceBatch d;
  d.num_tokens = t;
  d.token_ids = in_.ids.rows(0, t);
  d.positions = in_.positions.rows(0, t);
  d.slots = in_.slots.rows(0, t);
  d.meta.num_seqs = static_cast<int>(b);
  d.meta.max_blocks_per_seq = static_cast<int>(width_);
  d.meta.max_query_len = static_cast<int>(q);
  d.meta.max_kv_len = static_cast<int>(config_.max_model_len + q);
  d.meta.query_start = in_.query_start.rows(0, b + 1);
  d.meta.kv_len = in_.kv_len.rows(0, b);
  d.meta.block_table = in_.block_table.rows(0, b * width_).reshape({b, width_});
  Tensor params = in_.params.rows(0, b * kSampleParamWords);
  params.dtype = DType::kU8;
  params.shape = {b * static_cast<int64_t>(sizeof(SampleRow))};

  if (!drafter_) {
    if (config_.feed) {  // pipelined steps: anchors from the previous step's tokens (before they are overwritten)
      backend_.feed_tokens(d.token_ids, in_.feed.rows(0, b), out_.tokens);
    }
    d.meta.causal = true;
    d.all_logit_rows = true;
    ForwardResult fwd = target_.forward(d, target_pool_);
    Tensor tokens = out_.tokens.rows(0, b), nonfinite = out_.nonfinite.rows(0, b);
    backend_.nonfinite_rows(fwd.logits, nonfinite);
    backend_.sample_rows(fwd.logits, params, tokens);
    last_logits_ = fwd.logits;
    return;
  }
  if (config_.feed) {  // pipelined steps: move fed requests on by the previous step's acceptance
    SpecStepFeed f;
    f.feed = in_.feed.rows(0, b);
    f.num_accepted = out_.num_accepted;
    f.next_token = out_.next_token;
    f.block_table = d.meta.block_table;
    f.ids = d.token_ids;
    f.verify_ids = in_.verify_ids.rows(0, t);
    f.positions = d.positions;
    f.slots = d.slots;
    f.kv_len = d.meta.kv_len;
    f.anchors = in_.anchors.rows(0, b);
    f.params = params;
    f.rows_per_request = q;
    f.block_size = config_.block_size;
    backend_.feed_spec_inputs(f);
  }
  if (n == 0) {
    issue_context_step(d, params, phase);
  } else {
    issue_speculative(d, n, params, phase);
  }
}

int64_t DecodePrograms::length_of(int64_t length) const {
  if (length < 0) return lengths_.back();
  DFLASH_CHECK(std::binary_search(lengths_.begin(), lengths_.end(), length), "no decode program drafts ", length,
               " tokens (lengths with programs: ", lengths_.size(), ", longest ", lengths_.back(), ")");
  return length;
}

size_t DecodePrograms::graph_index(int64_t n, int64_t b) const {
  const size_t li = static_cast<size_t>(std::lower_bound(lengths_.begin(), lengths_.end(), n) - lengths_.begin());
  const size_t si = static_cast<size_t>(std::lower_bound(sizes_.begin(), sizes_.end(), b) - sizes_.begin());
  DFLASH_CHECK(li < lengths_.size() && lengths_[li] == n && si < sizes_.size() && sizes_[si] == b,
               "no decode program for ", n, " drafts at batch size ", b);
  return li * sizes_.size() + si;
}

void DecodePrograms::capture() {
  if (!config_.graphs) return;
  graphs_.clear();
  graph_logits_.clear();
  for (int64_t n : lengths_) {
    for (int64_t s : sizes_) {
      stage({}, s, n, 0);  // every row padding: the warm-up run writes the trash blocks only
      backend_.begin_step();
      issue(s, n, nullptr);
      backend_.synchronize();
      backend_.begin_step();
      backend_.capture_begin();
      try {
        issue(s, n, nullptr);
      } catch (...) {
        try {
          backend_.capture_end();
        } catch (...) {
        }
        throw;
      }
      graphs_.push_back(backend_.capture_end());
      graph_logits_.push_back(last_logits_);
    }
  }
  backend_.synchronize();
}

SpecCostTable DecodePrograms::measure_costs() {
  SpecCostTable table;
  table.lengths = lengths_;
  if (config_.pad) {
    table.batch_sizes = sizes_;
  } else {
    for (int64_t s = 1; s <= std::min<int64_t>(config_.max_batch, 8); s *= 2) table.batch_sizes.push_back(s);
    if (table.batch_sizes.back() < std::min<int64_t>(config_.max_batch, 8)) table.batch_sizes.push_back(config_.max_batch);
  }
  // Graphs ran once at capture (their first replay, which uploads the graph, is among the timed
  // runs and the fastest one counts); eager programs run once untimed first.
  const int warm = config_.graphs ? 0 : 1, runs = config_.graphs ? 3 : 2;
  const size_t words = static_cast<size_t>(out_layout_.words()) * 4;
  for (int64_t s : table.batch_sizes) {
    for (int64_t n : lengths_) {
      double best = 0.0;
      for (int i = 0; i < warm + runs; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        stage({}, s, n, 0);  // every row padding: the trash blocks only
        backend_.begin_step();
        if (config_.graphs) {
          backend_.graph_launch(*graphs_[graph_index(n, s)]);
        } else {
          issue(s, n, nullptr);
        }
        backend_.copy_to_host(out_host_[0].get(), out_dev_, words);
        backend_.synchronize();
        const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (i == warm || (i > warm && t < best)) best = t;
      }
      table.seconds.push_back(std::max(best, 1e-9));
    }
  }
  table.validate();
  return table;
}

void DecodePrograms::run(const std::vector<DecodeRow>& rows, const std::function<void(int)>& phase, int64_t length) {
  launch(rows, phase, length);
  wait();
}

namespace {
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

void DecodePrograms::wait() {
  const auto t = std::chrono::steady_clock::now();
  backend_.synchronize();
  if (host_timers_) host_timers_->time_host_wait_s += seconds_since(t);
  read_slot_ = last_slot_;
}

void DecodePrograms::wait_step(int slot) {
  const auto t = std::chrono::steady_clock::now();
  backend_.wait_step(slot);
  if (host_timers_) host_timers_->time_host_wait_s += seconds_since(t);
  read_slot_ = slot;
}

int DecodePrograms::launch(const std::vector<DecodeRow>& rows, const std::function<void(int)>& phase,
                           int64_t length) {
  const int slot = next_slot_;
  const int64_t b = padded(static_cast<int64_t>(rows.size()));
  const int64_t n = length_of(length);
  const auto t0 = std::chrono::steady_clock::now();
  stage(rows, b, n, slot);
  const auto t1 = std::chrono::steady_clock::now();
  backend_.begin_step();
  if (config_.graphs) {
    const size_t idx = graph_index(n, b);
    DFLASH_CHECK(idx < graphs_.size(), "no captured graph for batch size ", b);
    backend_.graph_launch(*graphs_[idx]);
    last_logits_ = graph_logits_[idx];
  } else {
    issue(b, n, phase);
  }
  backend_.copy_to_host(out_host_[slot].get(), out_dev_, static_cast<size_t>(out_layout_.words()) * 4);
  backend_.record_step(slot);
  if (host_timers_) {
    host_timers_->time_host_stage_s += std::chrono::duration<double>(t1 - t0).count();
    host_timers_->time_host_launch_s += seconds_since(t1);
  }
  last_slot_ = slot;
  next_slot_ = slot ^ 1;
  return slot;
}

}  // namespace dflash
