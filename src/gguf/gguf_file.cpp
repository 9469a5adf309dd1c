#include "gguf/gguf_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <regex>
#include <set>

#include "core/atomic_file.h"

namespace hs::gguf {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr int kMaxDims = 4;              // GGML_MAX_DIMS

// ggml.h's ids with ggml.c's block sizes (retired ids 4, 5, 31-33, 36-38 are absent).
constexpr std::array<GgmlTypeInfo, 34> kTypes{{
    {0, "F32", 1, 4},        {1, "F16", 1, 2},        {2, "Q4_0", 32, 18},      {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},     {7, "Q5_1", 32, 24},     {8, "Q8_0", 32, 34},      {9, "Q8_1", 32, 36},
    {10, "Q2_K", 256, 84},   {11, "Q3_K", 256, 110},  {12, "Q4_K", 256, 144},   {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},  {15, "Q8_K", 256, 292},  {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74},
    {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50}, {20, "IQ4_NL", 32, 18},   {21, "IQ3_S", 256, 110},
    {22, "IQ2_S", 256, 82},  {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},        {25, "I16", 1, 2},
    {26, "I32", 1, 4},       {27, "I64", 1, 8},       {28, "F64", 1, 8},        {29, "IQ1_M", 256, 56},
    {30, "BF16", 1, 2},      {34, "TQ1_0", 256, 54},  {35, "TQ2_0", 256, 66},   {39, "MXFP4", 32, 17},
    {40, "NVFP4", 64, 36},   {41, "Q1_0", 128, 18},
}};

[[noreturn]] void fail(std::string_view label, const std::string& what) {
  throw FormatError("GGUF file " + std::string(label) + ": " + what);
}

size_t scalar_size(ValueType t) {
  switch (t) {
    case ValueType::U8: case ValueType::I8: case ValueType::BOOL: return 1;
    case ValueType::U16: case ValueType::I16: return 2;
    case ValueType::U32: case ValueType::I32: case ValueType::F32: return 4;
    case ValueType::U64: case ValueType::I64: case ValueType::F64: return 8;
    default: return 0;
  }
}

bool valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::F64); }

