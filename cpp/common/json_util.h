// Reading JSON files (HF config.json, safetensors headers, shard indexes) with errors that name
// the file and the field. Wraps nlohmann::json; every parse or type error becomes a dflash::Error.
// Hostile input is bounded before it reaches code that recurses: nesting deeper than
// kJsonMaxDepth and duplicate object keys are refused while parsing, integers are read with
// full range checks, and values quoted in messages are shortened (json_brief).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "common/error.h"

namespace dflash {

using Json = nlohmann::json;

// The deepest nesting of arrays/objects accepted. nlohmann's parser is iterative, but copying,
// comparing and dumping a value recurse once per level; HF configs and safetensors headers nest
// 2-4 levels, so 64 leaves room for any real file and keeps every later recursion shallow.
constexpr int kJsonMaxDepth = 64;

// Parses a whole JSON file; throws dflash::Error naming the path on I/O or syntax errors,
// nesting beyond kJsonMaxDepth and duplicate keys in an object.
Json json_read_file(const std::string& path);

// Parses JSON text with the same rules; `what` names the source in error messages.
Json json_parse(const std::string& text, const std::string& what);

// `v` as compact JSON for a message, cut to about 80 characters.
std::string json_brief(const Json& v);

// A JSON integer as int64 within [lo, hi]; `field` and `what` name it in the error. Integers
// beyond int64 (JSON allows up to 2^64 - 1) and non-integers are refused.
int64_t json_int_value(const Json& v, const std::string& field, const std::string& what, int64_t lo = INT64_MIN,
                       int64_t hi = INT64_MAX);

// Field readers: `what` is the file name used in messages ("config.json").
// The required forms throw when the field is missing (or null) or of the wrong type; the
// optional forms return nullopt when it is absent or null and throw when it has the wrong type.
int64_t json_get_int(const Json& j, const std::string& key, const std::string& what);
double json_get_double(const Json& j, const std::string& key, const std::string& what);
std::string json_get_string(const Json& j, const std::string& key, const std::string& what);
std::optional<int64_t> json_opt_int(const Json& j, const std::string& key, const std::string& what);
std::optional<double> json_opt_double(const Json& j, const std::string& key,
                                      const std::string& what);
std::optional<bool> json_opt_bool(const Json& j, const std::string& key, const std::string& what);
std::optional<std::string> json_opt_string(const Json& j, const std::string& key, const std::string& what);
// The field when it is an object; nullptr when absent or null; throws for any other type.
const Json* json_opt_object(const Json& j, const std::string& key, const std::string& what);
// The field when it is an array; nullptr when absent or null; throws for any other type.
const Json* json_opt_array(const Json& j, const std::string& key, const std::string& what);

}  // namespace dflash
