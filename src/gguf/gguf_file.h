// The GGUF file format (version 3, as written by llama.cpp's convert_hf_to_gguf.py, gguf-py and gguf-split): a
// validating, memory-mapped reader of single and split files, and a writer. This layer knows nothing of models:
// metadata, tensor names, ggml types, shapes and bytes (docs/gguf.md).
//
// A file is, little-endian: "GGUF", u32 version, u64 tensor count, u64 metadata count; the metadata (a string key,
// a u32 value type, the value; strings are a u64 length and bytes, arrays a u32 element type, a u64 count and the
// elements); the tensor infos (name, u32 dimension count, that many u64 dimensions innermost first, u32 ggml type,
// u64 offset from the data area); zero padding to `general.alignment` (32 unless the metadata says otherwise); the
// data area. Every tensor must start on the alignment, lie inside the file and overlap no other.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace hs::gguf {

// The file is not a valid GGUF file (or set of split files). The message names the file, the tensor or key when
// there is one, what is wrong, and how to fix it where that is known.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class ValueType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7, STRING = 8, ARRAY = 9, U64 = 10, I64 = 11,
  F64 = 12,
};
std::string_view value_type_name(ValueType t);

// One metadata value. Scalars: integers and booleans in `i` (u64 above INT64_MAX keep their bits), floats in `f`;
// strings in `s`; arrays: `array_type` and, by element type, `ints`, `floats` or `strings` (nested arrays are
// refused, as llama.cpp does).
struct Value {
  ValueType type = ValueType::U32;
  ValueType array_type = ValueType::U32;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<std::string> strings;

  bool is_integer() const;
  bool is_float() const { return type == ValueType::F32 || type == ValueType::F64; }
  size_t array_size() const;
};

// ggml tensor types by their ids in ggml.h. The reader knows every id's block size and bytes (to check sizes and
// name a type it will not load); which ones the engine loads is the importer's business.
struct GgmlTypeInfo {
  uint32_t id;
  std::string_view name;  // "Q4_K", as llama.cpp prints it
  int64_t block;          // elements per block
  int64_t bytes;          // bytes per block
};
// nullopt for an id ggml does not define (or has retired).
std::optional<GgmlTypeInfo> ggml_type_info(uint32_t id);
std::string ggml_type_name(uint32_t id);  // "type 99" for an unknown id
namespace ggml_type {
inline constexpr uint32_t F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9, Q2_K = 10,
                          Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15, BF16 = 30;
}

struct TensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // dimensions as stored, innermost (the row) first
  uint32_t type = 0;
  uint64_t offset = 0;  // from the start of the data area
  uint64_t nbytes = 0;
  size_t file = 0;      // which split file holds it

  Shape shape() const;  // row-major, outermost first (the reverse of ne): a [out, in] matrix is ne = {in, out}
  int64_t numel() const;
};

// A validated file: what parse_gguf() finds in a whole file's bytes.
struct GgufLayout {
  uint32_t version = 0;
  uint64_t alignment = 32;
  uint64_t data_start = 0;                     // byte offset of the data area
  std::vector<std::pair<std::string, Value>> metadata;  // in file order
  std::vector<TensorInfo> tensors;             // in file order
};

// Validates a complete file held in memory: magic, version 2 or 3, every length against the bytes left, value types,
// duplicate keys and tensor names, dimension counts (1..4) and element counts, a type ggml defines and a row length
// that is a whole number of its blocks, alignment (a power of two), each tensor's offset aligned, inside the file and
// overlapping no other. Throws FormatError naming `file_label` and the tensor or key.
GgufLayout parse_gguf(std::span<const std::byte> file, std::string_view file_label);

// "model-00002-of-00003.gguf" -> ("model", 2, 3); nullopt for a name that is not a split file's.
struct SplitName {
  std::string prefix;
  int index = 0;
  int count = 0;
};
std::optional<SplitName> parse_split_name(const std::string& file_name);
std::string split_file_name(const std::string& prefix, int index, int count);

