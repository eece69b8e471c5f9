// Engine: runs the step (schedule → forward → sample → commit) over the scheduler's running
// set. Prefill rows of newly admitted requests and decode rows of running ones go through one
// ragged forward. Requests are validated on entry; a bad request never disturbs the others.
// Not thread-safe: one thread drives an engine.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "model/dflash_drafter.h"
#include "model/transformer.h"
#include "runtime/decode_program.h"
#include "runtime/request.h"
#include "runtime/scheduler.h"

namespace dflash {

struct EngineStats {
  int64_t num_steps = 0;
  int64_t num_forward_tokens = 0;
  int64_t num_generated_tokens = 0;
  int64_t num_requests_finished = 0;
  // Speculative decoding, summed over requests.
  int64_t num_spec_steps = 0;
  int64_t num_drafted = 0;
  int64_t num_accepted = 0;
  int64_t num_spec_emitted = 0;
  std::vector<int64_t> accepted_per_position;
  // Wall time of the phases of draft-verify decode steps (seconds; measured in eager mode
  // only, where the backend is synchronised between phases), and of whole decode steps.
  double time_draft_s = 0.0, time_verify_s = 0.0, time_accept_s = 0.0, time_context_s = 0.0;
  double time_decode_s = 0.0;
  // How decode steps ran: replays of captured CUDA graphs, eager decode programs (graphs off, or
  // the CPU), eager ragged forwards (prefills, and decode rows that record taps).
  int64_t num_graph_steps = 0;
  int64_t num_eager_decode_steps = 0;
  int64_t num_eager_forwards = 0;
};

// How the engine runs decode steps.
struct EngineOptions {
  bool cuda_graphs = false;  // capture decode programs into graphs (CUDA)
  bool pad_batches = false;  // pad decode steps to the graph batch sizes (always with graphs)
  int32_t trash_block = 0;   // first of the KV blocks reserved for padding rows
};

// The drafter side of an engine: the model, its KV pool (same block ids as the target's) and
// the number of draft tokens per step.
struct Speculator {
  DFlashDrafter* drafter = nullptr;
  KVPool* pool = nullptr;
  int64_t num_spec_tokens = 0;
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
  // Speculative decoding inspection: prefill + context update + one draft step for one prompt
  // in blocks of its own; returns the drafts [n] and their logits [n, V]. Changes nothing else.
  void propose(const std::vector<int32_t>& prompt, std::vector<int32_t>* drafts, std::vector<float>* logits);
  bool speculative() const { return spec_.drafter != nullptr; }
  int64_t num_spec_tokens() const { return spec_.num_spec_tokens; }
  bool abort(int64_t id) { return scheduler_.abort(id); }
  bool has_unfinished() const { return scheduler_.has_unfinished(); }
  // The finished request (tokens, metrics, recordings); nullptr if not finished.
  std::unique_ptr<Request> take_finished(int64_t id) { return scheduler_.take_finished(id); }

  const EngineStats& stats() const { return stats_; }
  bool cuda_graphs() const { return programs_ && programs_->graphs(); }
  // Padded batch sizes of the decode programs (empty on the CPU: no padding).
  std::vector<int64_t> graph_batch_sizes() const { return programs_ ? programs_->sizes() : std::vector<int64_t>(); }
  const Scheduler& scheduler() const { return scheduler_; }
  int64_t max_model_len() const { return max_model_len_; }

 private:
  // Decides whether `req` stops after emitting `token`; returns the reason or "".
  std::string stop_reason(const Request& req, int32_t token) const;
  // Appends emitted tokens one by one until a stop condition; fills `out`; finishes the request
  // when one holds. Returns the number appended.
  int64_t emit(Request* r, const std::vector<int32_t>& tokens, Clock::time_point now, StepOutput* out);
  // Adds request r's rows (tokens from r->num_computed to the end, or `extra` tokens after
  // it) to a target batch.
  void add_rows(ForwardBatch& batch, Request* r, const std::vector<int32_t>& tokens, int max_blocks,
                bool all_logits);
  // Eager ragged forward over new prompts and decode rows that record taps (AR).
  std::vector<StepOutput> autoregressive_step(const std::vector<Request*>& running);
  // The AR / speculative decode program over requests past their prefill. `overlap` (may be
  // null) is queued on the stream between the program's launch and the wait for its outputs
  // (the eager prefill of new requests), so that a mixed step synchronises once.
  std::vector<StepOutput> autoregressive_decode(const std::vector<Request*>& running,
                                                const std::function<void()>& overlap);
  std::vector<StepOutput> speculative_decode(const std::vector<Request*>& running,
                                             const std::function<void()>& overlap);
  // Prefill of new requests with a drafter: target forward with taps, first token, context.
  std::vector<StepOutput> speculative_prefill(const std::vector<Request*>& running);
  // Bookkeeping after a request emitted `out`.
  void finish_if_done(Request* r, const StepOutput& out);
  // Emits one sampled token (or the request's forced token at this index) and finishes the
  // request when a stop condition holds.
  StepOutput emit_sampled(Request* r, int32_t sampled, Clock::time_point now);

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
};

}  // namespace dflash
