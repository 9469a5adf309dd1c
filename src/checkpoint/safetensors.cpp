#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

namespace hs::checkpoint {

using namespace std::string_literals;

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian bytes, which this code maps without swapping");

namespace {

using json = nlohmann::json;

// The reference implementation's limit; a real header (tens of thousands of tensors) is a few MB.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeEntry {
  FileDType type;
  std::string_view name;
  size_t size;
};
constexpr std::array<DTypeEntry, 15> kDTypes{{
    {FileDType::BOOL, "BOOL", 1},
    {FileDType::U8, "U8", 1},
    {FileDType::I8, "I8", 1},
    {FileDType::F8_E5M2, "F8_E5M2", 1},
    {FileDType::F8_E4M3, "F8_E4M3", 1},
    {FileDType::I16, "I16", 2},
    {FileDType::U16, "U16", 2},
    {FileDType::F16, "F16", 2},
    {FileDType::BF16, "BF16", 2},
    {FileDType::I32, "I32", 4},
    {FileDType::U32, "U32", 4},
    {FileDType::F32, "F32", 4},
    {FileDType::F64, "F64", 8},
    {FileDType::I64, "I64", 8},
    {FileDType::U64, "U64", 8},
}};

const DTypeEntry& entry(FileDType t) { return kDTypes[static_cast<size_t>(t)]; }

std::string shape_text(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

std::string range_text(uint64_t b, uint64_t e) { return "["s + std::to_string(b) + ", " + std::to_string(e) + ")"; }

// Element count times element size, or nullopt on overflow.
std::optional<uint64_t> byte_size(FileDType t, const Shape& shape) {
  uint64_t n = file_dtype_size(t);
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return std::nullopt;
  }
  return n;
}

class HeaderChecker {
 public:
  HeaderChecker(std::string_view file, uint64_t data_size) : file_(file), data_size_(data_size) {}

  [[noreturn]] void fail(const std::string& problem) const { throw FormatError(std::string(file_) + ": " + problem); }
  [[noreturn]] void fail(const std::string& tensor, const std::string& problem) const {
    fail("tensor '" + tensor + "': " + problem);
  }

  std::map<std::string, std::string> metadata(const json& m) const {
    if (!m.is_object()) fail("__metadata__ is a JSON "s + m.type_name() + ", not an object of strings");
    std::map<std::string, std::string> out;
    for (const auto& [k, v] : m.items()) {
      if (!v.is_string()) fail("__metadata__ must map strings to strings, but '" + k + "' is a JSON " + v.type_name());
      out.emplace(k, v.get<std::string>());
    }
    return out;
  }

  TensorInfo tensor(const std::string& name, const json& v) const {
    if (!v.is_object()) fail(name, "entry is a JSON "s + v.type_name() + ", not an object");
    TensorInfo t;
    t.name = name;
    // Fields other than these three are ignored, as the reference implementation does.
    const auto dt = v.find("dtype");
    const auto sh = v.find("shape");
    const auto off = v.find("data_offsets");
    if (dt == v.end()) fail(name, "no \"dtype\"");
    if (sh == v.end()) fail(name, "no \"shape\"");
    if (off == v.end()) fail(name, "no \"data_offsets\"");

    if (!dt->is_string()) fail(name, "dtype is a JSON "s + dt->type_name() + ", not a string");
    const auto parsed = parse_file_dtype(dt->get_ref<const std::string&>());
    if (!parsed) fail(name, "unknown dtype '"s + dt->get<std::string>() + "'");
    t.dtype = *parsed;

    if (!sh->is_array()) fail(name, "shape is a JSON "s + sh->type_name() + ", not an array");
    for (size_t i = 0; i < sh->size(); ++i) {
      const json& d = (*sh)[i];
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        fail(name, "shape dimension "s + std::to_string(i) + " is " + d.dump() + ", not a non-negative integer");
      t.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
    }

    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
      fail(name, "data_offsets is "s + off->dump() + ", not two non-negative integers");
    t.begin = (*off)[0].get<uint64_t>();
    t.end = (*off)[1].get<uint64_t>();
    if (t.begin > t.end) fail(name, "data_offsets "s + off->dump() + " are reversed (begin after end)");
    if (t.end > data_size_)
      fail(name,
           "data_offsets "s + off->dump() + " lie outside the data area of " + std::to_string(data_size_) + " bytes");

    const auto need = byte_size(t.dtype, t.shape);
    if (!need) fail(name, "shape "s + shape_text(t.shape) + " is too large to address");
    if (*need != t.nbytes())
      fail(name, std::string(file_dtype_name(t.dtype)) + " " + shape_text(t.shape) + " needs " + std::to_string(*need) +
                     " bytes but data_offsets " + range_text(t.begin, t.end) + " hold " + std::to_string(t.nbytes()));
    return t;
  }

