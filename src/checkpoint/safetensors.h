// The safetensors file format: a validating memory-mapped reader and a streaming, atomic writer.
// This layer knows nothing of models: names, dtypes, shapes and bytes.
//
// A file is an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...}
// padded with spaces, then the tensor bytes (row-major, little-endian); offsets count from the end of
// the header.
//
// The reader follows the reference (Rust) implementation's rules: header at most 100 MB; the tensors'
// byte ranges, sorted by offset, must tile the data area exactly, from 0 to the end of the file, so
// holes, overlaps, reversed ranges and trailing bytes are all rejected; unknown fields inside a tensor
// entry are ignored. It is stricter in one respect: a duplicate key anywhere in the header is an error
// (a plain JSON parse silently keeps one of the two). The order of the names inside the JSON does not
// matter (JSON objects are unordered; some writers sort keys); "file order" below means data order,
// with header order between empty tensors at one offset.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/atomic_file.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace hs::checkpoint {

// The file's contents are not a valid safetensors file (or index). The message names the file, the
// tensor when there is one, and the problem.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Element types of a safetensors file, in the order of the reference implementation's enum: its writer
// lays tensors out by this rank, largest first (then by name), which keeps every tensor aligned.
// The F8 types are carried as raw bytes; newer exotic types (F4, F6_*, F8_E8M0, C64) are rejected as
// unknown.
enum class FileDType : uint8_t { BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64 };

size_t file_dtype_size(FileDType t);
std::string_view file_dtype_name(FileDType t);  // as spelled in the header: "F32", "BF16", ...
std::optional<FileDType> parse_file_dtype(std::string_view name);
FileDType to_file_dtype(DType t);
std::optional<DType> to_engine_dtype(FileDType t);  // nullopt for types the engine does not compute in

// One tensor as described by a header.
struct TensorInfo {
  std::string name;
  FileDType dtype = FileDType::F32;
  Shape shape;
  uint64_t begin = 0;  // byte range [begin, end) relative to the start of the data area
  uint64_t end = 0;

  uint64_t nbytes() const { return end - begin; }
  uint64_t numel() const;
};

// A validated header: what parse_safetensors() finds in a whole file's bytes.
struct SafetensorsLayout {
  uint64_t header_size = 0;         // N, the JSON length including padding
  std::vector<TensorInfo> tensors;  // in file (data) order
  std::map<std::string, std::string> metadata;

  uint64_t data_start() const { return 8 + header_size; }
};

// Validates a complete file held in memory; throws FormatError naming `file_label`.
SafetensorsLayout parse_safetensors(std::span<const std::byte> file, std::string_view file_label);

// JSON parsing shared by the safetensors header and the shard index: rejects duplicate keys at any
// depth (a plain parse silently keeps one of them). Throws FormatError naming `file_label`. The
// parsed object sorts its keys; `top_level_keys`, if given, receives the outer object's keys in
// document order.
nlohmann::json parse_json_strictly(std::string_view text, std::string_view file_label,
                                   std::vector<std::string>* top_level_keys = nullptr);

// A read-only memory map of a validated file. Tensor bytes are views into the map, valid while the
// reader lives; they need not be aligned for their dtype. (Truncating the file while it is mapped makes
// later accesses fault, as for any mapped file.)
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::filesystem::path& path);
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&& other) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&& other) noexcept;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::filesystem::path& path() const { return path_; }
  uint64_t file_size() const { return map_size_; }
  const std::vector<TensorInfo>& tensors() const { return layout_.tensors; }  // file order
  const std::map<std::string, std::string>& metadata() const { return layout_.metadata; }

  const TensorInfo* find(std::string_view name) const;          // nullptr when absent
  const TensorInfo& at(std::string_view name) const;            // FormatError when absent
  std::span<const std::byte> bytes(const TensorInfo& t) const;  // t must come from this reader
  std::span<const std::byte> bytes(std::string_view name) const { return bytes(at(name)); }

  // Converts an F32, BF16 or F16 tensor to fp32. out.size() must equal the element count
  // (std::invalid_argument otherwise); other dtypes give FormatError.
  void read_f32(std::string_view name, std::span<float> out) const;

 private:
  std::filesystem::path path_;
  const std::byte* map_ = nullptr;
  size_t map_size_ = 0;
  SafetensorsLayout layout_;
  std::map<std::string, size_t, std::less<>> by_name_;
};

