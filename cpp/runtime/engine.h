// Engine: runs the step (schedule → forward → sample → commit) over the scheduler's running
// set. Prefill rows of newly admitted requests and decode rows of running ones go through one
// ragged forward. Requests are validated on entry; a bad request never disturbs the others.
// Not thread-safe: one thread drives an engine.
#pragma once

#include <memory>
#include <vector>

#include "backend/backend.h"
#include "model/transformer.h"
#include "runtime/request.h"
#include "runtime/scheduler.h"

namespace dflash {

struct EngineStats {
  int64_t num_steps = 0;
  int64_t num_forward_tokens = 0;
  int64_t num_generated_tokens = 0;
  int64_t num_requests_finished = 0;
};

class Engine {
 public:
  Engine(Transformer& model, Backend& backend, KVPool& pool, BlockAllocator& allocator,
         const SchedulerConfig& sched, int64_t max_model_len);

  // Validates (InvalidArgument on caller mistakes) and queues a request; returns its id.
  int64_t add_request(RequestInput input);
  // One step over all running requests; outputs for those that produced tokens.
  std::vector<StepOutput> step();
  bool abort(int64_t id) { return scheduler_.abort(id); }
  bool has_unfinished() const { return scheduler_.has_unfinished(); }
  // The finished request (tokens, metrics, recordings); nullptr if not finished.
  std::unique_ptr<Request> take_finished(int64_t id) { return scheduler_.take_finished(id); }

  const EngineStats& stats() const { return stats_; }
  const Scheduler& scheduler() const { return scheduler_; }
  int64_t max_model_len() const { return max_model_len_; }

 private:
  // Decides whether `req` stops after emitting `token`; returns the reason or "".
  std::string stop_reason(const Request& req, int32_t token) const;

  Transformer& model_;
  Backend& backend_;
  KVPool& pool_;
  BlockAllocator& allocator_;
  Scheduler scheduler_;
  int64_t max_model_len_;
  int64_t next_id_ = 0;
  EngineStats stats_;
};

}  // namespace dflash
