// JSON helpers: file reading and typed field access with messages naming file and field.
#include "common/json_util.h"

#include <fstream>
#include <sstream>

namespace dflash {

Json json_parse(const std::string& text, const std::string& what) {
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {
    throw Error(detail::concat(what, ": invalid JSON: ", e.what()));
  }
}

Json json_read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DFLASH_CHECK(in.good(), "cannot open ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return json_parse(ss.str(), path);
}

namespace {
const Json& require(const Json& j, const std::string& key, const std::string& what) {
  DFLASH_CHECK(j.is_object(), what, ": expected a JSON object");
  auto it = j.find(key);
  DFLASH_CHECK(it != j.end() && !it->is_null(), what, ": missing field '", key, "'");
  return *it;
}
}  // namespace

int64_t json_get_int(const Json& j, const std::string& key, const std::string& what) {
  const Json& v = require(j, key, what);
  DFLASH_CHECK(v.is_number_integer(), what, ": field '", key, "' must be an integer, got ",
               v.dump());
  return v.get<int64_t>();
}

double json_get_double(const Json& j, const std::string& key, const std::string& what) {
  const Json& v = require(j, key, what);
  DFLASH_CHECK(v.is_number(), what, ": field '", key, "' must be a number, got ", v.dump());
  return v.get<double>();
}

std::string json_get_string(const Json& j, const std::string& key, const std::string& what) {
  const Json& v = require(j, key, what);
  DFLASH_CHECK(v.is_string(), what, ": field '", key, "' must be a string, got ", v.dump());
  return v.get<std::string>();
}

std::optional<int64_t> json_opt_int(const Json& j, const std::string& key,
                                    const std::string& what) {
  if (!j.is_object() || !j.contains(key) || j.at(key).is_null()) return std::nullopt;
  return json_get_int(j, key, what);
}

std::optional<double> json_opt_double(const Json& j, const std::string& key,
                                      const std::string& what) {
  if (!j.is_object() || !j.contains(key) || j.at(key).is_null()) return std::nullopt;
  return json_get_double(j, key, what);
}

std::optional<bool> json_opt_bool(const Json& j, const std::string& key,
                                  const std::string& what) {
  if (!j.is_object() || !j.contains(key) || j.at(key).is_null()) return std::nullopt;
  const Json& v = j.at(key);
  DFLASH_CHECK(v.is_boolean(), what, ": field '", key, "' must be a boolean, got ", v.dump());
  return v.get<bool>();
}

}  // namespace dflash
