// Continuous-batching admission, block-table growth, chunked prefill, preemption by recompute
// and request lifetime (see scheduler.h).
#include "runtime/scheduler.h"

#include <algorithm>

#include "common/error.h"

namespace dflash {

Scheduler::Scheduler(const SchedulerConfig& config, BlockAllocator& allocator)
    : config_(config), allocator_(allocator) {
  DFLASH_CHECK(config_.max_num_batched_tokens >= 1, "the scheduler's token budget must be >= 1");
}

int64_t Scheduler::worst_case_tokens(const Request& req) const {
  return static_cast<int64_t>(req.input.prompt.size()) + req.max_new_tokens + config_.lookahead_tokens;
}

void Scheduler::add(std::unique_ptr<Request> req) {
  req->status = RequestStatus::kWaiting;
  waiting_.push_back(std::move(req));
}

void Scheduler::preempt_newest() {
  DFLASH_CHECK(!running_.empty(), "preemption with no running request");
  std::unique_ptr<Request> r = std::move(running_.back());
  running_.pop_back();
  r->blocks.release(allocator_);
  r->max_computed = std::max(r->max_computed, r->num_computed);
  r->num_computed = 0;
  r->status = RequestStatus::kWaiting;
  r->metrics.num_preemptions += 1;
  waiting_.push_front(std::move(r));
}

Schedule Scheduler::schedule() {
  Schedule out;
  const int64_t bs = config_.block_size, step = step_tokens();
  int64_t budget = config_.max_num_batched_tokens;
  // The prefill tokens of request r this step (0: none), given the budget left.
  auto chunk_of = [&](const Request& r) -> int64_t {
    const int64_t remaining = r.prefill_end() - r.num_computed;
    if (config_.chunked_prefill) return std::min(remaining, std::max<int64_t>(budget, 0));
    return out.prefill.empty() || remaining <= budget ? remaining : 0;
  };
  // Slots r must hold after this step: the chunk's rows, and the next step's when its prefill ends.
  auto needed_tokens = [&](const Request& r, int64_t chunk) {
    if (chunk == 0) return r.num_computed + step;  // a decode step
    const bool last = r.num_computed + chunk == r.prefill_end();
    return r.num_computed + chunk + (last ? step : 0);
  };

  // 1. Running requests, oldest first; the newest are preempted when blocks run out.
  for (size_t i = 0; i < running_.size();) {
    Request* r = running_[i].get();
    int64_t chunk = 0;
    if (r->prefilling()) {
      chunk = chunk_of(*r);
      if (chunk == 0) {  // no budget left this step: it waits, keeping its blocks
        ++i;
        continue;
      }
    }
    const int64_t need = needed_tokens(*r, chunk);
    const int64_t more = BlockTable::blocks_for(need, bs) - static_cast<int64_t>(r->blocks.blocks().size());
    bool self_preempted = false;
    while (!allocator_.can_allocate(more)) {
      const bool self = running_.back().get() == r;
      preempt_newest();
      out.num_preempted += 1;
      if (self) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;  // r was the newest: nothing runs after it
    r->blocks.reserve(need, allocator_);
    if (chunk > 0) {
      out.prefill.push_back({r, chunk});
      budget -= chunk;
    } else {
      out.decode.push_back(r);
    }
    ++i;
  }

  // 2. Waiting requests, first come first served (none after a preemption: the blocks are short).
  while (out.num_preempted == 0 && !waiting_.empty() &&
         static_cast<int64_t>(running_.size()) < config_.max_num_seqs) {
    Request& r = *waiting_.front();
    DFLASH_CHECK(r.num_computed == 0 && r.blocks.blocks().empty(), "a waiting request holds KV blocks");
    const int64_t chunk = chunk_of(r);
    if (chunk == 0) break;
    const int64_t need = needed_tokens(r, chunk);
    if (!allocator_.can_allocate(BlockTable::blocks_for(need, bs))) break;
    r.blocks.reserve(need, allocator_);
    r.status = RequestStatus::kRunning;
    out.prefill.push_back({&r, chunk});
    budget -= chunk;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
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
