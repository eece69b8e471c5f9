// Safetensors parsing and mmap (format: u64 little-endian header size, JSON header, data).
#include "weights/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>

#include "common/json_util.h"

namespace dflash {

namespace fs = std::filesystem;

float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

int64_t StoredTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void StoredTensor::to_f32(float* out) const {
  const int64_t n = numel();
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, data, n * 4);
      return;
    case DType::kBF16: {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(data);
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(src[i]);
      return;
    }
    case DType::kF16: {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(data);
      for (int64_t i = 0; i < n; ++i) out[i] = half_to_float(src[i]);
      return;
    }
    default:
      DFLASH_CHECK(false, file, ": tensor '", name, "' has dtype ", dtype_name(dtype),
                   ", expected a floating-point dtype");
  }
}

void StoredTensor::to_bf16(uint16_t* out) const {
  const int64_t n = numel();
  if (dtype == DType::kBF16) {
    std::memcpy(out, data, n * 2);
    return;
  }
  std::vector<float> tmp(n);
  to_f32(tmp.data());
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(tmp[i]);
}

namespace {

bool parse_dtype(const std::string& s, DType* out) {
  if (s == "F32") *out = DType::kF32;
  else if (s == "BF16") *out = DType::kBF16;
  else if (s == "F16") *out = DType::kF16;
  else if (s == "I32") *out = DType::kI32;
  else return false;
  return true;
}

// Size in bytes of one element for any safetensors dtype (so headers with other dtypes still
// validate; only the four above can be read).
size_t any_dtype_size(const std::string& s) {
  if (s == "F64" || s == "I64" || s == "U64") return 8;
  if (s == "F32" || s == "I32" || s == "U32") return 4;
  if (s == "F16" || s == "BF16" || s == "I16" || s == "U16") return 2;
  if (s == "I8" || s == "U8" || s == "BOOL" || s == "F8_E4M3" || s == "F8_E5M2") return 1;
  return 0;
}

// The reference library's bound on the JSON header (100 MB).
constexpr uint64_t kMaxHeaderBytes = 100000000;

// __metadata__: null or an object of strings, as the reference library requires.
void metadata_check(const Json& m, const std::string& path) {
  if (m.is_null()) return;
  DFLASH_CHECK(m.is_object(), path, ": safetensors __metadata__ must be an object of strings, got ", json_brief(m));
  for (const auto& [key, value] : m.items()) {
    DFLASH_CHECK(value.is_string(), path, ": safetensors __metadata__ entry '", key, "' must be a string, got ",
                 json_brief(value));
  }
}

// Where one tensor's bytes lie in the data section.
struct Span {
  uint64_t begin, end;
  std::string name;
};

// The layout the reference library enforces: in offset order, every tensor starts where the
// previous one ends (the first at 0: no gaps, no overlap, no bytes shared between tensors),
// and the last one ends at the end of the file (no data after it; a header length one byte
// off shows up here).
void layout_check(std::vector<Span>& spans, uint64_t data_bytes, const std::string& path) {
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  for (const Span& s : spans) {
    DFLASH_CHECK(s.begin == at, path, ": tensor '", s.name, "' has data_offsets [", s.begin, ", ", s.end, ") but ",
                 at == 0 ? std::string("the first tensor must start at byte 0")
                         : "the tensor before it ends at byte " + std::to_string(at),
                 s.begin < at ? " (tensors overlap)" : " (a gap between tensors)",
                 "; safetensors stores tensors back to back");
    at = s.end;
  }
  DFLASH_CHECK(at == data_bytes, path, ": the tensors cover ", at, " of the file's ", data_bytes,
               " data bytes: there are ", data_bytes - at,
               " bytes after the last tensor (wrong header length or extra data)");
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  DFLASH_CHECK(fd >= 0, "cannot open safetensors file ", path, ": ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    DFLASH_CHECK(false, "cannot stat ", path);
  }
  map_bytes_ = static_cast<size_t>(st.st_size);
  if (map_bytes_ < 8) {
    ::close(fd);
    DFLASH_CHECK(false, path, ": truncated safetensors file (", map_bytes_,
                 " bytes, no header)");
  }
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  DFLASH_CHECK(map_ != MAP_FAILED, "cannot mmap ", path);
  const uint8_t* base = static_cast<const uint8_t*>(map_);
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, base, 8);  // little-endian hosts only (x86-64, aarch64)
  if (header_bytes > map_bytes_ - 8) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    DFLASH_CHECK(false, path, ": corrupt safetensors header: header size ", header_bytes,
                 " exceeds the file size ", map_bytes_);
  }
  const uint8_t* data = base + 8 + header_bytes;
  const size_t data_bytes = map_bytes_ - 8 - header_bytes;
  try {
    DFLASH_CHECK(header_bytes <= kMaxHeaderBytes, path, ": corrupt safetensors header: header size ", header_bytes,
                 " exceeds the format's limit of ", kMaxHeaderBytes, " bytes");
    Json header = json_parse(std::string(reinterpret_cast<const char*>(base + 8), header_bytes),
                             path + " (safetensors header)");
    DFLASH_CHECK(header.is_object(), path, ": safetensors header is not a JSON object");
    std::vector<Span> spans;  // [num_tensors] where each tensor's bytes lie, to check the layout
    for (auto& [name, info] : header.items()) {
      if (name == "__metadata__") {
        metadata_check(info, path);
        continue;
      }
      const std::string what = path + " tensor '" + name + "'";
      DFLASH_CHECK(info.is_object(), what, ": entry is not an object");
      std::string dt = json_get_string(info, "dtype", what);
      size_t elem = any_dtype_size(dt);
      DFLASH_CHECK(elem != 0, what, ": unknown dtype ", dt);
      StoredTensor t;
      t.name = name;
      t.file = path;
      DType parsed;
      const bool readable = parse_dtype(dt, &parsed);
      t.dtype = readable ? parsed : DType::kI32;
      DFLASH_CHECK(info.contains("shape") && info["shape"].is_array(), what, ": missing shape");
      for (auto& d : info["shape"]) {
        DFLASH_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, what, ": bad shape ", json_brief(info["shape"]));
        t.shape.push_back(d.get<int64_t>());
      }
      DFLASH_CHECK(info.contains("data_offsets") && info["data_offsets"].is_array() &&
                       info["data_offsets"].size() == 2 &&
                       info["data_offsets"][0].is_number_unsigned() &&
                       info["data_offsets"][1].is_number_unsigned(),
                   what, ": bad data_offsets");
      uint64_t begin = info["data_offsets"][0].get<uint64_t>();
      uint64_t end = info["data_offsets"][1].get<uint64_t>();
      DFLASH_CHECK(begin <= end && end <= data_bytes, what, ": data_offsets [", begin, ", ", end,
                   ") lie outside the file's ", data_bytes, " data bytes (truncated file?)");
      uint64_t need = elem;  // shape x dtype size, refusing shapes whose size overflows
      for (int64_t d : t.shape) {
        DFLASH_CHECK(!__builtin_mul_overflow(need, static_cast<uint64_t>(d), &need), what,
                     ": shape ", shape_str(t.shape), " is too large");
      }
      DFLASH_CHECK(end - begin == need, what, ": header says ", end - begin, " bytes but shape ",
                   shape_str(t.shape), " of ", dt, " needs ", need);
      spans.push_back({begin, end, name});
      if (!readable) {  // other dtypes are validated but never read
        unreadable_.emplace(name, dt);
        continue;
      }
      t.data = data + begin;
      t.nbytes = end - begin;
      tensors_.emplace(name, std::move(t));
    }
    layout_check(spans, data_bytes, path);
  } catch (...) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

