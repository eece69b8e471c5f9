// Scheduler: the waiting queue and the running set, with continuous batching, admission by the
// KV blocks a request needs now, chunked prefill and preemption by recompute. Each step:
//   1. running requests, oldest first: a decoding one grows its block table to hold the slots
//      its next step writes (lookahead: 1 for AR, anchor + drafts for a speculative step); a
//      prefilling one gets its next chunk (at most the step's token budget left). When the
//      blocks run out, the newest running request is preempted: its blocks are freed (target and
//      drafter KV share the ids) and it goes back to the front of the waiting queue with its
//      generated tokens, to be prefilled again (prompt + generated tokens) on re-admission;
//   2. if nobody was preempted, waiting requests are admitted first come first served while the
//      running set has room, the budget lasts and the blocks of their first chunk (plus their
//      next step's slots when that chunk ends their prefill) are free.
// Prefix caching (when the allocator has it): every full block of a request (prompt or generated
// tokens, once their K/V and the drafter's context K/V are in the cache) is registered under the
// chain hash of its prefix, at the start of each step and when the request finishes or is
// preempted. On admission the request's prefill tokens are matched block by block against the
// cache; the matched blocks are shared (one more reference each) and its prefill starts after
// them. At least the prefill's last token is always computed (it gives the logits and taps of the
// first token), so a prefill of exactly N full blocks matches at most N - 1 of them and computes
// the last block into a fresh one. Requests recording prompt logits or taps match nothing (every
// row must be computed to be recorded); their blocks are cached for others all the same. Blocks a
// step writes (from num_computed on) are never shared or cached: checked on every step.
// The budget (max_num_batched_tokens) counts prefill tokens; decode rows run in the fixed-shape
// decode programs. Without chunking, a prefill is scheduled whole (one longer than the budget
// only as the step's first prefill). A request returns every block when it finishes, is aborted
// or is preempted. Not thread-safe (the engine's thread owns it).
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
  int64_t max_num_batched_tokens = 8192;  // prefill tokens per step (the token budget)
  int64_t lookahead_tokens = 0;           // slots a decode step writes past the committed tokens (0: 1)
  bool chunked_prefill = true;            // split prefills longer than the budget across steps
};

// Prefix cache counters of a scheduler (tokens, summed over admissions).
struct PrefixCacheStats {
  int64_t query_tokens = 0;  // prefill tokens of admitted requests that were looked up
  int64_t hit_tokens = 0;    // of them, found in the cache (not computed)
};

// Rows of one request in an eager forward: [req->num_computed, req->num_computed + num_tokens)
// (a prefill chunk, or the one row of a decode step that runs eagerly).
struct PrefillChunk {
  Request* req = nullptr;
  int64_t num_tokens = 0;
  int64_t end() const { return req->num_computed + num_tokens; }
  // Whether the last row samples the next token: a new request's last prompt chunk, or a decode
  // row (a resumed request's last chunk ends before its last token and samples nothing).
  bool samples() const { return end() == req->num_tokens(); }
};

// What one step runs, in the running set's order.
struct Schedule {
  std::vector<Request*> decode;       // past their prefill: one decode / draft-verify row each
  std::vector<PrefillChunk> prefill;  // prefill chunks (new, partly prefilled or resumed requests)
  int64_t num_preempted = 0;          // requests preempted while scheduling this step
  bool empty() const { return decode.empty() && prefill.empty(); }
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, BlockAllocator& allocator);

  const SchedulerConfig& config() const { return config_; }
  // Takes ownership; the request waits until admitted.
  void add(std::unique_ptr<Request> req);
  // Grows, preempts and admits (see the header comment); returns what this step runs.
  Schedule schedule();
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
  // Slots a decode step writes past the committed tokens (>= 1).
  int64_t step_tokens() const { return config_.lookahead_tokens > 0 ? config_.lookahead_tokens : 1; }
  // KV slots the request may hold at most (prompt + max new tokens + a step's lookahead): it must
  // fit the whole cache, or the request could never finish even alone.
  int64_t worst_case_tokens(const Request& req) const;
  const PrefixCacheStats& prefix_cache_stats() const { return prefix_stats_; }

 private:
  // Registers the request's full, computed blocks not yet registered (prefix caching).
  void cache_full_blocks(Request& req);
  // The cached blocks matching the request's leading prefill tokens, at most up to its prefill's
  // second-to-last token, with their chain hashes; takes no reference.
  void match_prefix(const Request& req, std::vector<int32_t>* blocks, std::vector<uint64_t>* hashes) const;
  // Throws unless every block the request's next writes go to (from num_computed on) is held by
  // this request alone and not cached.
  void check_writable(const Request& req) const;
  // Frees the blocks of the newest running request and puts it at the front of the waiting
  // queue (its generated tokens kept; num_computed back to 0).
  void preempt_newest();

  SchedulerConfig config_;
  BlockAllocator& allocator_;
  std::deque<std::unique_ptr<Request>> waiting_;
  std::vector<std::unique_ptr<Request>> running_;  // admission order: the back is the newest
  std::map<int64_t, std::unique_ptr<Request>> finished_;
  PrefixCacheStats prefix_stats_;
};

}  // namespace dflash
