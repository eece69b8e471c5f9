// dflash::Session: a loaded model (Hugging Face directory: config.json + *.safetensors), with an
// optional DFlash / DFlash2 drafter for speculative decoding, that generates token ids for many
// requests at once (continuous batching over a paged KV cache).
//
//   dflash::Session session("models/SmolLM2-135M-Instruct");
//   dflash::SamplingParams params;
//   params.max_tokens = 32;
//   int64_t id = session.add_request({1, 2, 3}, params, [](const dflash::StepOutput& out) {
//     // out.new_tokens as they are generated; out.finished on the last call
//   });
//   session.run();                                   // or step() in your own loop
//   dflash::RequestOutput result = session.take_result(id);
//
// Requests may be added between steps while others run; each step advances every admitted
// request by one (target-only) or up to num_speculative_tokens + 1 (speculative) tokens.
// Speculative decoding is lossless: greedy output equals the target's greedy output, sampled
// output follows the target's distribution.
//
// Threads: a Session is not thread-safe. Drive it from one thread (or hold a lock around every
// call); stream callbacks run on that thread, inside step() and abort(). The runtime itself uses
// num_threads worker threads on the CPU.
//
// Errors: dflash::InvalidArgument for caller mistakes (the call changed nothing), dflash::Error
// for broken model files and runtime failures (errors.h). After step() throws dflash::Error the
// requests in flight are in an unspecified state: abort them, or discard the session.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dflash/errors.h"
#include "dflash/export.h"
#include "dflash/kernel_options.h"
#include "dflash/outputs.h"
#include "dflash/sampling_params.h"
#include "dflash/stats.h"
#include "dflash/version.h"

namespace dflash {

// How a session is opened. The defaults suit most uses; only draft_dir is usually set.
struct SessionOptions {
  // "cpu" (fp32), "cuda" (bf16, an NVIDIA Hopper GPU; needs a build with the CUDA backend) or
  // "auto" (CUDA when cuda_usable(), else the CPU).
  std::string device = "auto";
  // A DFlash or DFlash2 drafter directory (the z-lab DFlashDraftModel format) for speculative
  // decoding; empty: target-only decoding.
  std::string draft_dir;
  // Draft tokens per step, 1..block_size-1 of the drafter (0: block_size-1). Needs draft_dir.
  int64_t num_speculative_tokens = 0;
  // DFlash drafts: "probabilistic" (sampled from the drafter at temperature > 0 and verified by
  // exact rejection sampling), "greedy" (argmax drafts) or "auto" (probabilistic for DFlash;
  // DFlash2 drafters walk their candidates, sampled at T > 0, "greedy" for the argmax walk).
  std::string draft_sampling = "auto";
  // DFlash2 candidates: "exact" (the top-K of the target's LM head) or "fp8" (picked on an FP8
  // copy of the head, then re-scored exactly; output stays lossless).
  std::string draft_head = "exact";
  // "fixed": every decode step drafts num_speculative_tokens; "adaptive": each step drafts one of
  // draft_lengths tokens (0 = a plain AR step), chosen from measured step costs and the requests'
  // acceptance (at temperature > 0 a seeded request's tokens then depend on the load).
  std::string speculation = "fixed";
  // Adaptive: the draft lengths with decode programs (empty: 0, 1, 3, 7, ... and the longest).
  std::vector<int64_t> draft_lengths;
  // Adaptive: step costs to use instead of measuring them at start-up, rows [batch size, seconds
  // of each draft length] for the lengths of draft_lengths (0 and the longest included).
  std::vector<std::vector<double>> spec_cost_table;
  int64_t max_model_len = 0;    // longest prompt + generation (0: max_position_embeddings)
  int64_t kv_cache_tokens = 0;  // KV cache size in tokens (0: from max_model_len and memory)
  int64_t block_size = 16;      // tokens per KV block
  int64_t max_num_seqs = 256;   // requests running at once (more wait in a queue)
  int64_t max_num_batched_tokens = 8192;  // prefill tokens per step
  // Prefill a prompt longer than max_num_batched_tokens in chunks over several steps while the
  // running requests keep decoding (false: in one step).
  bool enable_chunked_prefill = true;
  // Share the KV blocks of common prompt prefixes across requests (outputs are unchanged).
  bool enable_prefix_caching = true;
  int num_threads = 0;  // CPU worker threads (0: all hardware threads)
  // CUDA: fraction of the GPU's memory for weights, workspaces and the KV cache.
  double gpu_memory_utilization = 0.9;
  // CUDA: replay decode steps from CUDA graphs captured at start-up (ignored on the CPU).
  bool cuda_graphs = true;
  // Pipelined decoding, target-only or speculative (each step launched before the previous one's
  // outputs are read, which it takes on the device; same outputs; adaptive speculation chooses a
  // pipelined step's draft length one step earlier).
  bool async_decode = false;
  // Which kernels the backend uses (kernel_options.h; environment variables override them).
  KernelOptions kernels;
};

// The target model, from its config.json (and generation_config.json).
struct ModelInfo {
  std::string architecture;  // "LlamaForCausalLM" or "Qwen3ForCausalLM"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  int64_t max_model_len = 0;           // the session's limit on prompt + generated tokens
  std::vector<int64_t> eos_token_ids;  // end a request unless SamplingParams::ignore_eos
  int64_t bos_token_id = -1;           // -1: none
  bool tie_word_embeddings = false;
};

// A request's stream: called with what each step produced for it; the last call has
// finished = true (also for an abort). It may call take_result() for that request on its last
// call, and abort() or add_request() at any time, but not step(). If it throws inside step(), its
// request is aborted (without a further call) and the exception is rethrown by step() once the
// step's other callbacks have run; thrown from its last call inside abort(), it leaves abort()
// (the request is aborted all the same).
using StreamCallback = std::function<void(const StepOutput&)>;

// Whether this build has the CUDA backend, and whether it can run here (a Hopper GPU).
DFLASH_API bool built_with_cuda();
DFLASH_API bool cuda_usable();

namespace detail {
struct SessionAccess;
}

class DFLASH_API Session {
 public:
  // Loads the target (and the drafter, if options.draft_dir is set) and sizes the KV cache.
  // Throws InvalidArgument on bad options, Error on broken or mismatched model files.
  explicit Session(const std::string& model_dir, const SessionOptions& options = SessionOptions());
  ~Session();
  Session(Session&&) noexcept;
  Session& operator=(Session&&) noexcept;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const ModelInfo& model_info() const;