Checkpoint::Checkpoint(const std::string& model_dir) : dir_(model_dir) {
  fs::path dir(model_dir);
  fs::path index = dir / "model.safetensors.index.json";
  fs::path single = dir / "model.safetensors";
  std::vector<std::string> files;
  std::map<std::string, std::string> weight_map;
  if (fs::exists(index)) {
    Json j = json_read_file(index.string());
    DFLASH_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), index.string(),
                 ": missing 'weight_map'");
    std::set<std::string> uniq;
    for (auto& [name, file] : j["weight_map"].items()) {
      DFLASH_CHECK(file.is_string(), index.string(), ": weight_map entry for '", name,
                   "' is not a string");
      weight_map[name] = file.get<std::string>();
      uniq.insert(file.get<std::string>());
    }
    for (const auto& f : uniq) {
      DFLASH_CHECK(f.find("..") == std::string::npos && !f.empty() && f[0] != '/',
                   index.string(), ": shard name '", f, "' escapes the model directory");
      files.push_back((dir / f).string());
    }
  } else if (fs::exists(single)) {
    files.push_back(single.string());
  } else {
    DFLASH_CHECK(false, model_dir, ": no model.safetensors or model.safetensors.index.json");
  }
  for (const auto& f : files) {
    DFLASH_CHECK(fs::exists(f), "missing safetensors shard ", f);
    files_.push_back(std::make_unique<SafetensorsFile>(f));
    auto check_new = [&](const std::string& name) {
      DFLASH_CHECK(index_.count(name) == 0 && unreadable_.count(name) == 0, model_dir, ": tensor '", name,
                   "' appears in more than one shard");
    };
    for (const auto& [name, t] : files_.back()->tensors()) {
      check_new(name);
      index_[name] = &t;
    }
    for (const auto& [name, dt] : files_.back()->unreadable()) {
      check_new(name);
      unreadable_[name] = dt;
    }
  }
  if (!weight_map.empty()) {
    auto listed = [&](const std::string& name) {
      DFLASH_CHECK(weight_map.count(name) != 0, index.string(), ": tensor '", name,
                   "' of a shard is not listed in 'weight_map'");
    };
    for (const auto& kv : index_) listed(kv.first);
    for (const auto& kv : unreadable_) listed(kv.first);
  }
  for (const auto& [name, file] : weight_map) {
    auto it = index_.find(name);
    const bool in_shard = it != index_.end() ? it->second->file == (dir / file).string()
                                             : unreadable_.count(name) != 0;
    const std::string where =
        it != index_.end() ? " (it is in " + fs::path(it->second->file).filename().string() + ")"
                           : std::string();
    DFLASH_CHECK(in_shard, index.string(), ": tensor '", name, "' listed for ", file,
                 " is not in that shard", where);
  }
}