// A bounds-checked little-endian cursor over the file's bytes.
class Cursor {
 public:
  Cursor(std::span<const std::byte> b, std::string_view label) : b_(b), label_(label) {}
  uint64_t pos() const { return pos_; }
  uint64_t left() const { return b_.size() - pos_; }
  void need(uint64_t n, const std::string& what) const {
    if (n > left())
      fail(label_, "truncated: " + what + " needs " + std::to_string(n) + " bytes at offset " + std::to_string(pos_) +
                       ", the file has " + std::to_string(left()) + " left (an incomplete download or copy?)");
  }
  template <typename T> T read(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string string(const std::string& what) {
    const uint64_t n = read<uint64_t>(what + " (its length)");
    need(n, what);
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  std::span<const std::byte> b_;
  std::string_view label_;
  uint64_t pos_ = 0;
};

int64_t read_int(Cursor& c, ValueType t, const std::string& what) {
  switch (t) {
    case ValueType::U8: return c.read<uint8_t>(what);
    case ValueType::I8: return c.read<int8_t>(what);
    case ValueType::U16: return c.read<uint16_t>(what);
    case ValueType::I16: return c.read<int16_t>(what);
    case ValueType::U32: return c.read<uint32_t>(what);
    case ValueType::I32: return c.read<int32_t>(what);
    case ValueType::U64: return static_cast<int64_t>(c.read<uint64_t>(what));
    case ValueType::I64: return c.read<int64_t>(what);
    case ValueType::BOOL: return c.read<uint8_t>(what) != 0;
    default: return 0;
  }
}

double read_float(Cursor& c, ValueType t, const std::string& what) {
  return t == ValueType::F32 ? c.read<float>(what) : c.read<double>(what);
}

Value read_value(Cursor& c, ValueType t, std::string_view label, const std::string& key) {
  const std::string what = "the value of '" + key + "'";
  Value v;
  v.type = t;
  if (t == ValueType::STRING) {
    v.s = c.string(what);
  } else if (t == ValueType::F32 || t == ValueType::F64) {
    v.f = read_float(c, t, what);
  } else if (t == ValueType::ARRAY) {
    const uint32_t et = c.read<uint32_t>(what + " (its element type)");
    if (!valid_value_type(et)) fail(label, "key '" + key + "': array of unknown value type " + std::to_string(et));
    v.array_type = static_cast<ValueType>(et);
    if (v.array_type == ValueType::ARRAY) fail(label, "key '" + key + "': nested arrays are not supported");
    const uint64_t n = c.read<uint64_t>(what + " (its length)");
    // Every element takes at least one byte (a string at least 8): a count beyond the bytes left is a corrupt file,
    // refused before any allocation.
    const uint64_t min_size = v.array_type == ValueType::STRING ? 8 : scalar_size(v.array_type);
    if (n > c.left() / min_size)
      fail(label, "key '" + key + "': an array of " + std::to_string(n) + " elements cannot fit in the " +
                      std::to_string(c.left()) + " bytes left (truncated or corrupt)");
    if (v.array_type == ValueType::STRING) {
      v.strings.reserve(n);
      for (uint64_t k = 0; k < n; ++k) v.strings.push_back(c.string(what + "[" + std::to_string(k) + "]"));
    } else if (v.array_type == ValueType::F32 || v.array_type == ValueType::F64) {
      v.floats.reserve(n);
      for (uint64_t k = 0; k < n; ++k) v.floats.push_back(read_float(c, v.array_type, what));
    } else {
      v.ints.reserve(n);
      for (uint64_t k = 0; k < n; ++k) v.ints.push_back(read_int(c, v.array_type, what));
    }
  } else {
    v.i = read_int(c, t, what);
  }
  return v;
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

std::string_view value_type_name(ValueType t) {
  static constexpr std::array<std::string_view, 13> names{"u8",  "i8",   "u16",    "i16",   "u32", "i32", "f32",
                                                          "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = static_cast<uint32_t>(t);
  return i < names.size() ? names[i] : "unknown";
}

bool Value::is_integer() const {
  switch (type) {
    case ValueType::U8: case ValueType::I8: case ValueType::U16: case ValueType::I16: case ValueType::U32:
    case ValueType::I32: case ValueType::U64: case ValueType::I64: case ValueType::BOOL: return true;
    default: return false;
  }
}

size_t Value::array_size() const { return ints.size() + floats.size() + strings.size(); }

std::optional<GgmlTypeInfo> ggml_type_info(uint32_t id) {
  for (const GgmlTypeInfo& t : kTypes)
    if (t.id == id) return t;
  return std::nullopt;
}

std::string ggml_type_name(uint32_t id) {
  const auto t = ggml_type_info(id);
  return t ? std::string(t->name) : "type " + std::to_string(id);
}

uint64_t tensor_nbytes(uint32_t type, const std::vector<int64_t>& ne, std::string_view what) {
  const auto t = ggml_type_info(type);
  if (!t) throw FormatError(std::string(what) + ": unknown ggml tensor type " + std::to_string(type));
  if (ne.empty() || ne[0] % t->block != 0)
    throw FormatError(std::string(what) + ": a row of " + (ne.empty() ? "0" : std::to_string(ne[0])) +
                      " elements is not a whole number of " + std::string(t->name) + " blocks of " +
                      std::to_string(t->block));
  uint64_t n = static_cast<uint64_t>(ne[0] / t->block) * static_cast<uint64_t>(t->bytes);
  for (size_t d = 1; d < ne.size(); ++d)
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(ne[d]), &n))
      throw FormatError(std::string(what) + ": its size overflows");
  return n;
}

Shape TensorInfo::shape() const { return Shape(ne.rbegin(), ne.rend()); }

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

GgufLayout parse_gguf(std::span<const std::byte> file, std::string_view label) {
  Cursor c(file, label);
  GgufLayout out;
  if (file.size() < 4) fail(label, "truncated: " + std::to_string(file.size()) + " bytes, not even the magic");
  if (c.read<uint32_t>("the magic") != kMagic) fail(label, "not a GGUF file (the first four bytes are not \"GGUF\")");
  out.version = c.read<uint32_t>("the version");
  if (out.version != 2 && out.version != 3)
    fail(label, "GGUF version " + std::to_string(out.version) + " is not supported (2 and 3 are; version 1 files "
                "predate 2023: convert the model again)");
  const uint64_t n_tensors = c.read<uint64_t>("the tensor count");
  const uint64_t n_kv = c.read<uint64_t>("the metadata count");
  // A key takes at least 12 bytes and a tensor info at least 24: counts beyond that are corrupt, not large.
  if (n_kv > c.left() / 12) fail(label, "metadata count " + std::to_string(n_kv) + " exceeds what the file can hold");
  if (n_tensors > c.left() / 24) fail(label, "tensor count " + std::to_string(n_tensors) + " exceeds what the file can hold");

  std::set<std::string, std::less<>> keys;
  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key = c.string("metadata key " + std::to_string(k));
    const uint32_t t = c.read<uint32_t>("the value type of '" + key + "'");
    if (!valid_value_type(t)) fail(label, "key '" + key + "': unknown value type " + std::to_string(t));
    Value v = read_value(c, static_cast<ValueType>(t), label, key);
    if (!keys.insert(key).second) fail(label, "duplicate metadata key '" + key + "'");
    if (key == "general.alignment") {
      if (!v.is_integer() || v.i <= 0 || (v.i & (v.i - 1)) != 0 || v.i > (1 << 30))
        fail(label, "general.alignment must be a power of two (got " +
                        (v.is_integer() ? std::to_string(v.i) : std::string(value_type_name(v.type))) + ")");
      out.alignment = static_cast<uint64_t>(v.i);
    }
    out.metadata.emplace_back(std::move(key), std::move(v));
  }

  std::set<std::string, std::less<>> names;
  out.tensors.reserve(n_tensors);
  for (uint64_t k = 0; k < n_tensors; ++k) {
    TensorInfo t;
    t.name = c.string("tensor info " + std::to_string(k) + " (its name)");
    const std::string who = "tensor '" + t.name + "'";
    const uint32_t n_dims = c.read<uint32_t>(who + " (its dimension count)");
    if (n_dims < 1 || n_dims > kMaxDims)
      fail(label, who + " has " + std::to_string(n_dims) + " dimensions (1 to " + std::to_string(kMaxDims) + " allowed)");
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t n = c.read<uint64_t>(who + " (its dimensions)");
      if (n == 0 || n > (uint64_t{1} << 48)) fail(label, who + " has dimension " + std::to_string(d) + " of " + std::to_string(n));
      t.ne.push_back(static_cast<int64_t>(n));
    }
    t.type = c.read<uint32_t>(who + " (its type)");
    t.offset = c.read<uint64_t>(who + " (its offset)");
    if (!ggml_type_info(t.type)) fail(label, who + " has unknown ggml type " + std::to_string(t.type));
    try {
      t.nbytes = tensor_nbytes(t.type, t.ne, who);
    } catch (const FormatError& e) {
      fail(label, e.what());
    }
    if (!names.insert(t.name).second) fail(label, "duplicate tensor name '" + t.name + "'");
    out.tensors.push_back(std::move(t));
  }

