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
#include "dflash/session.h"
#include "dflash/stats.h"
#include "kv_cache/block_allocator.h"
#include "model/drafter.h"
#include "model/transformer.h"
#include "runtime/engine.h"
#include "weights/safetensors.h"

namespace dflash {
namespace runtime {

// The runtime's test hooks beyond the public SessionOptions (not public API).
struct SessionHooks {
  std::vector<int> tap_layers;  // hidden-state taps without a drafter (set from the drafter when there is one)
  // Pad decode steps to the graph batch sizes: always on CUDA; settable on the CPU so that the
  // padding rows' path (reserved KV blocks) is tested there too.
  bool pad_decode_batches = false;
  // Adaptive speculation: a forced draft length per speculative decode step (cycled).
  std::vector<int64_t> spec_length_schedule;
};

// The runtime's configuration: the public options (include/dflash/session.h; device "cpu" or
// "cuda", "auto" resolved by the caller) and the test hooks.
struct SessionConfig : SessionOptions, SessionHooks {
  SessionConfig() { device = "cpu"; }
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
  bool batch_invariant_ = false;  // the kernels' batch_invariant after the environment overrides
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
