// The public dflash::Session (include/dflash/session.h) over the runtime's Session: options
// mapped onto the runtime's config, per-request stream callbacks run after each step, results
// converted to RequestOutput. Also the library's own access for the Python bindings
// (session_access.h).
#include <exception>
#include <set>
#include <unordered_map>
#include <utility>

#include "api/session_access.h"
#include "common/error.h"

namespace dflash {

class Session::Impl {
 public:
  Impl(const std::string& model_dir, const runtime::SessionConfig& config) : core(model_dir, config) {
    const ModelConfig& c = core.model_config();
    info.architecture = c.arch_name;
    info.vocab_size = c.vocab_size;
    info.hidden_size = c.hidden_size;
    info.num_layers = c.num_layers;
    info.num_heads = c.num_heads;
    info.num_kv_heads = c.num_kv_heads;
    info.head_dim = c.head_dim;
    info.max_position_embeddings = c.max_position_embeddings;
    info.max_model_len = core.max_model_len();
    info.eos_token_ids = c.eos_token_ids;
    info.bos_token_id = c.bos_token_id;
    info.tie_word_embeddings = c.tie_word_embeddings;
  }

  int64_t add(RequestInput input, StreamCallback on_output) {
    const int64_t id = core.add_request(std::move(input));
    if (on_output) callbacks[id] = std::make_shared<const StreamCallback>(std::move(on_output));
    return id;
  }

  std::vector<StepOutput> step() {
    DFLASH_ARG_CHECK(!in_step, "Session::step() was called from a stream callback");
    struct InStep {
      bool& flag;
      explicit InStep(bool& f) : flag(f) { flag = true; }
      ~InStep() { flag = false; }
    } guard(in_step);
    std::vector<StepOutput> outputs = core.step();
    std::exception_ptr failure;
    for (const StepOutput& out : outputs) {
      auto it = callbacks.find(out.request_id);
      if (it == callbacks.end()) continue;
      const std::shared_ptr<const StreamCallback> callback = it->second;
      if (out.finished) callbacks.erase(it);
      try {
        (*callback)(out);
      } catch (...) {
        if (!failure) failure = std::current_exception();
        callbacks.erase(out.request_id);  // no further call: the request ends here
        if (!out.finished) core.abort(out.request_id);
      }
    }
    if (failure) std::rethrow_exception(failure);
    return outputs;
  }

  bool abort(int64_t id) {
    if (!core.abort(id)) return false;
    auto it = callbacks.find(id);
    if (it != callbacks.end()) {
      const std::shared_ptr<const StreamCallback> callback = it->second;
      callbacks.erase(it);
      StepOutput out;
      out.request_id = id;
      out.finished = true;
      out.finish_reason = "abort";
      (*callback)(out);
    }
    return true;
  }

  // Ends a request and drops its result, whatever its state (generate()'s clean-up).
  void discard(int64_t id) {
    callbacks.erase(id);
    core.abort(id);
    core.take_result(id);
  }