  out.data_start = align_up(c.pos(), out.alignment);
  const uint64_t data_size = file.size() >= out.data_start ? file.size() - out.data_start : 0;
  if (n_tensors > 0 && file.size() < out.data_start)
    fail(label, "truncated: the data area would start at byte " + std::to_string(out.data_start) + " of a " +
                    std::to_string(file.size()) + "-byte file");
  std::vector<const TensorInfo*> by_offset;
  for (const TensorInfo& t : out.tensors) {
    if (t.offset % out.alignment != 0)
      fail(label, "tensor '" + t.name + "' starts at data offset " + std::to_string(t.offset) +
                      ", not a multiple of the alignment " + std::to_string(out.alignment) + " (a corrupt file)");
    if (t.offset > data_size || t.nbytes > data_size - t.offset)
      fail(label, "tensor '" + t.name + "' (" + std::to_string(t.nbytes) + " bytes at data offset " +
                      std::to_string(t.offset) + ") extends past the end of the file's " + std::to_string(data_size) +
                      "-byte data area (truncated: download or copy it again)");
    by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  for (size_t k = 1; k < by_offset.size(); ++k)
    if (by_offset[k - 1]->offset + by_offset[k - 1]->nbytes > by_offset[k]->offset)
      fail(label, "tensor '" + by_offset[k]->name + "' at data offset " + std::to_string(by_offset[k]->offset) +
                      " overlaps tensor '" + by_offset[k - 1]->name + "' (" + std::to_string(by_offset[k - 1]->nbytes) +
                      " bytes from " + std::to_string(by_offset[k - 1]->offset) + ")");
  return out;
}

std::optional<SplitName> parse_split_name(const std::string& file_name) {
  static const std::regex re(R"((.*)-(\d{5})-of-(\d{5})\.gguf)");
  std::smatch m;
  if (!std::regex_match(file_name, m, re)) return std::nullopt;
  SplitName s{m[1].str(), std::stoi(m[2].str()), std::stoi(m[3].str())};
  if (s.index < 1 || s.count < 1 || s.index > s.count) return std::nullopt;
  return s;
}

std::string split_file_name(const std::string& prefix, int index, int count) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "-%05d-of-%05d.gguf", index, count);
  return prefix + buf;
}

