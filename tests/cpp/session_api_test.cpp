// The public C++ API (include/dflash/), linked against the shared library libdflash like any
// client: no internal header is included. A tiny random Llama (test_files.h) on the CPU:
// streaming callbacks equal generate(), continuous batching and seeds give the same tokens,
// abort, refused requests, callback exceptions, stop tokens, the exception hierarchy, version.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "dflash/dflash.h"
#include "test_files.h"

namespace {

class SessionApi : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new std::string(dflash_test::make_temp_dir("api"));
    dflash_test::write_tiny_llama(model_dir());
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*root_);
    delete root_;
  }
  static std::string model_dir() { return *root_ + "/tiny"; }
  static dflash::SessionOptions options() {
    dflash::SessionOptions o;
    o.device = "cpu";
    o.num_threads = 2;
    o.kv_cache_tokens = 1024;
    return o;
  }
  static dflash::SamplingParams params(int64_t max_tokens, float temperature = 0.0f, uint64_t seed = 0) {
    dflash::SamplingParams p;
    p.max_tokens = max_tokens;
    p.temperature = temperature;
    p.seed = seed;
    return p;
  }
  static void expect_no_leaks(const dflash::Session& s) {
    const dflash::SessionStats st = s.stats();
    EXPECT_EQ(st.num_free_blocks, st.num_blocks);
    EXPECT_EQ(st.num_running_requests + st.num_waiting_requests, 0);
    EXPECT_FALSE(s.has_unfinished());
  }

  static std::string* root_;
};
std::string* SessionApi::root_ = nullptr;

const std::vector<int32_t> kPromptA = {3, 14, 15, 9, 26, 5};
const std::vector<int32_t> kPromptB = {27, 18, 28, 1};

TEST(Version, HeadersAndLibraryAgree) {
  EXPECT_EQ(std::string(dflash::version()), DFLASH_VERSION_STRING);
  EXPECT_EQ(DFLASH_VERSION, DFLASH_VERSION_MAJOR * 10000 + DFLASH_VERSION_MINOR * 100 + DFLASH_VERSION_PATCH);
  EXPECT_EQ(std::string(DFLASH_VERSION_STRING), std::to_string(DFLASH_VERSION_MAJOR) + "." +
                                                    std::to_string(DFLASH_VERSION_MINOR) + "." +
                                                    std::to_string(DFLASH_VERSION_PATCH));
}

TEST_F(SessionApi, ErrorsFormOneHierarchy) {
  // A broken path is a dflash::Error, a bad option an InvalidArgument; both are dflash::Exception.
  EXPECT_THROW(dflash::Session(*root_ + "/missing", options()), dflash::Error);
  try {
    dflash::Session s(*root_ + "/missing", options());
    FAIL() << "expected an exception";
  } catch (const dflash::Exception& e) {
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos) << e.what();
  }
  dflash::SessionOptions bad = options();
  bad.block_size = 0;
  EXPECT_THROW(dflash::Session(model_dir(), bad), dflash::InvalidArgument);
  bad = options();
  bad.device = "tpu";
  try {
    dflash::Session s(model_dir(), bad);
    FAIL() << "expected an exception";
  } catch (const dflash::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("tpu"), std::string::npos) << e.what();
  }
  static_assert(std::is_base_of<dflash::Exception, dflash::Error>::value, "");
  static_assert(std::is_base_of<dflash::Exception, dflash::InvalidArgument>::value, "");
  static_assert(std::is_base_of<std::runtime_error, dflash::Exception>::value, "");
}

TEST_F(SessionApi, ModelInfoAndStatsDescribeTheSession) {
  dflash::Session s(model_dir(), options());
  const dflash::ModelInfo& m = s.model_info();
  EXPECT_EQ(m.architecture, "LlamaForCausalLM");
  EXPECT_EQ(m.vocab_size, 64);
  EXPECT_EQ(m.hidden_size, 32);
  EXPECT_EQ(m.num_layers, 2);
  EXPECT_EQ(m.num_heads, 4);
  EXPECT_EQ(m.num_kv_heads, 2);
  EXPECT_EQ(m.head_dim, 8);
  EXPECT_EQ(m.max_model_len, 256);
  EXPECT_TRUE(m.eos_token_ids.empty());
  const dflash::SessionStats st = s.stats();
  EXPECT_EQ(st.device, "cpu");
  EXPECT_EQ(st.kv_cache_tokens, 1024);
  EXPECT_EQ(st.num_blocks, 1024 / 16);
  EXPECT_GT(st.weight_bytes, 0);
  EXPECT_EQ(st.num_speculative_tokens, 0);
  EXPECT_EQ(st.speculation, "");
  expect_no_leaks(s);
}

