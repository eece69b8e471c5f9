// Scheduler: the waiting queue and the running set, with continuous batching. A request is
// admitted (first come, first served) when the KV blocks for its prompt plus its maximum new
// tokens are free, when the running set has room, and while the step's prefill token budget
// lasts; it returns every block when it finishes or is aborted. Admission reserves the worst
// case up front, so a running request never waits for memory (preemption comes later).
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "kv_cache/block_allocator.h"
#include "runtime/request.h"

namespace dflash {

struct SchedulerConfig {
  int64_t block_size = 16;
  int64_t max_num_seqs = 256;
  int64_t max_num_batched_tokens = 8192;  // prefill tokens admitted per step (at least one request)
  int64_t lookahead_tokens = 0;           // extra slots per request (speculative verify)
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, BlockAllocator& allocator);

  const SchedulerConfig& config() const { return config_; }
  // Takes ownership; the request waits until admitted.
  void add(std::unique_ptr<Request> req);
  // Admits waiting requests; returns the running set for this step (admission order).
  std::vector<Request*> schedule();
  // Ends a request: frees its blocks and moves it to the finished map.
  void finish(Request* req, const std::string& reason);
  // Aborts a waiting or running request; false if unknown or already finished.
  bool abort(int64_t id);
  // Takes a finished request out (nullptr if not finished).
  std::unique_ptr<Request> take_finished(int64_t id);
  Request* find(int64_t id);

  bool has_unfinished() const { return !waiting_.empty() || !running_.empty(); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  // KV slots a request reserves at admission.
  int64_t reserved_tokens(const Request& req) const;

 private:
  SchedulerConfig config_;
  BlockAllocator& allocator_;
  std::deque<std::unique_ptr<Request>> waiting_;
  std::vector<std::unique_ptr<Request>> running_;
  std::map<int64_t, std::unique_ptr<Request>> finished_;
};

}  // namespace dflash