GgufReader::GgufReader(const std::filesystem::path& path) : path_(path) {
  const auto split = parse_split_name(path.filename().string());
  if (split) {
    for (int k = 1; k <= split->count; ++k)
      files_.push_back(path.parent_path() / split_file_name(split->prefix, k, split->count));
  } else {
    files_.push_back(path);
  }
  try {
    for (size_t f = 0; f < files_.size(); ++f) {
      const std::filesystem::path& p = files_[f];
      const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        if (split && errno == ENOENT)
          throw FormatError("GGUF split model " + path.string() + ": part " + std::to_string(f + 1) + " of " +
                            std::to_string(files_.size()) + ", " + p.string() + ", is missing (download every part)");
        throw IoError("open", p, errno);
      }
      struct stat st {};
      if (::fstat(fd, &st) != 0) {
        const int e = errno;
        ::close(fd);
        throw IoError("stat", p, e);
      }
      Map m;
      m.size = static_cast<size_t>(st.st_size);
      if (m.size > 0) {
        void* a = ::mmap(nullptr, m.size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (a == MAP_FAILED) {
          const int e = errno;
          ::close(fd);
          throw IoError("mmap", p, e);
        }
        m.data = static_cast<const std::byte*>(a);
      }
      ::close(fd);
      maps_.push_back(m);
      GgufLayout l = parse_gguf({m.data, m.size}, p.string());
      data_start_.push_back(l.data_start);
      if (f == 0) {
        version_ = l.version;
        metadata_ = std::move(l.metadata);
        for (size_t k = 0; k < metadata_.size(); ++k) meta_index_.emplace(metadata_[k].first, k);
      }
      if (split) {
        // gguf-split writes split.no (0-based) and split.count into every part.
        int64_t no = -1, count = -1;
        const auto& md = f == 0 ? metadata_ : l.metadata;
        for (const auto& [k, v] : md) {
          if (k == "split.no" && v.is_integer()) no = v.i;
          if (k == "split.count" && v.is_integer()) count = v.i;
        }
        if (count >= 0 && (count != split->count || no != static_cast<int64_t>(f)))
          throw FormatError("GGUF split model: " + p.string() + " says it is part " + std::to_string(no + 1) + " of " +
                            std::to_string(count) + ", its name says part " + std::to_string(f + 1) + " of " +
                            std::to_string(split->count) + " (parts of different models mixed up?)");
      }
      for (TensorInfo& t : l.tensors) {
        t.file = f;
        if (!tensor_index_.emplace(t.name, tensors_.size()).second)
          throw FormatError("GGUF split model " + path.string() + ": tensor '" + t.name + "' is in more than one part");
        tensors_.push_back(std::move(t));
      }
    }
  } catch (...) {
    release();
    throw;
  }
}

GgufReader::~GgufReader() { release(); }

GgufReader::GgufReader(GgufReader&& o) noexcept { *this = std::move(o); }

GgufReader& GgufReader::operator=(GgufReader&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    files_ = std::move(o.files_);
    maps_ = std::move(o.maps_);
    o.maps_.clear();
    data_start_ = std::move(o.data_start_);
    version_ = o.version_;
    metadata_ = std::move(o.metadata_);
    meta_index_ = std::move(o.meta_index_);
    tensors_ = std::move(o.tensors_);
    tensor_index_ = std::move(o.tensor_index_);
  }
  return *this;
}

void GgufReader::release() noexcept {
  for (const Map& m : maps_)
    if (m.data) ::munmap(const_cast<std::byte*>(m.data), m.size);
  maps_.clear();
}

std::string GgufReader::label() const { return path_.string(); }

const Value* GgufReader::find(std::string_view key) const {
  const auto it = meta_index_.find(key);
  return it == meta_index_.end() ? nullptr : &metadata_[it->second].second;
}

