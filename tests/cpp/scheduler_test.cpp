// Scheduler (cpp/runtime/scheduler.h): continuous-batching admission by KV blocks and by
// max_num_seqs, chunked prefill under the token budget, preemption of the newest request by
// recompute, abort, and prefix-cache matching on admission. The engine's part is simulated: each
// scheduled row is "computed" (KV slots appended) and samples token 1000 + position.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "common/error.h"
#include "runtime/scheduler.h"
#include "test_files.h"

namespace dflash {
namespace {

using dflash_test::token_range;

class Harness {
 public:
  Harness(int64_t num_blocks, const SchedulerConfig& config, bool prefix_caching = false)
      : alloc(num_blocks, prefix_caching), sched(config, alloc) {}

  Request* add(std::vector<int32_t> prompt, int64_t max_new_tokens) {
    auto r = std::make_unique<Request>(sched.config().block_size);
    r->id = next_id_++;
    r->input.prompt = std::move(prompt);
    r->max_new_tokens = max_new_tokens;
    Request* p = r.get();
    sched.add(std::move(r));
    return p;
  }

  // One step as the engine runs it; requests reaching max_new_tokens finish with "length".
  Schedule step() {
    Schedule s = sched.schedule();
    for (const PrefillChunk& c : s.prefill) {
      Request* r = c.req;
      const bool samples = c.samples();
      const int64_t end = c.end();
      r->blocks.truncate(r->num_computed);
      r->blocks.append(c.num_tokens);
      r->num_computed = end;
      if (samples) emit(r);
    }
    for (Request* r : s.decode) {
      r->blocks.truncate(r->num_computed);
      r->blocks.append(1);
      r->num_computed += 1;
      emit(r);
    }
    return s;
  }

  BlockAllocator alloc;
  Scheduler sched;