// A memory map of one GGUF file, or of every file of a split model (`path` names any of them: all of
// prefix-0000k-of-0000N.gguf are opened and must agree: split.no, split.count, no tensor in two files). Metadata is
// the first file's (the others carry only split.*). Tensor bytes are views into the maps, valid while the reader lives.
class GgufReader {
 public:
  explicit GgufReader(const std::filesystem::path& path);
  ~GgufReader();
  GgufReader(GgufReader&&) noexcept;
  GgufReader& operator=(GgufReader&&) noexcept;
  GgufReader(const GgufReader&) = delete;
  GgufReader& operator=(const GgufReader&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::vector<std::filesystem::path>& files() const { return files_; }
  uint32_t version() const { return version_; }
  const std::vector<std::pair<std::string, Value>>& metadata() const { return metadata_; }
  const Value* find(std::string_view key) const;  // nullptr when absent
  // Typed reads: FormatError naming the key when absent or of another kind; the defaulted forms return `def` when
  // absent (and still refuse another kind).
  int64_t get_int(std::string_view key) const;
  int64_t get_int(std::string_view key, int64_t def) const;
  double get_float(std::string_view key) const;  // integers are accepted too
  double get_float(std::string_view key, double def) const;
  std::string get_string(std::string_view key) const;
  std::optional<std::string> find_string(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;
  const TensorInfo& tensor(std::string_view name) const;  // FormatError naming the model when absent
  std::span<const std::byte> bytes(const TensorInfo& t) const;
  std::string label() const;  // the path as errors name it

 private:
  struct Map {
    const std::byte* data = nullptr;
    size_t size = 0;
  };
  void release() noexcept;

  std::filesystem::path path_;
  std::vector<std::filesystem::path> files_;
  std::vector<Map> maps_;
  std::vector<uint64_t> data_start_;
  uint32_t version_ = 3;
  std::vector<std::pair<std::string, Value>> metadata_;
  std::map<std::string, size_t, std::less<>> meta_index_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

// Writes a GGUF v3 file: metadata in the order added, tensors in the order declared, each tensor's bytes at the next
// multiple of the alignment. Bytes are produced by `fill` when the data is written, one tensor at a time, so a writer
// of a large model holds one tensor at once. Written atomically (a temporary beside the target, then a rename).
class GgufWriter {
 public:
  GgufWriter() = default;
  void set(std::string key, Value v);
  void set_u32(std::string key, uint32_t v);
  void set_i32(std::string key, int32_t v);
  void set_u64(std::string key, uint64_t v);
  void set_f32(std::string key, float v);
  void set_bool(std::string key, bool v);
  void set_string(std::string key, std::string v);
  void set_strings(std::string key, std::vector<std::string> v);
  void set_i32s(std::string key, std::vector<int64_t> v);
  void set_f32s(std::string key, std::vector<double> v);
  // ne innermost first, as stored. fill(out) writes exactly the tensor's bytes.
  void add_tensor(std::string name, std::vector<int64_t> ne, uint32_t type,
                  std::function<void(std::span<std::byte>)> fill);
  void write(const std::filesystem::path& path, uint64_t alignment = 32) const;
  // The whole file in memory (tests, the fuzz seed corpus).
  std::vector<std::byte> to_bytes(uint64_t alignment = 32) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> ne;
    uint32_t type;
    uint64_t nbytes;
    std::function<void(std::span<std::byte>)> fill;
  };
  std::vector<std::byte> header(uint64_t alignment, std::vector<uint64_t>& offsets) const;
  std::vector<std::pair<std::string, Value>> metadata_;
  std::vector<Tensor> tensors_;
};

// Bytes of a tensor of `type` with dimensions `ne`; FormatError when the row is not a whole number of blocks or the
// type is unknown. `what` names the tensor in the message.
uint64_t tensor_nbytes(uint32_t type, const std::vector<int64_t>& ne, std::string_view what);

}  // namespace hs::gguf
