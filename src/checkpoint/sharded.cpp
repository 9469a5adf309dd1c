#include "checkpoint/sharded.h"

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

namespace hs::checkpoint {

using namespace std::string_literals;

namespace {

using json = nlohmann::json;

// An index lists each tensor once; even a 100k-tensor model's index is a few MB.
constexpr uintmax_t kMaxIndexBytes = 100'000'000;

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// A shard must sit beside its index: no directories, no way out of the checkpoint.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

std::string read_small_file(const std::filesystem::path& path) {
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) throw IoError("cannot read", path, ec.value());
  if (size > kMaxIndexBytes)
    throw FormatError(path.string() + ": " + std::to_string(size) + " bytes is too large for an index");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError("cannot open", path, errno);
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw IoError("cannot read", path, errno);
  return std::move(text).str();
}

}  // namespace

std::string shard_file_name(size_t shard, size_t count) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", shard, count);
  return name;
}

// ---------------------------------------------------------------------------------------------------
// Reader

CheckpointReader::CheckpointReader(const std::filesystem::path& path) : path_(path) {
  std::filesystem::path single;
  if (std::filesystem::is_directory(path)) {
    if (std::filesystem::exists(path / kSingleFileName)) {
      single = path / kSingleFileName;
    } else if (std::filesystem::exists(path / kIndexFileName)) {
      open_index(path / kIndexFileName);
      return;
    } else {
      throw FormatError(path.string() + ": a checkpoint directory needs " + std::string(kSingleFileName) + " or " +
                        std::string(kIndexFileName));
    }
  } else if (ends_with(path.filename().string(), ".index.json")) {
    open_index(path);
    return;
  } else {
    single = path;
  }
  files_.emplace_back(single);
  for (const TensorInfo& t : files_[0].tensors()) {
    names_.push_back(t.name);
    by_name_.emplace(t.name, 0);
  }
}

void CheckpointReader::open_index(const std::filesystem::path& index_path) {
  sharded_ = true;
  const std::string label = index_path.string();
  const json index = parse_json_strictly(read_small_file(index_path), label);
  if (!index.is_object()) throw FormatError(label + ": the index is not a JSON object");
  if (const auto m = index.find("metadata"); m != index.end()) {
    if (!m->is_object()) throw FormatError(label + ": \"metadata\" is not an object");
    if (const auto ts = m->find("total_size"); ts != m->end() && ts->is_number_unsigned())
      index_total_size_ = ts->get<uint64_t>();
  }
  const auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object()) throw FormatError(label + ": no \"weight_map\" object");

  std::map<std::string, std::string> weight_map;
  std::set<std::string> shard_names;
  for (const auto& [name, file] : wm->items()) {
    if (!file.is_string())
      throw FormatError(label + ": tensor '" + name + "' maps to a JSON " + file.type_name() + ", not a file name");
    const std::string& f = file.get_ref<const std::string&>();
    if (!is_plain_file_name(f))
      throw FormatError(label + ": tensor '" + name + "' maps to '" + f + "', which is not a plain file name");
    weight_map.emplace(name, f);
    shard_names.insert(f);
  }

  const std::filesystem::path dir = index_path.parent_path();
  std::map<std::string, size_t> file_index;
  for (const std::string& f : shard_names) {
    try {
      files_.emplace_back(dir / f);
    } catch (const IoError& e) {
      throw IoError("cannot open shard listed in " + label + ":", dir / f, e.error_number());
    }
    file_index.emplace(f, files_.size() - 1);
  }
  for (const auto& [name, f] : weight_map) {
    if (!files_[file_index.at(f)].find(name))
      throw FormatError(label + ": tensor '" + name + "' is mapped to '" + f + "', which has no such tensor");
  }
  for (const auto& [f, i] : file_index) {
    for (const TensorInfo& t : files_[i].tensors()) {
      const auto it = weight_map.find(t.name);
      if (it == weight_map.end())
        throw FormatError(files_[i].path().string() + ": tensor '" + t.name + "' is not in the index " + label);
      if (it->second != f)
        throw FormatError(files_[i].path().string() + ": tensor '" + t.name + "' is also here, but the index " + label +
                          " places it in '" + it->second + "'");
      names_.push_back(t.name);
      by_name_.emplace(t.name, i);
    }
  }
}

const SafetensorsReader& CheckpointReader::file_of(std::string_view name) const {
  const auto it = by_name_.find(name);
  if (it == by_name_.end())
    throw FormatError(path_.string() + ": no tensor named '" + std::string(name) + "' in the checkpoint");
  return files_[it->second];
}

// ---------------------------------------------------------------------------------------------------
// Writer