// Drops the pages of a span of a read-only file mapping (a reader's bytes) from this process: they are read from the
// file again if touched, so streaming a checkpoint larger than RAM keeps a bounded resident set. The pages the span
// shares with its neighbours go too (they come back the same way).
void release_mapped_pages(std::span<const std::byte> s);

// Converts `n` little-endian elements of an F32, BF16 or F16 tensor at `src` (any alignment) to fp32.
void convert_to_f32(FileDType src_dtype, const std::byte* src, float* dst, size_t n);

// A tensor the writer is told about before any data.
struct TensorDecl {
  std::string name;
  FileDType dtype = FileDType::F32;
  Shape shape;

  uint64_t nbytes() const;  // std::invalid_argument on a negative dimension or overflow
};

// Reorders declarations the way the Python `safetensors` library lays a file out (dtype rank
// descending, then name bytewise). Declaring in this order makes SafetensorsWriter's output
// byte-identical to `safetensors.{torch,numpy}.save` with the same tensors and at most one metadata
// entry (the Python library writes metadata in hash order).
void sort_like_reference_writer(std::vector<TensorDecl>& tensors);

// The header bytes (length prefix + JSON + space padding to a multiple of 8) for tensors laid out
// consecutively in the given order. Metadata keys are written sorted; empty metadata writes no
// "__metadata__" entry (like the Python library given metadata=None).
std::string safetensors_header(const std::vector<TensorDecl>& tensors,
                               const std::map<std::string, std::string>& metadata);

// Streams a file: all tensors are declared up front so the header goes first; then each tensor's bytes
// arrive in declaration order, in as many pieces as the caller likes, so a tensor larger than memory
// can be converted piecewise. Nothing appears under `path` until commit(). Any error thrown by a member
// function (I/O failure, a byte count that does not match a declaration, a piece for the wrong tensor)
// removes the temporary file and leaves the writer failed; so does destruction before commit().
class SafetensorsWriter {
 public:
  // Invalid declarations (duplicate or reserved names, negative dimensions, invalid UTF-8) throw
  // std::invalid_argument before any file is created. The whole file's space is reserved up front, so
  // a disk too small for it throws IoError here.
  SafetensorsWriter(std::filesystem::path path, std::vector<TensorDecl> tensors,
                    std::map<std::string, std::string> metadata = {});

  // Appends bytes to tensor `name`, which must be the first declared tensor not yet complete
  // (zero-byte tensors complete themselves; an empty piece is accepted for any declared tensor).
  // Throws std::invalid_argument on an overrun, an undeclared name or a piece for another tensor.
  void write(std::string_view name, std::span<const std::byte> bytes);
  // Checks every tensor is complete, then flushes and fsyncs under the temporary name. For multi-file
  // writers; commit() calls it.
  void finish();
  // finish(), then renames into place and fsyncs the directory.
  void commit();

  const std::filesystem::path& path() const { return file_.target(); }
  const std::vector<TensorDecl>& tensors() const { return tensors_; }
  uint64_t file_size() const { return header_size_ + data_size_; }

 private:
  template <typename F> void guarded(F&& f);
  void skip_complete();

  std::vector<TensorDecl> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;
  std::vector<uint64_t> sizes_;
  uint64_t data_size_ = 0;
  std::string header_;  // built (and so validated) before file_ creates anything
  uint64_t header_size_ = 0;
  AtomicFile file_;
  size_t current_ = 0;            // first tensor not yet complete
  uint64_t current_written_ = 0;  // bytes of it written so far
  bool failed_ = false;
};

}  // namespace hs::checkpoint
