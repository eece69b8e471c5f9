// Engine: runs the step (schedule → forward → sample → commit) over what the scheduler picked:
// requests past their prefill go through the decode program (a CUDA graph on CUDA), prefill
// chunks (new prompts, the next chunk of a long prompt, or the recompute of a preempted
// request's prompt + generated tokens) through one eager ragged forward in the same step.
// Requests are validated on entry; a bad request never disturbs the others. Not thread-safe:
// one thread drives an engine.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "dflash/stats.h"
#include "model/drafter.h"
#include "model/transformer.h"
#include "runtime/decode_program.h"
#include "runtime/request.h"
#include "runtime/scheduler.h"
#include "runtime/spec_policy.h"

namespace dflash {

// How the engine runs decode steps.
struct EngineOptions {
  bool cuda_graphs = false;  // capture decode programs into graphs (CUDA)
  bool pad_batches = false;  // pad decode steps to the graph batch sizes (always with graphs)
  int32_t trash_block = 0;   // first of the KV blocks reserved for padding rows
  // Pipelined decode: while every running request is decoding and none is waiting, each step
  // launches the next one before it waits for its own outputs, so the host's work between steps
  // runs while the GPU computes; the next step takes what it needs of this one's outputs on the
  // device (AR: the tokens; speculative: the accepted count and the next token). A step of a
  // request that ends (EOS, stop token, max_tokens reached by accepted drafts) is then computed
  // once for nothing and dropped. With adaptive speculation a pipelined step's draft length is
  // chosen before the acceptance of the step in flight is known (one step later than otherwise).
  bool async_decode = false;
};

// The drafter side of an engine: the model, its KV pool (same block ids as the target's) and
// the number of draft tokens per step (the longest, with adaptive speculation).
struct Speculator {
  Drafter* drafter = nullptr;
  KVPool* pool = nullptr;
  int64_t num_spec_tokens = 0;
  // Adaptive speculation (spec_policy.h): each decode step drafts one of `lengths` tokens per
  // request (0: an AR step keeping the drafter's context), chosen by a SpecPolicy from `costs`
  // (empty: measured at start-up by timing the decode programs) and the requests' acceptance.
  // Off: every step drafts num_spec_tokens.
  bool adaptive = false;
  std::vector<int64_t> lengths;  // ascending, with 0 and num_spec_tokens (spec_lengths_normalize)
  SpecCostTable costs;           // lengths == `lengths` when given
  SpecPolicyConfig policy;
  // Test hook (adaptive only; test_hooks.h): speculative decode step k drafts
  // length_schedule[k % size] tokens (each one of `lengths`) instead of the policy's choice.
  std::vector<int64_t> length_schedule;
};

class Engine {
 public:
  Engine(Transformer& model, Backend& backend, KVPool& pool, BlockAllocator& allocator,
         const SchedulerConfig& sched, int64_t max_model_len, Speculator spec = Speculator(),
         EngineOptions options = EngineOptions());
  ~Engine();
  // KV blocks the engine reserves past the allocator's for padding rows.
  static int64_t trash_blocks(const Speculator& spec, int64_t block_size);

  // Validates (InvalidArgument on caller mistakes) and queues a request; returns its id.
  int64_t add_request(RequestInput input);
  // One step over all running requests; outputs for those that produced tokens.
  std::vector<StepOutput> step();
  // Speculative decoding inspection (propose.cpp): prefill + context update + one greedy draft step for one
  // prompt in blocks of its own; returns the drafts [n] and the LM head's logits [n, V] at the
  // draft rows; for a K-candidate drafter (DFlash2) also the candidates, unary scores, edge
  // scores and walked rows of `details` (if non-null). Changes nothing else.
  struct ProposeDetails {
    int64_t k = 0;
    std::vector<int32_t> cand_ids;  // [n, K]
    std::vector<float> unary;       // [n, K]
    std::vector<float> edges;       // [n, K, K]
    std::vector<float> realized;    // [n, K]
  };
  void propose(const std::vector<int32_t>& prompt, std::vector<int32_t>* drafts, std::vector<float>* logits,
               ProposeDetails* details = nullptr);
  bool speculative() const { return spec_.drafter != nullptr; }
  int64_t num_spec_tokens() const { return spec_.num_spec_tokens; }
  bool adaptive() const { return policy_ != nullptr; }
  // The draft lengths with decode programs (speculative; {num_spec_tokens} when fixed).
  std::vector<int64_t> draft_lengths() const { return spec_.drafter ? programs_->lengths() : std::vector<int64_t>(); }
  // The adaptive policy's step costs (empty when speculation is fixed).
  SpecCostTable spec_costs() const { return policy_ ? policy_->table() : SpecCostTable(); }
  bool abort(int64_t id);
  // Requests still running or waiting, or outputs not yet returned by step().
  bool has_unfinished() const { return scheduler_.has_unfinished() || !stashed_.empty(); }
  // The finished request (tokens, metrics, recordings); nullptr if not finished.
  std::unique_ptr<Request> take_finished(int64_t id) { return scheduler_.take_finished(id); }

  const EngineStats& stats() const { return stats_; }
  bool cuda_graphs() const { return programs_ && programs_->graphs(); }
  bool async_decode() const { return async_decode_; }
  // Padded batch sizes of the decode programs (empty on the CPU: no padding).
  std::vector<int64_t> graph_batch_sizes() const { return programs_ ? programs_->sizes() : std::vector<int64_t>(); }
  const Scheduler& scheduler() const { return scheduler_; }
  int64_t max_model_len() const { return max_model_len_; }

