// Continuous-batching admission, block-table growth, chunked prefill, preemption by recompute,
// prefix-cache matching and registration, and request lifetime (see scheduler.h).
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

namespace {
// The request's tokens at positions [start, start + n) (prompt, then generated tokens).
void tokens_of(const Request& r, int64_t start, int64_t n, std::vector<int32_t>* out) {
  out->resize(n);
  for (int64_t i = 0; i < n; ++i) (*out)[i] = r.token_at(start + i);
}

// Whether the request may take its prefix from the cache (recordings need every row computed).
bool may_match(const Request& r) {
  return !r.input.record_prompt_logits && !r.input.record_taps;
}
}  // namespace

void Scheduler::cache_full_blocks(Request& r) {
  if (!allocator_.prefix_caching()) return;
  const int64_t bs = config_.block_size;
  // Blocks whose every slot holds the K/V of a known token: a speculative step that stopped at a
  // stop token may have computed rows past the request's last token.
  const int64_t full = std::min<int64_t>(std::min(r.num_computed, r.num_tokens()) / bs,
                                         static_cast<int64_t>(r.blocks.blocks().size()));
  std::vector<int32_t> tokens;
  for (int64_t k = static_cast<int64_t>(r.blocks.hashes().size()); k < full; ++k) {
    tokens_of(r, k * bs, bs, &tokens);
    const uint64_t parent = k == 0 ? kPrefixHashRoot : r.blocks.hashes()[k - 1];
    const uint64_t hash = prefix_block_hash(parent, tokens.data(), bs);
    allocator_.cache(r.blocks.blocks()[k], hash, parent, tokens.data(), bs);
    r.blocks.push_hash(hash);
  }
}

void Scheduler::match_prefix(const Request& r, std::vector<int32_t>* blocks, std::vector<uint64_t>* hashes) const {
  if (!allocator_.prefix_caching() || !may_match(r)) return;
  const int64_t bs = config_.block_size;
  const int64_t max_blocks = (r.prefill_end() - 1) / bs;  // the prefill's last token is computed
  std::vector<int32_t> tokens;
  uint64_t parent = kPrefixHashRoot;
  for (int64_t k = 0; k < max_blocks; ++k) {
    tokens_of(r, k * bs, bs, &tokens);
    const uint64_t hash = prefix_block_hash(parent, tokens.data(), bs);
    const int32_t block = allocator_.lookup(hash, parent, tokens.data(), bs);
    if (block < 0) break;
    blocks->push_back(block);
    hashes->push_back(hash);
    parent = hash;
  }
}

void Scheduler::check_writable(const Request& r) const {
  const std::vector<int32_t>& blocks = r.blocks.blocks();
  for (size_t k = static_cast<size_t>(r.num_computed / config_.block_size); k < blocks.size(); ++k) {
    DFLASH_CHECK(allocator_.ref_count(blocks[k]) == 1 && !allocator_.is_cached(blocks[k]), "request ", r.id,
                 " would write KV block ", blocks[k], " (its block ", k, ", from position ", r.num_computed,
                 "), which is shared or cached");
  }
}

void Scheduler::add(std::unique_ptr<Request> req) {
  req->status = RequestStatus::kWaiting;
  waiting_.push_back(std::move(req));
}

void Scheduler::preempt_newest() {
  DFLASH_CHECK(!running_.empty(), "preemption with no running request");
  std::unique_ptr<Request> r = std::move(running_.back());
  running_.pop_back();
  cache_full_blocks(*r);  // a recompute may find them again
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

  // 0. Blocks filled by the last step become cacheable.
  for (auto& r : running_) cache_full_blocks(*r);

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
    check_writable(*r);
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
    // Its prefill starts after the blocks found in the prefix cache.
    std::vector<int32_t> hit;
    std::vector<uint64_t> hit_hashes;
    match_prefix(r, &hit, &hit_hashes);
    const int64_t num_hit = static_cast<int64_t>(hit.size());
    r.num_computed = num_hit * bs;
    const int64_t chunk = chunk_of(r);
    const int64_t need = chunk > 0 ? needed_tokens(r, chunk) : 0;
    // Matched blocks that no request references count among the free ones: sharing takes them.
    int64_t unreferenced = 0;
    for (int32_t b : hit) unreferenced += allocator_.ref_count(b) == 0 ? 1 : 0;
    if (chunk == 0 || !allocator_.can_allocate(BlockTable::blocks_for(need, bs) - num_hit + unreferenced)) {
      r.num_computed = 0;
      break;
    }
    for (int32_t b : hit) allocator_.share(b);  // before allocating: never evicted by it
    r.blocks.adopt(hit, hit_hashes);
    r.blocks.reserve(need, allocator_);
    check_writable(r);
    if (allocator_.prefix_caching() && may_match(r)) {
      prefix_stats_.query_tokens += r.prefill_end();
      prefix_stats_.hit_tokens += num_hit * bs;
    }
    r.metrics.num_cached_tokens += num_hit * bs;
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
  if (reason != "error") cache_full_blocks(*req);  // an error's K/V may hold the NaN: never shared
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