const StoredTensor& Checkpoint::get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    auto u = unreadable_.find(name);
    DFLASH_CHECK(u == unreadable_.end(), dir_, ": tensor '", name, "' has dtype ", u->second,
                 ", which dflash cannot load (supported: F32, BF16, F16)");
  }
  DFLASH_CHECK(it != index_.end(), dir_, ": checkpoint has no tensor '", name, "'");
  return *it->second;
}

const StoredTensor& Checkpoint::get(const std::string& name,
                                    const std::vector<int64_t>& shape) const {
  const StoredTensor& t = get(name);
  DFLASH_CHECK(t.shape == shape, t.file, ": tensor '", name, "' has shape ", shape_str(t.shape),
               ", expected ", shape_str(shape));
  return t;
}

void Checkpoint::check_tensor_set(const TensorShapes& expected, const std::string& owner,
                                  const std::function<std::string(const std::string&)>& hint) const {
  auto check_used = [&](const std::string& name, const std::string& file) {
    DFLASH_CHECK(expected.count(name) != 0, file, ": tensor '", name, "' is not used by ", owner, hint(name));
  };
  for (const auto& [name, t] : index_) check_used(name, t->file);
  for (const auto& kv : unreadable_) check_used(kv.first, dir_);
  for (const auto& entry : expected) get(entry.first);  // missing: an error naming it
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& kv : index_) out.push_back(kv.first);
  return out;
}

}  // namespace dflash