  // The ranges, in data order, must tile [0, data_size) exactly.
  void tiling(const std::vector<TensorInfo>& sorted) const {
    uint64_t expected = 0;
    const TensorInfo* prev = nullptr;
    for (const TensorInfo& t : sorted) {
      if (t.begin < expected)
        fail(t.name, "bytes "s + range_text(t.begin, t.end) + " overlap tensor '" + prev->name + "' " +
                         range_text(prev->begin, prev->end));
      if (t.begin > expected)
        fail(t.name, "starts at byte "s + std::to_string(t.begin) + " but the data before it ends at " +
                         std::to_string(expected) + " (a hole of " + std::to_string(t.begin - expected) + " bytes)");
      expected = t.end;
      prev = &t;
    }
    if (expected != data_size_)
      fail("the tensors cover "s + std::to_string(expected) + " bytes but the data area holds " +
           std::to_string(data_size_) + " (trailing bytes after the last tensor)");
  }

 private:
  std::string_view file_;
  uint64_t data_size_;
};

uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 -> binary32, exact for every input (subnormals, infinities, NaN payloads).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;  // subnormal or zero: exact
  return sign ? -magnitude : magnitude;
}

}  // namespace

size_t file_dtype_size(FileDType t) { return entry(t).size; }
std::string_view file_dtype_name(FileDType t) { return entry(t).name; }

std::optional<FileDType> parse_file_dtype(std::string_view name) {
  for (const DTypeEntry& e : kDTypes)
    if (e.name == name) return e.type;
  return std::nullopt;
}

FileDType to_file_dtype(DType t) {
  switch (t) {
    case DType::F32: return FileDType::F32;
    case DType::BF16: return FileDType::BF16;
    case DType::I32: return FileDType::I32;
  }
  throw std::invalid_argument("to_file_dtype: unknown engine dtype");
}

std::optional<DType> to_engine_dtype(FileDType t) {
  switch (t) {
    case FileDType::F32: return DType::F32;
    case FileDType::BF16: return DType::BF16;
    case FileDType::I32: return DType::I32;
    default: return std::nullopt;
  }
}

uint64_t TensorInfo::numel() const { return nbytes() / file_dtype_size(dtype); }

nlohmann::json parse_json_strictly(std::string_view text, std::string_view file_label,
                                   std::vector<std::string>* top_level_keys) {
  // One set of seen keys per open object; a key event checks the innermost.
  std::vector<std::set<std::string>> open_objects;
  const json::parser_callback_t check_keys = [&](int, json::parse_event_t event, json& value) {
    switch (event) {
      case json::parse_event_t::object_start: open_objects.emplace_back(); break;
      case json::parse_event_t::object_end: open_objects.pop_back(); break;
      case json::parse_event_t::key:
        if (!open_objects.back().insert(value.get<std::string>()).second)
          throw FormatError(std::string(file_label) + ": duplicate key '" + value.get<std::string>() +
                            "' in a JSON object");
        if (top_level_keys && open_objects.size() == 1) top_level_keys->push_back(value.get<std::string>());
        break;
      default: break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), check_keys);
  } catch (const json::exception& e) {
    throw FormatError(std::string(file_label) + ": invalid JSON: " + e.what());
  }
}