TEST_F(SessionApi, StreamedTokensEqualGenerate) {
  dflash::Session s(model_dir(), options());
  const std::vector<dflash::RequestOutput> want = s.generate({kPromptA, kPromptB}, params(9));
  ASSERT_EQ(want.size(), 2u);
  EXPECT_EQ(want[0].token_ids.size(), 9u);
  EXPECT_EQ(want[0].finish_reason, "length");
  EXPECT_EQ(want[0].prompt_token_ids, kPromptA);
  EXPECT_EQ(want[1].metrics.prompt_tokens, static_cast<int64_t>(kPromptB.size()));
  EXPECT_EQ(want[1].metrics.generated_tokens, 9);
  EXPECT_GT(want[1].metrics.total_time_s, 0.0);

  std::map<int64_t, std::vector<int32_t>> streamed;
  std::map<int64_t, dflash::RequestOutput> finals;
  int last_calls = 0;
  auto on_output = [&](const dflash::StepOutput& out) {
    EXPECT_FALSE(finals.count(out.request_id)) << "a call after the last one";
    streamed[out.request_id].insert(streamed[out.request_id].end(), out.new_tokens.begin(), out.new_tokens.end());
    if (out.finished) {
      ++last_calls;
      EXPECT_EQ(out.finish_reason, "length");
      finals[out.request_id] = s.take_result(out.request_id);  // allowed on the last call
    }
  };
  const int64_t a = s.add_request(kPromptA, params(9), on_output);
  const int64_t b = s.add_request(kPromptB, params(9), on_output);
  s.run();
  EXPECT_EQ(last_calls, 2);
  EXPECT_EQ(streamed[a], want[0].token_ids);
  EXPECT_EQ(streamed[b], want[1].token_ids);
  EXPECT_EQ(finals[a].token_ids, want[0].token_ids);
  EXPECT_EQ(finals[b].finish_reason, "length");
  EXPECT_THROW(s.take_result(a), dflash::InvalidArgument);  // already taken
  expect_no_leaks(s);
}

TEST_F(SessionApi, ContinuousBatchingAndSeedsGiveTheSameTokens) {
  dflash::Session s(model_dir(), options());
  for (float t : {0.0f, 0.9f}) {
    const std::vector<dflash::RequestOutput> alone_a = s.generate({kPromptA}, params(12, t, 7));
    const std::vector<dflash::RequestOutput> alone_b = s.generate({kPromptB}, params(12, t, 11));
    // b arrives while a is decoding.
    const int64_t a = s.add_request(kPromptA, params(12, t, 7));
    for (int i = 0; i < 3; ++i) s.step();
    const int64_t b = s.add_request(kPromptB, params(12, t, 11));
    s.run();
    EXPECT_EQ(s.take_result(a).token_ids, alone_a[0].token_ids) << "temperature " << t;
    EXPECT_EQ(s.take_result(b).token_ids, alone_b[0].token_ids) << "temperature " << t;
  }
  // Another seed changes a sampled request.
  const auto one = s.generate({kPromptA}, params(12, 0.9f, 7)), two = s.generate({kPromptA}, params(12, 0.9f, 8));
  EXPECT_NE(one[0].token_ids, two[0].token_ids);
  expect_no_leaks(s);
}

TEST_F(SessionApi, AbortEndsARequestAndItsStream) {
  dflash::Session s(model_dir(), options());
  std::vector<dflash::StepOutput> calls;
  const int64_t id = s.add_request(kPromptA, params(50), [&](const dflash::StepOutput& out) { calls.push_back(out); });
  s.step();
  s.step();
  EXPECT_TRUE(s.abort(id));
  EXPECT_FALSE(s.abort(id));
  EXPECT_FALSE(s.abort(12345));
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_TRUE(calls.back().finished);
  EXPECT_EQ(calls.back().finish_reason, "abort");
  EXPECT_TRUE(calls.back().new_tokens.empty());
  const dflash::RequestOutput r = s.take_result(id);
  EXPECT_EQ(r.finish_reason, "abort");
  EXPECT_EQ(r.token_ids.size(), 2u);
  s.run();
  EXPECT_EQ(calls.size(), 3u);
  // A waiting request (never stepped) can be aborted too.
  const int64_t waiting = s.add_request(kPromptB, params(5));
  EXPECT_TRUE(s.abort(waiting));
  EXPECT_TRUE(s.take_result(waiting).token_ids.empty());
  expect_no_leaks(s);
}

