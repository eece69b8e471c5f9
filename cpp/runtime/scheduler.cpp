// Continuous-batching admission and request lifetime (see scheduler.h).
#include "runtime/scheduler.h"

#include <algorithm>

#include "common/error.h"

namespace dflash {

Scheduler::Scheduler(const SchedulerConfig& config, BlockAllocator& allocator)
    : config_(config), allocator_(allocator) {}

int64_t Scheduler::reserved_tokens(const Request& req) const {
  return static_cast<int64_t>(req.input.prompt.size()) + req.max_new_tokens +
         config_.lookahead_tokens;
}

void Scheduler::add(std::unique_ptr<Request> req) {
  req->status = RequestStatus::kWaiting;
  waiting_.push_back(std::move(req));
}

std::vector<Request*> Scheduler::schedule() {
  int64_t budget = config_.max_num_batched_tokens;
  bool admitted_any = false;
  while (!waiting_.empty() && static_cast<int64_t>(running_.size()) < config_.max_num_seqs) {
    Request& req = *waiting_.front();
    const int64_t prompt = static_cast<int64_t>(req.input.prompt.size());
    if (admitted_any && prompt > budget) break;
    const int64_t blocks = BlockTable::blocks_for(reserved_tokens(req), config_.block_size);
    if (!allocator_.can_allocate(blocks)) break;
    req.blocks.reserve(reserved_tokens(req), allocator_);
    req.status = RequestStatus::kRunning;
    budget -= prompt;
    admitted_any = true;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
  std::vector<Request*> out;
  for (auto& r : running_) out.push_back(r.get());
  return out;
}

void Scheduler::finish(Request* req, const std::string& reason) {
  auto it = std::find_if(running_.begin(), running_.end(),
                         [&](const std::unique_ptr<Request>& r) { return r.get() == req; });
  DFLASH_CHECK(it != running_.end(), "finish() of a request that is not running");
  req->blocks.release(allocator_);
  req->status = RequestStatus::kFinished;
  req->finish_reason = reason;
  req->finished_at = Clock::now();
  finished_[req->id] = std::move(*it);
  running_.erase(it);
}

bool Scheduler::abort(int64_t id) {
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if ((*it)->id == id) {
      (*it)->status = RequestStatus::kFinished;
      (*it)->finish_reason = "abort";
      (*it)->finished_at = Clock::now();
      finished_[id] = std::move(*it);
      waiting_.erase(it);
      return true;
    }
  }
  for (auto& r : running_) {
    if (r->id == id) {
      finish(r.get(), "abort");
      return true;
    }
  }
  return false;
}

std::unique_ptr<Request> Scheduler::take_finished(int64_t id) {
  auto it = finished_.find(id);
  if (it == finished_.end()) return nullptr;
  std::unique_ptr<Request> r = std::move(it->second);
  finished_.erase(it);
  return r;
}

Request* Scheduler::find(int64_t id) {
  for (auto& r : waiting_) if (r->id == id) return r.get();
  for (auto& r : running_) if (r->id == id) return r.get();
  auto it = finished_.find(id);
  return it == finished_.end() ? nullptr : it->second.get();
}

}  // namespace dflash