SafetensorsLayout parse_safetensors(std::span<const std::byte> file, std::string_view file_label) {
  const std::string label(file_label);
  if (file.size() < 8)
    throw FormatError(label + ": the file is " + std::to_string(file.size()) +
                      " bytes, too short for the 8-byte header length");
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  if (n > kMaxHeaderBytes)
    throw FormatError(label + ": header length " + std::to_string(n) + " exceeds the limit of " +
                      std::to_string(kMaxHeaderBytes) + " bytes");
  if (n > file.size() - 8)
    throw FormatError(label + ": header length " + std::to_string(n) + " runs past the end of the " +
                      std::to_string(file.size()) + "-byte file");

  SafetensorsLayout layout;
  layout.header_size = n;
  const std::string_view text(reinterpret_cast<const char*>(file.data()) + 8, n);
  std::vector<std::string> keys;  // in header order; the parsed object forgets it
  const json header = parse_json_strictly(text, label, &keys);
  const HeaderChecker check(label, file.size() - 8 - n);
  if (!header.is_object()) check.fail("the header is a JSON "s + header.type_name() + ", not an object");

  layout.tensors.reserve(keys.size());
  for (const std::string& key : keys) {
    const json& value = header.at(key);
    if (key == "__metadata__") {
      layout.metadata = check.metadata(value);
    } else {
      layout.tensors.push_back(check.tensor(key, value));
    }
  }
  // Header order breaks ties between empty tensors at one offset, so a writer's declaration order
  // survives a round trip.
  std::stable_sort(layout.tensors.begin(), layout.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  check.tiling(layout.tensors);
  return layout;
}

// ---------------------------------------------------------------------------------------------------
// Reader

SafetensorsReader::SafetensorsReader(const std::filesystem::path& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError("cannot open", path, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError("cannot stat", path, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw FormatError(path.string() + ": not a regular file");
  }
  map_size_ = static_cast<size_t>(st.st_size);
  if (map_size_ < 8) {
    ::close(fd);
    throw FormatError(path.string() + ": the file is " + std::to_string(map_size_) +
                      " bytes, too short for the 8-byte header length");
  }
  void* m = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (m == MAP_FAILED) throw IoError("cannot mmap", path, err);
  map_ = static_cast<const std::byte*>(m);
  try {
    layout_ = parse_safetensors({map_, map_size_}, path.string());
    for (size_t i = 0; i < layout_.tensors.size(); ++i) by_name_.emplace(layout_.tensors[i].name, i);
  } catch (...) {
    ::munmap(const_cast<std::byte*>(map_), map_size_);
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (map_) ::munmap(const_cast<std::byte*>(map_), map_size_);
}

SafetensorsReader::SafetensorsReader(SafetensorsReader&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_size_(std::exchange(other.map_size_, 0)),
      layout_(std::move(other.layout_)),
      by_name_(std::move(other.by_name_)) {}

SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&& other) noexcept {
  if (this != &other) {
    if (map_) ::munmap(const_cast<std::byte*>(map_), map_size_);
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    layout_ = std::move(other.layout_);
    by_name_ = std::move(other.by_name_);
  }
  return *this;
}

const TensorInfo* SafetensorsReader::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &layout_.tensors[it->second];
}

const TensorInfo& SafetensorsReader::at(std::string_view name) const {
  const TensorInfo* t = find(name);
  if (!t) throw FormatError(path_.string() + ": no tensor named '" + std::string(name) + "'");
  return *t;
}

std::span<const std::byte> SafetensorsReader::bytes(const TensorInfo& t) const {
  if (t.begin > t.end || t.end > map_size_ - layout_.data_start())
    throw std::logic_error(path_.string() + ": tensor '" + t.name + "' does not belong to this file");
  return {map_ + layout_.data_start() + t.begin, t.nbytes()};
}

void SafetensorsReader::read_f32(std::string_view name, std::span<float> out) const {
  const TensorInfo& t = at(name);
  if (t.dtype != FileDType::F32 && t.dtype != FileDType::BF16 && t.dtype != FileDType::F16)
    throw FormatError(path_.string() + ": tensor '" + t.name + "' is " + std::string(file_dtype_name(t.dtype)) +
                      "; only F32, BF16 and F16 convert to fp32");
  if (out.size() != t.numel())
    throw std::invalid_argument(path_.string() + ": tensor '" + t.name + "' has " + std::to_string(t.numel()) +
                                " elements but the destination holds " + std::to_string(out.size()));
  convert_to_f32(t.dtype, bytes(t).data(), out.data(), out.size());
}

void convert_to_f32(FileDType src_dtype, const std::byte* src, float* dst, size_t n) {
  const auto count = static_cast<int64_t>(n);
  switch (src_dtype) {
    case FileDType::F32: std::memcpy(dst, src, n * 4); return;
    case FileDType::BF16:
#pragma omp parallel for schedule(static) if (count > (int64_t(1) << 18))
      for (int64_t i = 0; i < count; ++i) dst[i] = bf16::to_float(load_u16(src + 2 * i));
      return;
    case FileDType::F16:
#pragma omp parallel for schedule(static) if (count > (int64_t(1) << 18))
      for (int64_t i = 0; i < count; ++i) dst[i] = half_to_float(load_u16(src + 2 * i));
      return;
    default:
      throw std::invalid_argument("convert_to_f32: "s + std::string(file_dtype_name(src_dtype)) +
                                  " does not convert to fp32");
  }
}

// ---------------------------------------------------------------------------------------------------
// Writer

uint64_t TensorDecl::nbytes() const {
  const auto n = byte_size(dtype, shape);
  if (!n)
    throw std::invalid_argument("tensor '" + name + "': shape " + shape_text(shape) +
                                " has a negative dimension or is too large");
  return *n;
}

void sort_like_reference_writer(std::vector<TensorDecl>& tensors) {
  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorDecl& a, const TensorDecl& b) {
    if (a.dtype != b.dtype) return a.dtype > b.dtype;
    return a.name < b.name;  // std::string compares bytes as unsigned, like Rust's String
  });
}

