// The library's own access to a public dflash::Session's runtime (not installed, not public):
// the Python bindings open sessions with test hooks beyond SessionOptions, add requests with
// the runtime's debug inputs (forced tokens, recordings, oracle drafts), take results with their
// recordings, and reach the runtime's inspection hooks (propose, block reference counts).
// Everything else goes through the public API, the same code as for a C++ user.
#pragma once

#include <string>
#include <vector>

#include "dflash/session.h"
#include "runtime/session.h"

namespace dflash {
namespace detail {

using runtime::SessionHooks;

// The runtime's config for the public options ("auto" device resolved) and hooks.
runtime::SessionConfig runtime_config(const SessionOptions& options, const SessionHooks& hooks);

struct SessionAccess {
  static Session open(const std::string& model_dir, const SessionOptions& options, const SessionHooks& hooks);
  static runtime::Session& core(Session& session);
  static const runtime::Session& core(const Session& session);
  // Session::add_request with the runtime's whole request input.
  static int64_t add_request(Session& session, RequestInput input, StreamCallback on_output = nullptr);
  // Session::take_result with the recorded logits and taps.
  static runtime::RequestResult take_result(Session& session, int64_t request_id);
};

}  // namespace detail
}  // namespace dflash