  runtime::Session core;
  ModelInfo info;
  std::unordered_map<int64_t, std::shared_ptr<const StreamCallback>> callbacks;
  bool in_step = false;
};

namespace {

RequestOutput to_output(runtime::RequestResult&& r) {
  RequestOutput out;
  out.request_id = r.request_id;
  out.prompt_token_ids = std::move(r.prompt);
  out.token_ids = std::move(r.token_ids);
  out.finish_reason = std::move(r.finish_reason);
  out.metrics = std::move(r.metrics);
  return out;
}

}  // namespace

Session::Session(const std::string& model_dir, const SessionOptions& options)
    : impl_(std::make_unique<Impl>(model_dir, detail::runtime_config(options, detail::SessionHooks()))) {}

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Session::~Session() = default;
Session::Session(Session&&) noexcept = default;
Session& Session::operator=(Session&&) noexcept = default;

Session::Impl& Session::impl() const {
  DFLASH_ARG_CHECK(impl_ != nullptr, "this dflash::Session was moved from");
  return *impl_;
}

const ModelInfo& Session::model_info() const { return impl().info; }

int64_t Session::add_request(std::vector<int32_t> prompt_token_ids, const SamplingParams& params,
                             StreamCallback on_output) {
  RequestInput input;
  input.prompt = std::move(prompt_token_ids);
  input.sampling = params;
  return impl().add(std::move(input), std::move(on_output));
}

std::vector<StepOutput> Session::step() { return impl().step(); }

void Session::run() {
  while (has_unfinished()) step();
}

std::vector<RequestOutput> Session::generate(const std::vector<std::vector<int32_t>>& prompts,
                                             const SamplingParams& params) {
  return generate(prompts, std::vector<SamplingParams>(prompts.size(), params));
}

std::vector<RequestOutput> Session::generate(const std::vector<std::vector<int32_t>>& prompts,
                                             const std::vector<SamplingParams>& params) {
  DFLASH_ARG_CHECK(params.size() == prompts.size(), "generate: ", params.size(), " SamplingParams for ",
                   prompts.size(), " prompts (pass one, or one per prompt)");
  Impl& s = impl();
  std::vector<int64_t> ids;
  try {
    for (size_t i = 0; i < prompts.size(); ++i) ids.push_back(add_request(prompts[i], params[i]));
    std::set<int64_t> pending(ids.begin(), ids.end());
    while (!pending.empty()) {
      const std::vector<StepOutput> outputs = s.step();
      DFLASH_CHECK(!outputs.empty() || s.core.has_unfinished(), "generate: ", pending.size(),
                   " requests were lost by the engine (internal error)");
      for (const StepOutput& out : outputs) {
        if (out.finished) pending.erase(out.request_id);
      }
    }
  } catch (...) {
    for (int64_t id : ids) {
      try {
        s.discard(id);
      } catch (...) {  // the original exception is the one to report
      }
    }
    throw;
  }
  std::vector<RequestOutput> out;
  for (int64_t id : ids) out.push_back(take_result(id));
  return out;
}

bool Session::abort(int64_t request_id) { return impl().abort(request_id); }

bool Session::has_unfinished() const { return impl().core.has_unfinished(); }

RequestOutput Session::take_result(int64_t request_id) { return to_output(impl().core.take_result(request_id)); }

SessionStats Session::stats() const { return impl().core.stats(); }

namespace detail {

runtime::SessionConfig runtime_config(const SessionOptions& o, const SessionHooks& hooks) {
  runtime::SessionConfig c;
  static_cast<SessionOptions&>(c) = o;
  DFLASH_ARG_CHECK(o.device == "auto" || o.device == "cpu" || o.device == "cuda",
                   "device must be 'auto', 'cpu' or 'cuda', got '", o.device, "'");
  c.device = o.device == "auto" ? (backend_cuda_usable() ? "cuda" : "cpu") : o.device;
  DFLASH_ARG_CHECK(o.num_threads >= 0, "num_threads must be >= 0 (0: all hardware threads), got ", o.num_threads);
  static_cast<SessionHooks&>(c) = hooks;
  return c;
}

Session SessionAccess::open(const std::string& model_dir, const SessionOptions& options,
                            const SessionHooks& hooks) {
  return Session(std::make_unique<Session::Impl>(model_dir, runtime_config(options, hooks)));
}

runtime::Session& SessionAccess::core(Session& session) { return session.impl().core; }
const runtime::Session& SessionAccess::core(const Session& session) { return session.impl().core; }

int64_t SessionAccess::add_request(Session& session, RequestInput input, StreamCallback on_output) {
  return session.impl().add(std::move(input), std::move(on_output));
}

runtime::RequestResult SessionAccess::take_result(Session& session, int64_t request_id) {
  return session.impl().core.take_result(request_id);
}

}  // namespace detail
}  // namespace dflash
