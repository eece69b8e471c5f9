// runtime::Session: the runtime behind the public dflash::Session (include/dflash/session.h,
// cpp/api/session.cpp). It loads a model directory onto a backend, sizes the paged KV cache, and
// drives the engine: add requests, step, collect results; with the test hooks the Python
// bindings reach (recordings, forced tokens, oracle drafts, propose, block reference counts).
// Not thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "config/model_config.h"
#include "dflash/stats.h"
#include "kv_cache/block_allocator.h"
#include "model/drafter.h"
#include "model/transformer.h"
#include "runtime/engine.h"
#include "weights/safetensors.h"

namespace dflash {
namespace runtime {

struct SessionConfig {
  std::string device = "cpu";          // "cpu" or "cuda"
  int64_t max_model_len = 0;           // 0: the model's max_position_embeddings
  int64_t kv_cache_tokens = 0;         // 0: a default from max_model_len and host memory
  int64_t block_size = 16;
  int64_t max_num_seqs = 256;
  int64_t max_num_batched_tokens = 8192;  // prefill tokens per step (the chunk budget)
  bool enable_chunked_prefill = true;     // prefill prompts longer than the budget in chunks over steps
  // Share the KV blocks (target and drafter context) of common prompt prefixes across requests:
  // full blocks stay cached after their requests end, evicted least recently used first.
  bool enable_prefix_caching = true;
  int num_threads = 0;                 // 0: all hardware threads
  std::vector<int> tap_layers;         // hidden-state taps (set from the drafter when there is one)
  std::string draft_dir;               // a DFlashDraftModel directory: speculative decoding
  int64_t num_speculative_tokens = 0;  // drafts per step, 1..block_size-1 (0: block_size-1)
  double gpu_memory_utilization = 0.9;  // CUDA: fraction of GPU memory this session may use
  bool cuda_graphs = true;             // CUDA: replay decode steps from captured graphs
  bool async_decode = false;           // pipelined target-only decoding (EngineOptions::async_decode)
  KernelOptions kernels;               // the backend's kernel choices (before environment overrides)
  // DFlash (v1) drafts: "greedy" (argmax, one-hot proposals), "probabilistic" (sampled from the
  // drafter's distribution at T > 0 and verified against it; the argmax at T = 0) or "auto"
  // (probabilistic for DFlash drafters; DFlash2 drafters always walk their candidates).
  std::string draft_sampling = "auto";
  // DFlash2 candidates: "exact" (the top-K of the target's LM head) or "fp8" (picked on an e4m3
  // copy of the LM head made at load, then re-scored and re-sorted on the exact head; only the
  // choice of candidates is approximate, verification is unchanged).
  std::string draft_head = "exact";
  // Pad decode steps to the graph batch sizes: always on CUDA; settable on the CPU so that the
  // padding rows' path (reserved KV blocks) is tested there too (test hook, not public API).
  bool pad_decode_batches = false;
  // With a drafter: "fixed" (every decode step drafts num_speculative_tokens) or "adaptive" (each
  // step drafts one of draft_lengths tokens per request, 0 = an AR step, chosen from the measured
  // step costs and the requests' acceptance; runtime/spec_policy.h).
  std::string speculation = "fixed";
  std::vector<int64_t> draft_lengths;  // adaptive: the lengths with programs (empty: 0, 1, 3, 7, ..., n)
  // Test hooks of adaptive speculation (not public API): the step costs instead of measuring
  // them, rows [batch_size, seconds of each draft length (draft_lengths with 0 and n added,
  // ascending)]; and a forced draft length per speculative decode step (cycled).
  std::vector<std::vector<double>> spec_cost_table;
  std::vector<int64_t> spec_length_schedule;
};

struct RequestResult {
  int64_t request_id = 0;
  std::vector<int32_t> prompt;
  std::vector<int32_t> token_ids;
  std::string finish_reason;
  RequestMetrics metrics;
  std::vector<float> logits;  // [rows, vocab] when recorded
  std::vector<float> taps;    // [rows, taps * hidden] when recorded
};

class Session {
 public:
  Session(const std::string& model_dir, const SessionConfig& config);

  const ModelConfig& model_config() const { return config_; }
  int64_t add_request(RequestInput input) { return engine_->add_request(std::move(input)); }
  std::vector<StepOutput> step() { return engine_->step(); }
  bool abort(int64_t id) { return engine_->abort(id); }
  bool has_unfinished() const { return engine_->has_unfinished(); }
  // Moves a finished request's result out; throws InvalidArgument if it is not finished.
  RequestResult take_result(int64_t id);
  // Runs the given requests to completion (the bindings' generate of debug inputs; the public
  // dflash::Session::generate adds its own requests).
  std::vector<RequestResult> generate(std::vector<RequestInput> inputs);
  int64_t max_model_len() const { return max_model_len_; }
  SessionStats stats() const;
  // Test hook: the reference count of every KV block [num_blocks].
  std::vector<int32_t> block_ref_counts() const;
  // Drafter inspection (see Engine::propose): drafts [n] and logits [n * vocab].
  void propose(const std::vector<int32_t>& prompt, std::vector<int32_t>* drafts, std::vector<float>* logits,
               Engine::ProposeDetails* details = nullptr) {
    engine_->propose(prompt, drafts, logits, details);
  }

 private:
  ModelConfig config_;
  SessionConfig session_config_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Checkpoint> checkpoint_;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<BlockAllocator> allocator_;
  KVPool pool_;
  std::unique_ptr<Drafter> drafter_;
  std::string draft_sampling_;  // resolved: SessionStats::draft_sampling
  KVPool draft_pool_;
  std::unique_ptr<Engine> engine_;
  int64_t max_model_len_ = 0;
  int64_t kv_cache_tokens_ = 0;
  double graph_capture_s_ = 0.0;
};

}  // namespace runtime
}  // namespace dflash