TEST_F(SessionApi, BadRequestsAreRefusedWithoutDisturbingOthers) {
  dflash::Session s(model_dir(), options());
  const int64_t good = s.add_request(kPromptA, params(6));
  s.step();
  EXPECT_THROW(s.add_request({}, params(4)), dflash::InvalidArgument);
  EXPECT_THROW(s.add_request({1, 64}, params(4)), dflash::InvalidArgument);  // outside the vocabulary
  EXPECT_THROW(s.add_request({1, -1}, params(4)), dflash::InvalidArgument);
  EXPECT_THROW(s.add_request(kPromptA, params(0)), dflash::InvalidArgument);
  EXPECT_THROW(s.add_request(kPromptA, params(4, -1.0f)), dflash::InvalidArgument);
  dflash::SamplingParams p = params(4);
  p.top_p = 0.0f;
  EXPECT_THROW(s.add_request(kPromptA, p), dflash::InvalidArgument);
  EXPECT_THROW(s.add_request(std::vector<int32_t>(300, 1), params(4)), dflash::InvalidArgument);  // > max_model_len
  EXPECT_THROW(s.take_result(good), dflash::InvalidArgument);  // not finished
  EXPECT_THROW(s.generate({kPromptA, kPromptB}, std::vector<dflash::SamplingParams>(3)), dflash::InvalidArgument);
  s.run();
  const dflash::RequestOutput r = s.take_result(good);
  EXPECT_EQ(r.token_ids.size(), 6u);
  EXPECT_EQ(r.token_ids, s.generate({kPromptA}, params(6))[0].token_ids);
  expect_no_leaks(s);
}

TEST_F(SessionApi, AThrowingCallbackAbortsOnlyItsRequest) {
  dflash::Session s(model_dir(), options());
  int calls = 0;
  const int64_t bad = s.add_request(kPromptA, params(10), [&](const dflash::StepOutput&) {
    if (++calls == 2) throw std::runtime_error("consumer gone");
  });
  std::vector<int32_t> good_tokens;
  const int64_t good = s.add_request(kPromptB, params(10), [&](const dflash::StepOutput& out) {
    good_tokens.insert(good_tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
  });
  s.step();
  try {
    s.step();
    FAIL() << "expected the callback's exception";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "consumer gone");
  }
  EXPECT_EQ(good_tokens.size(), 2u);  // the step's other callbacks ran
  s.run();
  EXPECT_EQ(calls, 2);  // no call after it threw
  EXPECT_EQ(s.take_result(bad).finish_reason, "abort");
  const dflash::RequestOutput g = s.take_result(good);
  EXPECT_EQ(g.finish_reason, "length");
  EXPECT_EQ(g.token_ids, good_tokens);
  expect_no_leaks(s);
}

TEST_F(SessionApi, StepFromACallbackIsRefused) {
  dflash::Session s(model_dir(), options());
  const int64_t id = s.add_request(kPromptA, params(4), [&](const dflash::StepOutput&) { s.step(); });
  EXPECT_THROW(s.step(), dflash::InvalidArgument);
  EXPECT_EQ(s.take_result(id).finish_reason, "abort");
  expect_no_leaks(s);
}

TEST_F(SessionApi, StopTokensEndARequest) {
  dflash::Session s(model_dir(), options());
  const std::vector<int32_t> free_run = s.generate({kPromptA}, params(8))[0].token_ids;
  ASSERT_EQ(free_run.size(), 8u);
  // The first token after the first that did not occur before it: the run must stop right there.
  size_t stop_at = 1;
  while (stop_at < free_run.size() &&
         std::find(free_run.begin(), free_run.begin() + stop_at, free_run[stop_at]) != free_run.begin() + stop_at) {
    ++stop_at;
  }
  ASSERT_LT(stop_at, free_run.size()) << "the tiny model repeats one token";
  dflash::SamplingParams p = params(8);
  p.stop_token_ids = {free_run[stop_at]};
  const dflash::RequestOutput r = s.generate({kPromptA}, p)[0];
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(r.token_ids, std::vector<int32_t>(free_run.begin(), free_run.begin() + stop_at + 1));
}

TEST_F(SessionApi, AMovedFromSessionRefusesCalls) {
  dflash::Session s(model_dir(), options());
  dflash::Session t = std::move(s);
  EXPECT_EQ(t.model_info().vocab_size, 64);
  EXPECT_THROW(s.step(), dflash::InvalidArgument);  // NOLINT(bugprone-use-after-move): the documented state
  EXPECT_EQ(t.generate({kPromptB}, params(3))[0].token_ids.size(), 3u);
}

}  // namespace