ShardedWriter::ShardedWriter(std::filesystem::path dir, std::vector<TensorDecl> tensors, uint64_t max_shard_bytes,
                             std::map<std::string, std::string> metadata)
    : dir_(std::move(dir)), metadata_(std::move(metadata)) {
  if (max_shard_bytes == 0) throw std::invalid_argument("ShardedWriter: max_shard_bytes must be positive");
  (void)safetensors_header(tensors, metadata_);  // validates every declaration before anything is created

  // Greedy in declaration order: open a new shard when the next tensor would overflow a non-empty one.
  // (Hugging Face instead moves a tensor larger than the limit into a shard of its own ahead of the
  // open one; streaming needs declaration order, so here such a tensor just closes the open shard.)
  uint64_t shard_bytes = 0;
  for (TensorDecl& t : tensors) {
    const uint64_t size = t.nbytes();
    total_size_ += size;
    if (plan_.empty() || (!plan_.back().empty() && shard_bytes + size > max_shard_bytes)) {
      plan_.emplace_back();
      shard_bytes = 0;
    }
    shard_bytes += size;
    shard_by_name_.emplace(t.name, plan_.size() - 1);
    plan_.back().push_back(std::move(t));
  }
  if (plan_.empty()) plan_.emplace_back();  // an empty checkpoint is one empty file
  for (size_t s = 0; s < plan_.size(); ++s)
    shard_names_.push_back(plan_.size() == 1 ? std::string(kSingleFileName) : shard_file_name(s + 1, plan_.size()));

  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) throw IoError("cannot create directory", dir_, ec.value());
}

ShardedWriter::~ShardedWriter() = default;

size_t ShardedWriter::shard_of(std::string_view name) const {
  const auto it = shard_by_name_.find(name);
  if (it == shard_by_name_.end())
    throw std::invalid_argument(dir_.string() + ": tensor '" + std::string(name) + "' was not declared");
  return it->second;
}

template <typename F> void ShardedWriter::guarded(F&& f) {
  if (failed_) throw std::logic_error("ShardedWriter for '"s + dir_.string() + "' already failed");
  if (committed_) throw std::logic_error("ShardedWriter for '"s + dir_.string() + "' already committed");
  try {
    f();
  } catch (...) {
    failed_ = true;
    shards_.clear();  // each unfinished or unrenamed shard removes its temporary
    throw;
  }
}

// Opens shards up to and including `shard`, finishing (and so checking) each one left behind.
void ShardedWriter::open_shard(size_t shard) {
  while (open_ <= shard) {
    if (open_ > 0) shards_.back()->finish();
    shards_.push_back(std::make_unique<SafetensorsWriter>(dir_ / shard_names_[open_], plan_[open_], metadata_));
    ++open_;
  }
}

void ShardedWriter::write(std::string_view name, std::span<const std::byte> bytes) {
  guarded([&] {
    const size_t s = shard_of(name);
    if (bytes.empty()) return;
    if (s + 1 < open_)
      throw std::invalid_argument(dir_.string() + ": tensor '" + std::string(name) + "' belongs to " + shard_names_[s] +
                                  ", which is already complete");
    open_shard(s);
    shards_[s]->write(name, bytes);
  });
}

void ShardedWriter::commit() {
  guarded([&] {
    open_shard(plan_.size() - 1);
    shards_.back()->finish();

    std::optional<AtomicFile> index;
    if (plan_.size() > 1) {
      json weight_map = json::object();
      for (const auto& [name, s] : shard_by_name_) weight_map[name] = shard_names_[s];
      const json doc = {{"metadata", {{"total_size", total_size_}}}, {"weight_map", std::move(weight_map)}};
      // The layout `transformers` writes: sorted keys, 2-space indent, ASCII escapes, final newline.
      index.emplace(dir_ / kIndexFileName);
      index->write(doc.dump(2, ' ', true) + "\n");
      index->finish();
    }

    // Everything is durable under temporary names; now make it visible, index last.
    for (size_t s = 0; s < shards_.size(); ++s) {
      try {
        shards_[s]->commit();
      } catch (...) {
        std::error_code ignored;  // best effort: the first error is the one to report
        for (size_t r = 0; r < s; ++r) std::filesystem::remove(dir_ / shard_names_[r], ignored);
        throw;
      }
    }
    if (index) index->commit();

    // A stale file of another layout or shard count would mislead loaders (transformers prefers
    // model.safetensors over any index).
    static const std::regex stale(R"(model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?)");
    std::set<std::string> ours(shard_names_.begin(), shard_names_.end());
    if (index) ours.insert(std::string(kIndexFileName));
    bool removed = false;
    for (const auto& e : std::filesystem::directory_iterator(dir_)) {
      const std::string f = e.path().filename().string();
      if (ours.count(f) || !std::regex_match(f, stale)) continue;
      std::error_code ec;
      std::filesystem::remove(e.path(), ec);
      if (ec) throw IoError("the new checkpoint is complete, but cannot remove the stale", e.path(), ec.value());
      removed = true;
    }
    if (removed) fsync_directory(dir_);
  });
  committed_ = true;
}

}  // namespace hs::checkpoint