 private:
  // --- Emitting tokens and finishing requests (engine.cpp).
  // Decides whether `req` stops after emitting `token`; returns the reason or "".
  std::string stop_reason(const Request& req, int32_t token) const;
  // Appends emitted tokens one by one until a stop condition; fills `out`; finishes the request
  // when one holds. Returns the number appended.
  int64_t emit(Request* r, const std::vector<int32_t>& tokens, Clock::time_point now, StepOutput* out);
  // Bookkeeping after a request emitted `out`.
  void finish_if_done(Request* r, const StepOutput& out);
  // Emits one sampled token (or the request's forced token at this index, a test hook) and
  // finishes the request when a stop condition holds. nonfinite: the row it was sampled from held
  // a NaN or an infinity; the request then ends with finish_reason "error" instead (a forced token
  // is still emitted: it does not come from the logits).
  StepOutput emit_sampled(Request* r, int32_t sampled, bool nonfinite, Clock::time_point now);
  // Ends a request whose next token would come from non-finite logits: finish_reason "error",
  // nothing emitted; `out` (already holding what this step emitted, if anything) is finished.
  void fail_nonfinite(Request* r, StepOutput* out);
  // Host flags of logits[R, V] (fp32, on the backend): 1 where a row holds a NaN or an infinity
  // (an eager step's sampled rows; one small device->host copy).
  std::vector<int32_t> nonfinite_rows(const Tensor& logits);

  // --- Target-only (AR) steps (engine.cpp).
  // Adds the rows of chunk c (positions from c.req->num_computed) to a target batch, with the
  // logits of the rows at positions >= first_logit (none when it is past the chunk).
  void add_rows(ForwardBatch& batch, const PrefillChunk& c, int max_blocks, int64_t first_logit);
  // Eager ragged forward over prefill chunks and decode rows that record taps (AR).
  std::vector<StepOutput> autoregressive_step(const std::vector<PrefillChunk>& rows);
  // The AR decode program over requests past their prefill. `overlap` (may be null) is queued on
  // the stream between the program's launch and the wait for its outputs (the eager prefill of
  // new requests), so that a mixed step synchronises once.
  std::vector<StepOutput> autoregressive_decode(const std::vector<Request*>& running,
                                                const std::function<void()>& overlap);

  // --- The speculative step (speculative_step.cpp).
  // The speculative decode program over requests past their prefill; `overlap` as for
  // autoregressive_decode.
  std::vector<StepOutput> speculative_decode(const std::vector<Request*>& running,
                                             const std::function<void()>& overlap);
  // The draft length of the next speculative decode step over `running`: num_spec_tokens, the
  // test schedule's next entry, or the adaptive policy's choice.
  int64_t choose_length(const std::vector<Request*>& running);
  // Prefill chunks with a drafter: target forward with taps, the drafter's context of every
  // chunk row, the first token after a new request's last chunk.
  std::vector<StepOutput> speculative_prefill(const std::vector<PrefillChunk>& chunks);

  // Emits the outcome of a speculative decode step with n drafts over `running` (dead rows
  // skipped): the accepted drafts and the next token, stop checks, non-finite rows, metrics.
  std::vector<StepOutput> commit_spec(const std::vector<Request*>& running, const std::vector<bool>& dead, int64_t n);
  // --- Pipelined decode, EngineOptions::async_decode (pipelined_decode.cpp).
  // The step in flight, launched before the host read its predecessor; rows whose request ended
  // meanwhile are dead (their output dropped).
  struct PendingStep {
    std::vector<Request*> rows;
    std::vector<bool> dead;  // [rows]
    int slot = 0;            // the decode programs' slot it was launched in (wait_step)
    int64_t n = 0;           // its draft length (speculative)
  };
  // Whether the next decode step can be launched ahead (async on, nothing waiting, no recording,
  // forced tokens or oracle drafts on `rows`).
  bool can_pipeline(const std::vector<Request*>& rows, const std::vector<bool>& dead) const;
  // Launches the next decode step over the requests of `rows` that continue after the step whose
  // outputs are not read yet (fed = true: row i of `rows` is row i of that step, whose outputs the
  // new step takes on the device) or were just read (fed = false); nullopt when none continues.
  // prev_n: the draft length of the step not yet read (fed, speculative).
  std::optional<PendingStep> launch_ahead(const std::vector<Request*>& rows, const std::vector<bool>& dead, bool fed,
                                          int64_t prev_n = 0);
  std::optional<PendingStep> launch_ahead_spec(const std::vector<Request*>& rows, const std::vector<bool>& dead,
                                               bool fed, int64_t prev_n);
  // Waits for the step in flight, launching its successor first when allowed, and emits its tokens.
  std::vector<StepOutput> finish_pending(bool allow_next);
  // Finishes the step in flight without a successor; its outputs are returned by the next step().
  void drain();
  // Emits one AR token per row (sampled[i] for rows[i], dead rows skipped; nonfinite[i]: its
  // logits held a NaN or an infinity).
  std::vector<StepOutput> commit_ar(const std::vector<Request*>& rows, const std::vector<bool>& dead,
                                    const int32_t* sampled, const int32_t* nonfinite);

  Transformer& model_;
  Backend& backend_;
  KVPool& pool_;
  BlockAllocator& allocator_;
  Scheduler scheduler_;
  int64_t max_model_len_;
  int64_t next_id_ = 0;
  EngineStats stats_;
  Speculator spec_;
  std::unique_ptr<DecodePrograms> programs_;
  std::unique_ptr<SpecPolicy> policy_;  // adaptive speculation
  int64_t num_spec_decode_steps_ = 0;   // speculative decode steps run (the test schedule's index)
  bool async_decode_ = false;
  std::optional<PendingStep> pending_;
  std::vector<StepOutput> stashed_;  // outputs of a drained step, returned by the next step()
};

}  // namespace dflash