  // Queues a request and returns its id (ids count up from 0 in each session). The prompt must
  // be non-empty token ids inside the vocabulary, shorter than max_model_len, and the request
  // must fit the KV cache; otherwise InvalidArgument and nothing is queued. on_output (may be
  // empty) streams its tokens.
  int64_t add_request(std::vector<int32_t> prompt_token_ids, const SamplingParams& params = SamplingParams(),
                      StreamCallback on_output = nullptr);
  // One engine step over every admitted request (admitting waiting ones when KV blocks allow):
  // returns what it produced, per request, after calling their stream callbacks. Returns nothing
  // when no request is unfinished.
  std::vector<StepOutput> step();
  // step() until no request is unfinished.
  void run();
  // Adds the prompts (one SamplingParams for all, or one each), runs until they are finished
  // (other requests of the session advance too) and returns their results in order. On an
  // exception none of them is left in the session.
  std::vector<RequestOutput> generate(const std::vector<std::vector<int32_t>>& prompts,
                                      const SamplingParams& params = SamplingParams());
  std::vector<RequestOutput> generate(const std::vector<std::vector<int32_t>>& prompts,
                                      const std::vector<SamplingParams>& params);
  // Ends a waiting or running request with finish_reason "abort" and frees its KV blocks; its
  // callback gets its last call. False if the id is unknown or the request already finished.
  bool abort(int64_t request_id);
  // Requests queued or running, or outputs of theirs not yet returned by step().
  bool has_unfinished() const;
  // The result of a finished request, moved out of the session (a second call throws); every
  // finished request keeps its result until taken. InvalidArgument if it is not finished.
  RequestOutput take_result(int64_t request_id);
  SessionStats stats() const;

  class Impl;

 private:
  friend struct detail::SessionAccess;
  explicit Session(std::unique_ptr<Impl> impl);
  Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash
