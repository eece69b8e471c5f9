// Reading JSON files (HF config.json, safetensors headers) with errors that name the file and
// the field. Wraps nlohmann::json; every parse or type error becomes a dflash::Error.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "common/error.h"

namespace dflash {

using Json = nlohmann::json;

// Parses a whole JSON file; throws dflash::Error naming the path on I/O or syntax errors.
Json json_read_file(const std::string& path);

// Parses JSON text; `what` names the source in error messages.
Json json_parse(const std::string& text, const std::string& what);

// Field readers: `what` is the file name used in messages ("config.json").
// The required forms throw when the field is missing or of the wrong type.
int64_t json_get_int(const Json& j, const std::string& key, const std::string& what);
double json_get_double(const Json& j, const std::string& key, const std::string& what);
std::string json_get_string(const Json& j, const std::string& key, const std::string& what);
std::optional<int64_t> json_opt_int(const Json& j, const std::string& key, const std::string& what);
std::optional<double> json_opt_double(const Json& j, const std::string& key,
                                      const std::string& what);
std::optional<bool> json_opt_bool(const Json& j, const std::string& key, const std::string& what);

}  // namespace dflash
