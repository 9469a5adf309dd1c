// Checkpoints of one or several safetensors files, laid out the way Hugging Face does it:
//   model.safetensors                                  (everything in one file), or
//   model-00001-of-00003.safetensors ... + model.safetensors.index.json
// where the index is {"metadata": {"total_size": N}, "weight_map": {"tensor name": "shard file"}}.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/safetensors.h"

namespace hs::checkpoint {

inline constexpr std::string_view kSingleFileName = "model.safetensors";
inline constexpr std::string_view kIndexFileName = "model.safetensors.index.json";

// "model-00002-of-00005.safetensors" for shard 2 (1-based) of 5.
std::string shard_file_name(size_t shard, size_t count);

// Opens and validates a whole checkpoint. `path` may be a directory (model.safetensors is preferred
// over the index when both exist, as in `transformers`), a .safetensors file, or an index file.
// With an index, every shard it names is opened, and these are FormatErrors: a shard file name that is
// not a plain file name, a tensor the index places in a shard that lacks it, and a tensor a shard holds
// but the index does not place there (a shard that does not match its index is a mixed-up checkpoint,
// and loading only the listed tensors would hide that). A missing shard is an IoError naming it.
// "total_size" is read but not checked: published checkpoints disagree on what it counts.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  bool sharded() const { return sharded_; }
  const std::vector<SafetensorsReader>& files() const { return files_; }
  std::optional<uint64_t> index_total_size() const { return index_total_size_; }

  // Every tensor name: files in name order, tensors in each file's data order.
  const std::vector<std::string>& tensor_names() const { return names_; }
  bool contains(std::string_view name) const { return by_name_.find(name) != by_name_.end(); }
  // FormatError naming the checkpoint and the tensor when absent.
  const SafetensorsReader& file_of(std::string_view name) const;
  const TensorInfo& info(std::string_view name) const { return file_of(name).at(name); }
  std::span<const std::byte> bytes(std::string_view name) const { return file_of(name).bytes(name); }
  void read_f32(std::string_view name, std::span<float> out) const { file_of(name).read_f32(name, out); }

 private:
  void open_index(const std::filesystem::path& index_path);

  std::filesystem::path path_;
  bool sharded_ = false;
  std::optional<uint64_t> index_total_size_;
  std::vector<SafetensorsReader> files_;
  std::vector<std::string> names_;
  std::map<std::string, size_t, std::less<>> by_name_;  // -> index into files_
};

// Writes a checkpoint split into shards of at most `max_shard_bytes` of tensor data each (headers not
// counted, as in Hugging Face; a tensor larger than that gets a shard of its own). Shards are runs of
// consecutive tensors in declaration order, planned from the declared sizes up front, so the shard
// count in the file names is known before any byte is written. One shard is written as plain
// model.safetensors with no index. `metadata` goes into every file's "__metadata__".
//
// Bytes arrive as for SafetensorsWriter. Each shard is finished (fsynced) under a temporary name and
// nothing becomes visible until commit(), which renames the shards, then the index, then removes
// files of an earlier save in the same directory that would now mislead a loader (model.safetensors,
// the index, model-NNNNN-of-NNNNN.safetensors not just written; `transformers` cleans the same set,
// but before writing). Any failure before the renames, or destruction before commit(), leaves the
// directory as it was. A crash during the renames can leave new shards beside an old index; callers
// who need all-or-nothing across a whole checkpoint should write into a fresh directory.
class ShardedWriter {
 public:
  // Creates `dir` if needed. Declarations are validated as for SafetensorsWriter.
  ShardedWriter(std::filesystem::path dir, std::vector<TensorDecl> tensors, uint64_t max_shard_bytes,
                std::map<std::string, std::string> metadata = {});
  ~ShardedWriter();
  ShardedWriter(const ShardedWriter&) = delete;
  ShardedWriter& operator=(const ShardedWriter&) = delete;

  void write(std::string_view name, std::span<const std::byte> bytes);
  void commit();

  // The planned file names, in order (one entry, model.safetensors, when unsharded).
  const std::vector<std::string>& shard_files() const { return shard_names_; }
  // Shard index (into shard_files()) of each declared tensor.
  size_t shard_of(std::string_view name) const;

 private:
  void open_shard(size_t shard);
  template <typename F> void guarded(F&& f);

  std::filesystem::path dir_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::vector<TensorDecl>> plan_;  // tensors of each shard
  std::vector<std::string> shard_names_;
  std::map<std::string, size_t, std::less<>> shard_by_name_;
  uint64_t total_size_ = 0;
  std::vector<std::unique_ptr<SafetensorsWriter>> shards_;  // opened in order; finished when full
  size_t open_ = 0;                                         // shards opened so far
  bool failed_ = false;
  bool committed_ = false;
};

}  // namespace hs::checkpoint