 private:
  void emit(Request* r) {
    r->output.push_back(1000 + static_cast<int32_t>(r->num_tokens()));
    if (static_cast<int64_t>(r->output.size()) >= r->max_new_tokens) sched.finish(r, "length");
  }
  int64_t next_id_ = 0;
};

SchedulerConfig config(int64_t block_size, int64_t max_num_seqs, int64_t budget, bool chunked = true) {
  SchedulerConfig c;
  c.block_size = block_size;
  c.max_num_seqs = max_num_seqs;
  c.max_num_batched_tokens = budget;
  c.chunked_prefill = chunked;
  return c;
}

TEST(Scheduler, AdmitsFirstComeFirstServedUpToMaxNumSeqs) {
  Harness h(64, config(4, 2, 1024));
  Request* a = h.add(token_range(0, 5), 3);
  Request* b = h.add(token_range(10, 5), 1);
  Request* c = h.add(token_range(20, 5), 2);
  Schedule s = h.step();
  ASSERT_EQ(s.prefill.size(), 2u);
  EXPECT_EQ(s.prefill[0].req, a);
  EXPECT_EQ(s.prefill[1].req, b);
  EXPECT_EQ(s.prefill[0].num_tokens, 5);
  EXPECT_EQ(h.sched.num_waiting(), 1);
  EXPECT_EQ(c->status, RequestStatus::kWaiting);
  // b finished with its first token: c takes its place while a decodes.
  s = h.step();
  ASSERT_EQ(s.decode.size(), 1u);
  EXPECT_EQ(s.decode[0], a);
  ASSERT_EQ(s.prefill.size(), 1u);
  EXPECT_EQ(s.prefill[0].req, c);
  while (h.sched.has_unfinished()) h.step();
  for (int64_t id = 0; id < 3; ++id) {
    std::unique_ptr<Request> r = h.sched.take_finished(id);
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(r->finish_reason, "length");
    EXPECT_EQ(static_cast<int64_t>(r->output.size()), r->max_new_tokens);
  }
  EXPECT_EQ(h.alloc.num_free(), 64);
}

TEST(Scheduler, AdmitsOnlyWhatTheFreeBlocksHold) {
  // 4 blocks of 4 slots. A prompt of 7 needs 8 slots (its first decode step writes one more).
  Harness h(4, config(4, 8, 1024));
  h.add(token_range(0, 7), 4);
  h.add(token_range(10, 7), 4);
  Request* c = h.add(token_range(20, 3), 1);
  Schedule s = h.step();
  EXPECT_EQ(s.prefill.size(), 2u);
  EXPECT_EQ(h.alloc.num_free(), 0);
  EXPECT_EQ(c->status, RequestStatus::kWaiting);
  EXPECT_TRUE(c->blocks.blocks().empty());
  while (h.sched.has_unfinished()) h.step();
  EXPECT_EQ(h.alloc.num_free(), 4);
  EXPECT_EQ(h.sched.take_finished(c->id)->output.size(), 1u);
}

TEST(Scheduler, ChunksLongPrefillsUnderTheTokenBudget) {
  Harness h(64, config(4, 8, 4));
  Request* a = h.add(token_range(0, 10), 2);
  std::vector<int64_t> chunks;
  while (a->prefilling() || a->output.empty()) {
    Schedule s = h.step();
    ASSERT_EQ(s.prefill.size(), 1u);
    chunks.push_back(s.prefill[0].num_tokens);
  }
  EXPECT_EQ(chunks, (std::vector<int64_t>{4, 4, 2}));
  EXPECT_EQ(a->num_computed, 10);
  EXPECT_EQ(a->output.size(), 1u);  // the token after the last chunk only
}

TEST(Scheduler, WithoutChunkingAPrefillRunsWholeAndOthersWait) {
  Harness h(64, config(4, 8, 4, /*chunked=*/false));
  Request* a = h.add(token_range(0, 10), 2);  // longer than the budget: alone, as the first prefill
  Request* b = h.add(token_range(20, 3), 2);
  Schedule s = h.step();
  ASSERT_EQ(s.prefill.size(), 1u);
  EXPECT_EQ(s.prefill[0].req, a);
  EXPECT_EQ(s.prefill[0].num_tokens, 10);
  EXPECT_EQ(b->status, RequestStatus::kWaiting);
  s = h.step();
  ASSERT_EQ(s.prefill.size(), 1u);
  EXPECT_EQ(s.prefill[0].req, b);
  EXPECT_EQ(s.prefill[0].num_tokens, 3);
  ASSERT_EQ(s.decode.size(), 1u);
}

TEST(Scheduler, PreemptsTheNewestRequestWhenBlocksRunOutAndRecomputesIt) {
  // 4 blocks of 2 slots: two prompts of 3 take 2 blocks each; growing the older one preempts the newer.
  Harness h(4, config(2, 8, 1024));
  Request* a = h.add(token_range(0, 3), 4);
  Request* b = h.add(token_range(10, 3), 3);
  h.step();  // both prefilled (3 slots + 1 for the next step: 2 blocks each)
  EXPECT_EQ(h.alloc.num_free(), 0);
  Schedule s = h.step();  // both decode within their blocks
  EXPECT_EQ(s.decode.size(), 2u);
  EXPECT_EQ(s.num_preempted, 0);
  s = h.step();  // a needs a third block: b is preempted
  EXPECT_EQ(s.num_preempted, 1);
  ASSERT_EQ(s.decode.size(), 1u);
  EXPECT_EQ(s.decode[0], a);
  EXPECT_TRUE(s.prefill.empty());  // nothing is admitted in a step that preempted
  EXPECT_EQ(b->status, RequestStatus::kWaiting);
  EXPECT_EQ(b->num_computed, 0);
  EXPECT_TRUE(b->blocks.blocks().empty());
  EXPECT_EQ(b->metrics.num_preemptions, 1);
  EXPECT_EQ(b->max_computed, 4);
  const std::vector<int32_t> b_tokens = b->output;  // kept across the preemption
  EXPECT_EQ(b_tokens.size(), 2u);
  EXPECT_EQ(h.alloc.num_free(), 1);
  // a runs to its end; then b is prefilled again: prompt + generated tokens but the last.
  while (a->status != RequestStatus::kFinished) h.step();
  s = h.step();
  ASSERT_EQ(s.prefill.size(), 1u);
  EXPECT_EQ(s.prefill[0].req, b);
  EXPECT_EQ(s.prefill[0].num_tokens, 4);
  EXPECT_EQ(b->output, b_tokens);  // the recompute's last chunk samples nothing
  while (h.sched.has_unfinished()) h.step();
  EXPECT_EQ(b->output.size(), 3u);
  EXPECT_EQ(std::vector<int32_t>(b->output.begin(), b->output.begin() + 2), b_tokens);
  EXPECT_EQ(h.alloc.num_free(), 4);
}

TEST(Scheduler, AbortEndsWaitingAndRunningRequestsAndFreesTheirBlocks) {
  Harness h(8, config(4, 1, 1024));
  Request* a = h.add(token_range(0, 5), 10);
  Request* b = h.add(token_range(10, 5), 10);
  h.step();
  EXPECT_LT(h.alloc.num_free(), 8);
  EXPECT_TRUE(h.sched.abort(b->id));  // waiting
  EXPECT_TRUE(h.sched.abort(a->id));  // running
  EXPECT_FALSE(h.sched.abort(a->id));
  EXPECT_FALSE(h.sched.abort(99));
  EXPECT_FALSE(h.sched.has_unfinished());
  EXPECT_EQ(h.alloc.num_free(), 8);
  std::unique_ptr<Request> ra = h.sched.take_finished(0);
  ASSERT_NE(ra, nullptr);
  EXPECT_EQ(ra->finish_reason, "abort");
  EXPECT_EQ(ra->output.size(), 1u);
  EXPECT_EQ(h.sched.take_finished(0), nullptr);  // taken once
  EXPECT_EQ(h.sched.take_finished(1)->finish_reason, "abort");
}

TEST(Scheduler, SharesCachedPrefixBlocksOnAdmission) {
  Harness h(16, config(4, 8, 1024), /*prefix_caching=*/true);
  Request* a = h.add(token_range(0, 9), 1);
  h.step();  // a finishes with its first token; its two full blocks stay cached
  ASSERT_EQ(a->status, RequestStatus::kFinished);
  EXPECT_EQ(h.alloc.num_cached(), 2);
  EXPECT_EQ(h.alloc.num_free(), 16);
  std::vector<int32_t> prompt = token_range(0, 8);
  prompt.push_back(77);
  prompt.push_back(78);
  Request* b = h.add(prompt, 2);
  Request* c = h.add(prompt, 2);
  Schedule s = h.step();
  ASSERT_EQ(s.prefill.size(), 2u);
  EXPECT_EQ(s.prefill[0].num_tokens, 2);  // after the 8 cached tokens
  EXPECT_EQ(b->metrics.num_cached_tokens, 8);
  EXPECT_EQ(c->metrics.num_cached_tokens, 8);
  ASSERT_GE(b->blocks.blocks().size(), 3u);
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(b->blocks.blocks()[k], c->blocks.blocks()[k]);
    EXPECT_EQ(h.alloc.ref_count(b->blocks.blocks()[k]), 2);
  }
  EXPECT_NE(b->blocks.blocks()[2], c->blocks.blocks()[2]);  // the written block is private
  EXPECT_EQ(h.sched.prefix_cache_stats().query_tokens, 9 + 10 + 10);
  EXPECT_EQ(h.sched.prefix_cache_stats().hit_tokens, 16);
  while (h.sched.has_unfinished()) h.step();
  EXPECT_EQ(h.alloc.num_free(), 16);
}

TEST(Scheduler, APrefillOfWholeBlocksComputesItsLastBlock) {
  Harness h(16, config(4, 8, 1024), true);
  h.add(token_range(0, 8), 1);
  h.step();
  Request* b = h.add(token_range(0, 8), 1);
  Schedule s = h.step();
  ASSERT_EQ(s.prefill.size(), 1u);
  EXPECT_EQ(b->metrics.num_cached_tokens, 4);  // at most N - 1 of N full blocks match
  EXPECT_EQ(s.prefill[0].num_tokens, 4);
}

}  // namespace
}  // namespace dflash