int64_t GgufReader::get_int(std::string_view key) const {
  const Value* v = find(key);
  if (!v) fail(label(), "metadata key '" + std::string(key) + "' is missing");
  if (!v->is_integer())
    fail(label(), "metadata key '" + std::string(key) + "' is a " + std::string(value_type_name(v->type)) +
                      ", not an integer");
  return v->i;
}

int64_t GgufReader::get_int(std::string_view key, int64_t def) const { return find(key) ? get_int(key) : def; }

double GgufReader::get_float(std::string_view key) const {
  const Value* v = find(key);
  if (!v) fail(label(), "metadata key '" + std::string(key) + "' is missing");
  if (v->is_float()) return v->f;
  if (v->is_integer()) return static_cast<double>(v->i);
  fail(label(), "metadata key '" + std::string(key) + "' is a " + std::string(value_type_name(v->type)) +
                    ", not a number");
}

double GgufReader::get_float(std::string_view key, double def) const { return find(key) ? get_float(key) : def; }

std::string GgufReader::get_string(std::string_view key) const {
  const auto s = find_string(key);
  if (!s) fail(label(), "metadata key '" + std::string(key) + "' is missing");
  return *s;
}

std::optional<std::string> GgufReader::find_string(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::STRING)
    fail(label(), "metadata key '" + std::string(key) + "' is a " + std::string(value_type_name(v->type)) +
                      ", not a string");
  return v->s;
}

const TensorInfo* GgufReader::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& GgufReader::tensor(std::string_view name) const {
  const TensorInfo* t = find_tensor(name);
  if (!t) fail(label(), "tensor '" + std::string(name) + "' is missing");
  return *t;
}

std::span<const std::byte> GgufReader::bytes(const TensorInfo& t) const {
  return {maps_.at(t.file).data + data_start_.at(t.file) + t.offset, t.nbytes};
}

// ---- writer ----

namespace {

void put_bytes(std::vector<std::byte>& out, const void* p, size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  out.insert(out.end(), b, b + n);
}
template <typename T> void put(std::vector<std::byte>& out, T v) { put_bytes(out, &v, sizeof v); }
void put_string(std::vector<std::byte>& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  put_bytes(out, s.data(), s.size());
}

void put_scalar(std::vector<std::byte>& out, ValueType t, int64_t i, double f) {
  switch (t) {
    case ValueType::U8: case ValueType::BOOL: put<uint8_t>(out, static_cast<uint8_t>(i)); break;
    case ValueType::I8: put<int8_t>(out, static_cast<int8_t>(i)); break;
    case ValueType::U16: put<uint16_t>(out, static_cast<uint16_t>(i)); break;
    case ValueType::I16: put<int16_t>(out, static_cast<int16_t>(i)); break;
    case ValueType::U32: put<uint32_t>(out, static_cast<uint32_t>(i)); break;
    case ValueType::I32: put<int32_t>(out, static_cast<int32_t>(i)); break;
    case ValueType::U64: put<uint64_t>(out, static_cast<uint64_t>(i)); break;
    case ValueType::I64: put<int64_t>(out, i); break;
    case ValueType::F32: put<float>(out, static_cast<float>(f)); break;
    case ValueType::F64: put<double>(out, f); break;
    default: break;
  }
}

}  // namespace

void GgufWriter::set(std::string key, Value v) {
  for (auto& [k, old] : metadata_)
    if (k == key) {
      old = std::move(v);
      return;
    }
  metadata_.emplace_back(std::move(key), std::move(v));
}
void GgufWriter::set_u32(std::string key, uint32_t v) { Value x; x.type = ValueType::U32; x.i = v; set(std::move(key), x); }
void GgufWriter::set_i32(std::string key, int32_t v) { Value x; x.type = ValueType::I32; x.i = v; set(std::move(key), x); }
void GgufWriter::set_u64(std::string key, uint64_t v) {
  Value x; x.type = ValueType::U64; x.i = static_cast<int64_t>(v); set(std::move(key), x);
}
void GgufWriter::set_f32(std::string key, float v) { Value x; x.type = ValueType::F32; x.f = v; set(std::move(key), x); }
void GgufWriter::set_bool(std::string key, bool v) { Value x; x.type = ValueType::BOOL; x.i = v; set(std::move(key), x); }
void GgufWriter::set_string(std::string key, std::string v) {
  Value x; x.type = ValueType::STRING; x.s = std::move(v); set(std::move(key), std::move(x));
}
void GgufWriter::set_strings(std::string key, std::vector<std::string> v) {
  Value x; x.type = ValueType::ARRAY; x.array_type = ValueType::STRING; x.strings = std::move(v);
  set(std::move(key), std::move(x));
}
void GgufWriter::set_i32s(std::string key, std::vector<int64_t> v) {
  Value x; x.type = ValueType::ARRAY; x.array_type = ValueType::I32; x.ints = std::move(v);
  set(std::move(key), std::move(x));
}
void GgufWriter::set_f32s(std::string key, std::vector<double> v) {
  Value x; x.type = ValueType::ARRAY; x.array_type = ValueType::F32; x.floats = std::move(v);
  set(std::move(key), std::move(x));
}