std::string safetensors_header(const std::vector<TensorDecl>& tensors,
                               const std::map<std::string, std::string>& metadata) {
  // A JSON string literal; nlohmann escapes exactly what serde_json does (quote, backslash, control
  // characters) and throws on invalid UTF-8.
  const auto quoted = [](const std::string& s, const std::string& what) {
    try {
      return json(s).dump();
    } catch (const json::exception&) {
      throw std::invalid_argument(what + " is not valid UTF-8");
    }
  };
  std::string text = "{";
  if (!metadata.empty()) {
    text += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      if (!first) text += ',';
      first = false;
      text += quoted(k, "metadata key '" + k + "'") + ":" + quoted(v, "metadata value of '" + k + "'");
    }
    text += '}';
  }
  std::set<std::string_view> seen;
  uint64_t offset = 0;
  for (const TensorDecl& t : tensors) {
    if (t.name == "__metadata__") throw std::invalid_argument("tensor name '__metadata__' is reserved");
    if (!seen.insert(t.name).second) throw std::invalid_argument("tensor '" + t.name + "' is declared twice");
    const uint64_t size = t.nbytes();
    if (text.size() > 1) text += ',';
    text += quoted(t.name, "tensor name '" + t.name + "'");
    text += ":{\"dtype\":\"";
    text += file_dtype_name(t.dtype);
    text += "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i) text += ',';
      text += std::to_string(t.shape[i]);
    }
    uint64_t end;
    if (__builtin_add_overflow(offset, size, &end))
      throw std::invalid_argument("tensor '" + t.name + "': the tensors' total size overflows 64 bits");
    text += "],\"data_offsets\":["s + std::to_string(offset) + "," + std::to_string(end) + "]}";
    offset = end;
  }
  text += '}';
  // Spaces up to a multiple of 8, as the Python library pads, so the data area starts 8-aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t n = text.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + text;
}

SafetensorsWriter::SafetensorsWriter(std::filesystem::path path, std::vector<TensorDecl> tensors,
                                     std::map<std::string, std::string> metadata)
    : tensors_(std::move(tensors)),
      header_(safetensors_header(tensors_, metadata)),
      header_size_(header_.size()),
      file_(std::move(path)) {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    by_name_.emplace(tensors_[i].name, i);
    sizes_.push_back(tensors_[i].nbytes());
    data_size_ += sizes_.back();
  }
  file_.reserve(header_size_ + data_size_);
  file_.write(header_);
  header_ = {};
}

template <typename F> void SafetensorsWriter::guarded(F&& f) {
  if (failed_) throw std::logic_error("SafetensorsWriter for '"s + path().string() + "' already failed");
  try {
    f();
  } catch (...) {
    failed_ = true;
    file_.discard();
    throw;
  }
}

void SafetensorsWriter::skip_complete() {
  while (current_ < tensors_.size() && current_written_ == sizes_[current_]) {
    ++current_;
    current_written_ = 0;
  }
}

void SafetensorsWriter::write(std::string_view name, std::span<const std::byte> bytes) {
  guarded([&] {
    const std::string where = path().string() + ": tensor '" + std::string(name) + "': ";
    const auto it = by_name_.find(name);
    if (it == by_name_.end()) throw std::invalid_argument(where + "was not declared");
    if (bytes.empty()) return;  // carries nothing, so order cannot matter
    skip_complete();
    if (current_ == tensors_.size() || it->second < current_)
      throw std::invalid_argument(where + "is already complete");
    if (it->second != current_)
      throw std::invalid_argument(where + "written before '" + tensors_[current_].name + "' is complete (" +
                                  std::to_string(current_written_) + " of " + std::to_string(sizes_[current_]) +
                                  " bytes)");
    const uint64_t left = sizes_[current_] - current_written_;
    if (bytes.size() > left)
      throw std::invalid_argument(where + std::to_string(bytes.size()) + " more bytes but only " +
                                  std::to_string(left) + " of its " + std::to_string(sizes_[current_]) + " are left");
    file_.write(bytes);
    current_written_ += bytes.size();
  });
}

void SafetensorsWriter::finish() {
  guarded([&] {
    skip_complete();
    if (current_ < tensors_.size())
      throw std::invalid_argument(path().string() + ": tensor '" + tensors_[current_].name +
                                  "' is incomplete: " + std::to_string(current_written_) + " of " +
                                  std::to_string(sizes_[current_]) + " bytes written");
    file_.finish();
  });
}

void SafetensorsWriter::commit() {
  finish();
  guarded([&] { file_.commit(); });
}

void release_mapped_pages(std::span<const std::byte> s) {
  if (s.empty()) return;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t a = reinterpret_cast<uintptr_t>(s.data()) & ~(page - 1);
  const uintptr_t b = (reinterpret_cast<uintptr_t>(s.data()) + s.size() + page - 1) & ~(page - 1);
  madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED);
}

}  // namespace hs::checkpoint
