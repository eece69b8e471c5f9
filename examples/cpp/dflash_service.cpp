// dflash_service: a small generation service over the dflash C++ library, to start from.
//
//   dflash_service MODEL_DIR [--draft DIR] [--device auto|cpu|cuda] [--threads N]
//                            [--max-num-seqs N] [--kv-cache-tokens N] [--max-model-len N]
//
// Reads requests from stdin, one JSON object per line, while it generates (continuous batching:
// a request arriving while others run joins the next step):
//   {"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 16, "temperature": 0, "top_p": 1,
//    "top_k": 0, "seed": 1, "stop_token_ids": [], "ignore_eos": false}
//     (only id and prompt_token_ids are required; id is a string, unique among live requests)
//   {"id": "a", "abort": true}     ends a running request (finish_reason "abort")
// Writes JSON lines to stdout as tokens are generated:
//   {"id": "a", "token_ids": [5, 6]}                          new tokens of a step
//   {"id": "a", "finish_reason": "length", "metrics": {...}}  the request's last line
//   {"id": "a", "error": "..."}                               a refused line ("id" null if unknown)
// A bad line is answered with an error line; the other requests go on. At the end of stdin the
// service finishes the requests it has and exits. Logs go to stderr.
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "dflash/dflash.h"

using Json = nlohmann::json;

namespace {

// Lines of stdin, read on their own thread so that generation never waits for input.
class LineQueue {
 public:
  void push(std::string line) {
    std::lock_guard<std::mutex> lock(mutex_);
    lines_.push_back(std::move(line));
    ready_.notify_one();
  }
  void close() {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    ready_.notify_one();
  }
  // The lines queued so far; with wait, blocks until there is one or stdin ended.
  std::deque<std::string> take(bool wait, bool* closed) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (wait) ready_.wait(lock, [&] { return !lines_.empty() || closed_; });
    *closed = closed_;
    std::deque<std::string> out;
    out.swap(lines_);
    return out;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::string> lines_;
  bool closed_ = false;
};

void emit(const Json& line) { std::cout << line.dump() << '\n'; }

void emit_error(const Json& id, const std::string& message) { emit({{"id", id}, {"error", message}}); }

Json metrics_json(const dflash::RequestMetrics& m) {
  return {{"prompt_tokens", m.prompt_tokens},
          {"generated_tokens", m.generated_tokens},
          {"num_steps", m.num_steps},
          {"time_to_first_token_s", m.time_to_first_token_s},
          {"decode_tokens_per_s", m.decode_tokens_per_s},
          {"total_time_s", m.total_time_s},
          {"num_spec_steps", m.num_spec_steps},
          {"num_drafted", m.num_drafted},
          {"num_accepted", m.num_accepted},
          {"acceptance_length", m.acceptance_length()},
          {"num_cached_tokens", m.num_cached_tokens},
          {"num_preemptions", m.num_preemptions}};
}

// A field of the request line, or `fallback` when absent; throws std::invalid_argument naming the
// field on a wrong type or an out-of-range integer.
template <typename T>
T field(const Json& j, const char* name, T fallback) {
  if (!j.contains(name)) return fallback;
  const Json& v = j[name];
  bool ok;
  if constexpr (std::is_same_v<T, bool>) {
    ok = v.is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    using Limits = std::numeric_limits<T>;
    if (v.is_number_unsigned()) {
      ok = v.get<uint64_t>() <= static_cast<uint64_t>(Limits::max());
    } else if (v.is_number_integer()) {
      const int64_t x = v.get<int64_t>();
      ok = std::is_signed_v<T> ? x >= static_cast<int64_t>(Limits::min()) && x <= static_cast<int64_t>(Limits::max())
                               : x >= 0;
    } else {
      ok = false;
    }
  } else {
    ok = v.is_number();
  }
  if (!ok) throw std::invalid_argument(std::string("field '") + name + "' has a wrong type or range: " + v.dump());
  return v.get<T>();
}

std::vector<int32_t> token_ids(const Json& j, const char* name, bool required) {
  if (!j.contains(name)) {
    if (required) throw std::invalid_argument(std::string("missing field '") + name + "'");
    return {};
  }
  const Json& v = j[name];
  if (!v.is_array()) throw std::invalid_argument(std::string("field '") + name + "' must be a list of token ids");
  std::vector<int32_t> out;
  for (const Json& t : v) {
    if (!t.is_number_integer() || t.get<int64_t>() < std::numeric_limits<int32_t>::min() ||
        t.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      throw std::invalid_argument(std::string("field '") + name + "' holds a value that is not a token id: " +
                                  t.dump());
    }
    out.push_back(t.get<int32_t>());
  }
  return out;
}

dflash::SamplingParams sampling_params(const Json& j) {
  dflash::SamplingParams p;
  p.max_tokens = field<int64_t>(j, "max_tokens", p.max_tokens);
  p.temperature = static_cast<float>(field<double>(j, "temperature", p.temperature));
  p.top_p = static_cast<float>(field<double>(j, "top_p", p.top_p));
  p.top_k = field<int32_t>(j, "top_k", p.top_k);
  p.seed = field<uint64_t>(j, "seed", p.seed);
  p.stop_token_ids = token_ids(j, "stop_token_ids", false);
  p.ignore_eos = field<bool>(j, "ignore_eos", p.ignore_eos);
  return p;
}

class Service {
 public:
  explicit Service(dflash::Session& session) : session_(session) {}