void GgufWriter::add_tensor(std::string name, std::vector<int64_t> ne, uint32_t type,
                            std::function<void(std::span<std::byte>)> fill) {
  const uint64_t n = tensor_nbytes(type, ne, "tensor '" + name + "'");
  tensors_.push_back({std::move(name), std::move(ne), type, n, std::move(fill)});
}

std::vector<std::byte> GgufWriter::header(uint64_t alignment, std::vector<uint64_t>& offsets) const {
  std::vector<std::byte> h;
  put<uint32_t>(h, kMagic);
  put<uint32_t>(h, 3);
  put<uint64_t>(h, tensors_.size());
  const bool has_alignment = alignment != 32 &&
      std::none_of(metadata_.begin(), metadata_.end(), [](const auto& kv) { return kv.first == "general.alignment"; });
  put<uint64_t>(h, metadata_.size() + (has_alignment ? 1 : 0));
  auto put_kv = [&](const std::string& k, const Value& v) {
    put_string(h, k);
    put<uint32_t>(h, static_cast<uint32_t>(v.type));
    if (v.type == ValueType::STRING) {
      put_string(h, v.s);
    } else if (v.type == ValueType::ARRAY) {
      put<uint32_t>(h, static_cast<uint32_t>(v.array_type));
      put<uint64_t>(h, v.array_size());
      for (const std::string& s : v.strings) put_string(h, s);
      for (double f : v.floats) put_scalar(h, v.array_type, 0, f);
      for (int64_t i : v.ints) put_scalar(h, v.array_type, i, 0);
    } else {
      put_scalar(h, v.type, v.i, v.f);
    }
  };
  for (const auto& [k, v] : metadata_) put_kv(k, v);
  if (has_alignment) {
    Value a;
    a.type = ValueType::U32;
    a.i = static_cast<int64_t>(alignment);
    put_kv("general.alignment", a);
  }
  offsets.clear();
  uint64_t off = 0;
  for (const Tensor& t : tensors_) {
    put_string(h, t.name);
    put<uint32_t>(h, static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) put<uint64_t>(h, static_cast<uint64_t>(d));
    put<uint32_t>(h, t.type);
    put<uint64_t>(h, off);
    offsets.push_back(off);
    off = align_up(off + t.nbytes, alignment);
  }
  h.resize(align_up(h.size(), alignment), std::byte{0});
  return h;
}

std::vector<std::byte> GgufWriter::to_bytes(uint64_t alignment) const {
  std::vector<uint64_t> offsets;
  std::vector<std::byte> out = header(alignment, offsets);
  const uint64_t start = out.size();
  for (size_t k = 0; k < tensors_.size(); ++k) {
    out.resize(start + offsets[k], std::byte{0});
    out.resize(start + offsets[k] + tensors_[k].nbytes, std::byte{0});
    tensors_[k].fill(std::span(out).subspan(start + offsets[k], tensors_[k].nbytes));
  }
  return out;
}

void GgufWriter::write(const std::filesystem::path& path, uint64_t alignment) const {
  std::vector<uint64_t> offsets;
  const std::vector<std::byte> h = header(alignment, offsets);
  AtomicFile f(path);
  uint64_t total = h.size();
  if (!tensors_.empty()) total += offsets.back() + tensors_.back().nbytes;
  f.reserve(total);
  f.write(h);
  uint64_t at = 0;
  std::vector<std::byte> buf;
  const std::vector<std::byte> zeros(alignment, std::byte{0});
  for (size_t k = 0; k < tensors_.size(); ++k) {
    f.write(std::span(zeros).first(offsets[k] - at));
    buf.assign(tensors_[k].nbytes, std::byte{0});
    tensors_[k].fill(buf);
    f.write(buf);
    at = offsets[k] + tensors_[k].nbytes;
  }
  f.commit();
}

}  // namespace hs::gguf
