// JSON helpers: bounded parsing (depth, duplicate keys), file reading and typed field access
// with messages naming file and field.
#include "common/json_util.h"

#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <vector>

namespace dflash {

namespace {

// `s` with every byte that is not part of well-formed UTF-8, and every control character,
// written as \xNN: nlohmann's syntax errors quote the offending input bytes.
std::string printable(const std::string& s) {
  std::string out;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    bool ok = len != 0 && i + len <= n && (len != 2 || c >= 0xc2);
    for (size_t k = 1; ok && k < len; ++k) ok = (p[i + k] & 0xc0) == 0x80;
    if (ok && len == 3) {  // no overlong forms, no surrogates
      ok = !(c == 0xe0 && p[i + 1] < 0xa0) && !(c == 0xed && p[i + 1] >= 0xa0);
    } else if (ok && len == 4) {
      ok = !(c == 0xf0 && p[i + 1] < 0x90) && !(c == 0xf4 && p[i + 1] >= 0x90) && c <= 0xf4;
    }
    if (!ok || (len == 1 && (c < 0x20 || c == 0x7f))) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
      ++i;
      continue;
    }
    out.append(s, i, len);
    i += len;
  }
  return out;
}

// Refuses nesting beyond kJsonMaxDepth and a key repeated within one object while nlohmann
// parses (before any value deeper than the limit exists).
class ParseGuard {
 public:
  explicit ParseGuard(const std::string& what) : what_(what) {}

  bool operator()(int depth, Json::parse_event_t event, Json& parsed) {
    using E = Json::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      // depth counts the containers around this one.
      DFLASH_CHECK(depth < kJsonMaxDepth, what_, ": JSON nests deeper than ", kJsonMaxDepth, " levels");
    }
    if (event == E::object_start) {
      keys_.emplace_back();
    } else if (event == E::object_end) {
      keys_.pop_back();
    } else if (event == E::key) {
      const std::string& key = parsed.get_ref<const std::string&>();
      DFLASH_CHECK(keys_.back().insert(key).second, what_, ": duplicate key ", json_brief(parsed),
                   " in a JSON object");
    }
    return true;
  }

 private:
  const std::string& what_;
  std::vector<std::set<std::string>> keys_;  // [open objects] keys seen so far in each
};

const Json& require(const Json& j, const std::string& key, const std::string& what) {
  DFLASH_CHECK(j.is_object(), what, ": expected a JSON object");
  auto it = j.find(key);
  DFLASH_CHECK(it != j.end() && !it->is_null(), what, ": missing field '", key, "'");
  return *it;
}

// The field, or nullptr when it is absent or null.
const Json* present(const Json& j, const std::string& key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

}  // namespace

Json json_parse(const std::string& text, const std::string& what) {
  ParseGuard guard(what);
  try {
    return Json::parse(text, std::ref(guard));
  } catch (const Json::exception& e) {
    throw Error(detail::concat(what, ": invalid JSON: ", printable(e.what())));
  }
}

Json json_read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DFLASH_CHECK(in.good(), "cannot open ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return json_parse(ss.str(), path);
}

std::string json_brief(const Json& v) {
  constexpr size_t kMax = 80;
  // Strings were checked to be UTF-8 by the parser; replace keeps a cut message printable.
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > kMax) s = s.substr(0, kMax) + "...";
  return printable(s);
}

int64_t json_int_value(const Json& v, const std::string& field, const std::string& what, int64_t lo, int64_t hi) {
  DFLASH_CHECK(v.is_number_integer(), what, ": field '", field, "' must be an integer, got ", json_brief(v));
  const bool fits = !v.is_number_unsigned() || v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX);
  const int64_t x = fits ? v.get<int64_t>() : 0;
  DFLASH_CHECK(fits && x >= lo && x <= hi, what, ": field '", field, "' is ", json_brief(v), ", outside [", lo, ", ",
               hi, "]");
  return x;
}

int64_t json_get_int(const Json& j, const std::string& key, const std::string& what) {
  return json_int_value(require(j, key, what), key, what);
}

double json_get_double(const Json& j, const std::string& key, const std::string& what) {
  const Json& v = require(j, key, what);
  DFLASH_CHECK(v.is_number(), what, ": field '", key, "' must be a number, got ", json_brief(v));
  return v.get<double>();
}

std::string json_get_string(const Json& j, const std::string& key, const std::string& what) {
  const Json& v = require(j, key, what);
  DFLASH_CHECK(v.is_string(), what, ": field '", key, "' must be a string, got ", json_brief(v));
  return v.get<std::string>();
}

std::optional<int64_t> json_opt_int(const Json& j, const std::string& key,
                                    const std::string& what) {
  if (!present(j, key)) return std::nullopt;
  return json_get_int(j, key, what);
}

std::optional<double> json_opt_double(const Json& j, const std::string& key,
                                      const std::string& what) {
  if (!present(j, key)) return std::nullopt;
  return json_get_double(j, key, what);
}

std::optional<bool> json_opt_bool(const Json& j, const std::string& key,
                                  const std::string& what) {
  const Json* v = present(j, key);
  if (!v) return std::nullopt;
  DFLASH_CHECK(v->is_boolean(), what, ": field '", key, "' must be a boolean, got ", json_brief(*v));
  return v->get<bool>();
}

std::optional<std::string> json_opt_string(const Json& j, const std::string& key, const std::string& what) {
  if (!present(j, key)) return std::nullopt;
  return json_get_string(j, key, what);
}

const Json* json_opt_object(const Json& j, const std::string& key, const std::string& what) {
  const Json* v = present(j, key);
  DFLASH_CHECK(!v || v->is_object(), what, ": field '", key, "' must be an object, got ", json_brief(*v));
  return v;
}

const Json* json_opt_array(const Json& j, const std::string& key, const std::string& what) {
  const Json* v = present(j, key);
  DFLASH_CHECK(!v || v->is_array(), what, ": field '", key, "' must be a list, got ", json_brief(*v));
  return v;
}

}  // namespace dflash