  // One line of stdin: a request, an abort, or an error answer.
  void handle(const std::string& line) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) return;
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) return emit_error(nullptr, "not a JSON object: " + line);
    if (!j.contains("id") || !j["id"].is_string()) {
      return emit_error(j.value("id", Json()), "missing string field 'id'");
    }
    const std::string id = j["id"].get<std::string>();
    try {
      if (field<bool>(j, "abort", false)) {
        auto it = live_.find(id);
        if (it == live_.end()) return emit_error(id, "no running request with this id");
        session_.abort(it->second);  // its callback writes the last line
        return;
      }
      if (live_.count(id)) return emit_error(id, "a request with this id is running");
      std::vector<int32_t> prompt = token_ids(j, "prompt_token_ids", true);
      const dflash::SamplingParams params = sampling_params(j);
      live_[id] = session_.add_request(std::move(prompt), params, [this, id](const dflash::StepOutput& out) {
        on_output(id, out);
      });
    } catch (const std::invalid_argument& e) {  // a bad field of the line
      emit_error(id, e.what());
    } catch (const dflash::InvalidArgument& e) {  // refused by the session (vocabulary, lengths, ...)
      emit_error(id, e.what());
    }
  }

  // Writes an error line for every live request (after a failure of the runtime).
  void fail_all(const std::string& message) {
    const std::map<std::string, int64_t> live = live_;  // the abort callbacks erase from live_
    for (const auto& [id, request_id] : live) {
      emit_error(id, message);
      session_.abort(request_id);
    }
  }

 private:
  void on_output(const std::string& id, const dflash::StepOutput& out) {
    if (!out.new_tokens.empty()) emit({{"id", id}, {"token_ids", out.new_tokens}});
    if (!out.finished) return;
    live_.erase(id);
    const dflash::RequestOutput result = session_.take_result(out.request_id);
    emit({{"id", id}, {"finish_reason", result.finish_reason}, {"metrics", metrics_json(result.metrics)}});
  }

  dflash::Session& session_;
  std::map<std::string, int64_t> live_;  // request line id -> session request id
};

int usage(const char* argv0) {
  std::cerr << "usage: " << argv0
            << " MODEL_DIR [--draft DIR] [--device auto|cpu|cuda] [--threads N] [--max-num-seqs N]"
               " [--kv-cache-tokens N] [--max-model-len N]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage(argv[0]);
  const std::string model_dir = argv[1];
  dflash::SessionOptions options;
  for (int i = 2; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return usage(argv[0]);
    const std::string value = argv[++i];
    char* end = nullptr;
    const long long number = std::strtoll(value.c_str(), &end, 10);
    const bool integer = end != value.c_str() && *end == '\0' && number >= 0;
    if (flag == "--draft") {
      options.draft_dir = value;
    } else if (flag == "--device") {
      options.device = value;
    } else if (flag == "--threads" && integer) {
      options.num_threads = static_cast<int>(number);
    } else if (flag == "--max-num-seqs" && integer) {
      options.max_num_seqs = number;
    } else if (flag == "--kv-cache-tokens" && integer) {
      options.kv_cache_tokens = number;
    } else if (flag == "--max-model-len" && integer) {
      options.max_model_len = number;
    } else {
      return usage(argv[0]);
    }
  }

  std::unique_ptr<dflash::Session> session;
  try {
    session = std::make_unique<dflash::Session>(model_dir, options);
  } catch (const dflash::Exception& e) {
    std::cerr << "dflash_service: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "dflash_service: dflash " << dflash::version() << ", " << session->stats().device << ", "
            << session->model_info().architecture << (options.draft_dir.empty() ? "" : " with a drafter")
            << "; reading requests from stdin\n";

  LineQueue queue;
  std::thread reader([&queue] {
    std::string line;
    while (std::getline(std::cin, line)) queue.push(line);
    queue.close();
  });

  Service service(*session);
  int status = 0;
  for (bool closed = false;;) {
    // Idle: wait for input; generating: take what arrived without waiting.
    for (const std::string& line : queue.take(/*wait=*/!session->has_unfinished(), &closed)) service.handle(line);
    if (session->has_unfinished()) {
      try {
        session->step();  // the stream callbacks write the lines
      } catch (const dflash::Exception& e) {
        std::cerr << "dflash_service: the runtime failed: " << e.what() << "\n";
        service.fail_all(e.what());
        status = 1;
      }
    } else if (closed) {
      break;
    }
    std::cout.flush();
  }
  std::cout.flush();
  reader.join();
  return status;
}
