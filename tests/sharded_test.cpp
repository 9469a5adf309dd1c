#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/sharded.h"
#include "test_util.h"

namespace hs::checkpoint {
namespace {

namespace fs = std::filesystem;
using namespace std::string_literals;
using Bytes = std::vector<std::byte>;

const fs::path kHfShards = fs::path(hs::test::source_dir()) / "tests" / "fixtures" / "safetensors" / "sharded";

using test::error_of;
using test::read_bytes;
using test::TempDir;

void write_text(const fs::path& p, std::string_view text) { std::ofstream(p) << text; }

struct Tensor {
  TensorDecl decl;
  Bytes bytes;
};

// The fixture's tensors: layers.i.weight, F32 [4, 4], element j = 100 i + j.
std::vector<Tensor> hf_tensors() {
  std::vector<Tensor> ts;
  for (int i = 0; i < 8; ++i) {
    Tensor t{{"layers."s + std::to_string(i) + ".weight", FileDType::F32, {4, 4}}, Bytes(64)};
    for (int j = 0; j < 16; ++j) {
      const float v = static_cast<float>(100 * i + j);
      std::memcpy(t.bytes.data() + 4 * j, &v, 4);
    }
    ts.push_back(std::move(t));
  }
  return ts;
}

std::vector<Tensor> random_tensors(uint32_t seed, int count) {
  std::mt19937 rng(seed);
  const FileDType types[] = {FileDType::BF16, FileDType::F32, FileDType::I64, FileDType::U8};
  std::vector<Tensor> ts;
  for (int i = 0; i < count; ++i) {
    Shape shape = {1 + static_cast<int64_t>(rng() % 40)};
    if (i % 7 == 3) shape = {0, 5};  // empty tensors ride along in whichever shard is open
    Tensor t{{"model.t"s + std::to_string(i), types[rng() % 4], shape}, {}};
    t.bytes.resize(t.decl.nbytes());
    for (std::byte& b : t.bytes) b = static_cast<std::byte>(rng());
    ts.push_back(std::move(t));
  }
  return ts;
}

std::vector<TensorDecl> decls_of(const std::vector<Tensor>& ts) {
  std::vector<TensorDecl> d;
  for (const Tensor& t : ts) d.push_back(t.decl);
  return d;
}

// Streams every tensor in two pieces, then commits.
void save(const fs::path& dir, const std::vector<Tensor>& ts, uint64_t max_shard_bytes,
          const std::map<std::string, std::string>& meta = {{"format", "pt"}}) {
  ShardedWriter w(dir, decls_of(ts), max_shard_bytes, meta);
  for (const Tensor& t : ts) {
    const std::span<const std::byte> b(t.bytes);
    w.write(t.decl.name, b.first(b.size() / 2));
    w.write(t.decl.name, b.subspan(b.size() / 2));
  }
  w.commit();
}

void expect_checkpoint_holds(const CheckpointReader& r, const std::vector<Tensor>& ts) {
  std::vector<std::string> want;
  for (const Tensor& t : ts) want.push_back(t.decl.name);
  EXPECT_EQ(r.tensor_names(), want);  // shards in name order, each in file order = declaration order
  for (const Tensor& t : ts) {
    const TensorInfo& info = r.info(t.decl.name);
    EXPECT_EQ(info.dtype, t.decl.dtype) << t.decl.name;
    EXPECT_EQ(info.shape, t.decl.shape) << t.decl.name;
    const auto b = r.bytes(t.decl.name);
    EXPECT_TRUE(std::equal(b.begin(), b.end(), t.bytes.begin(), t.bytes.end())) << t.decl.name;
  }
}

TEST(CheckpointReader, ReadsShardsWrittenByHuggingFaceHub) {
  for (const fs::path& p : {kHfShards, kHfShards / kIndexFileName}) {
    const CheckpointReader r(p);
    EXPECT_TRUE(r.sharded());
    EXPECT_EQ(r.files().size(), 3u);
    EXPECT_EQ(r.index_total_size(), 512u);
    expect_checkpoint_holds(r, hf_tensors());
    EXPECT_EQ(r.file_of("layers.4.weight").path().filename().string(), "model-00002-of-00003.safetensors");
    std::vector<float> w(16);
    r.read_f32("layers.7.weight", w);
    EXPECT_EQ(w[15], 715.0f);
    EXPECT_FALSE(r.contains("layers.8.weight"));
    const std::string msg = error_of([&] { (void)r.info("layers.8.weight"); });
    EXPECT_NE(msg.find("no tensor named 'layers.8.weight' in the checkpoint"), std::string::npos) << msg;
  }
}

TEST(ShardedWriter, ReproducesHuggingFaceHubShardsByteForByte) {
  TempDir dir;
  const auto ts = hf_tensors();
  ShardedWriter w(dir.path(), decls_of(ts), 200, {{"format", "pt"}});
  EXPECT_EQ(w.shard_files(),
            (std::vector<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                      "model-00003-of-00003.safetensors"}));
  for (const Tensor& t : ts) w.write(t.decl.name, t.bytes);
  w.commit();
  for (const std::string& f : w.shard_files()) EXPECT_EQ(read_bytes(dir / f), read_bytes(kHfShards / f)) << f;
  // Same index content; ours is laid out as `transformers` writes it (sorted keys, final newline).
  const auto index_json = [](const fs::path& p) {
    std::ifstream in(p);
    return nlohmann::json::parse(in);
  };
  EXPECT_EQ(index_json(dir / kIndexFileName), index_json(kHfShards / kIndexFileName));
  EXPECT_EQ(dir.entries().size(), 4u);
}

TEST(ShardedWriter, RoundTripSeveralShardsMixedDtypesOversizedAndEmptyTensors) {
  TempDir dir;
  auto ts = random_tensors(5, 40);
  ts.insert(ts.begin() + 17, Tensor{{"huge", FileDType::F32, {100}}, Bytes(400, std::byte{3})});  // > max
  constexpr uint64_t kMax = 256;
  save(dir.path(), ts, kMax);
  const CheckpointReader r(dir.path());
  ASSERT_TRUE(r.sharded());
  expect_checkpoint_holds(r, ts);
  ASSERT_GT(r.files().size(), 3u);
  for (const SafetensorsReader& f : r.files()) {
    uint64_t data = 0;
    size_t holding_bytes = 0;
    for (const TensorInfo& t : f.tensors()) {
      data += t.nbytes();
      holding_bytes += t.nbytes() > 0;
    }
    // A tensor larger than the limit gets a shard of its own (empty tensors may ride along).
    if (data > kMax) {
      EXPECT_EQ(holding_bytes, 1u) << f.path();
    }
    EXPECT_EQ(f.metadata().at("format"), "pt");
  }
  EXPECT_EQ(r.file_of("huge").tensors().front().name, "huge");
  uint64_t total = 0;
  for (const Tensor& t : ts) total += t.bytes.size();
  EXPECT_EQ(r.index_total_size(), total);
}

TEST(ShardedWriter, OneShardIsAPlainModelFileWithoutIndex) {
  TempDir dir;
  const auto ts = random_tensors(6, 10);
  save(dir.path(), ts, uint64_t(1) << 30);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
  const CheckpointReader r(dir.path());
  EXPECT_FALSE(r.sharded());
  expect_checkpoint_holds(r, ts);
  expect_checkpoint_holds(CheckpointReader(dir / "model.safetensors"), ts);

  TempDir empty;
  save(empty.path(), {}, 100);
  EXPECT_TRUE(CheckpointReader(empty.path()).tensor_names().empty());
}

TEST(ShardedWriter, NothingIsVisibleBeforeCommitAndAbandonedSavesVanish) {
  TempDir dir;
  const auto ts = random_tensors(7, 30);
  {
    ShardedWriter w(dir.path(), decls_of(ts), 128);
    ASSERT_GT(w.shard_files().size(), 3u);
    for (size_t i = 0; i < 20; ++i) w.write(ts[i].decl.name, ts[i].bytes);
    // Finished shards wait under temporary names.
    for (const std::string& e : dir.entries()) EXPECT_EQ(e[0], '.') << e;
    EXPECT_FALSE(dir.entries().empty());
  }
  EXPECT_TRUE(dir.entries().empty());
}

TEST(ShardedWriter, AnErrorMidSaveRemovesEveryShard) {
  TempDir dir;
  const auto ts = random_tensors(8, 30);
  ShardedWriter w(dir.path(), decls_of(ts), 128);
  const size_t last = w.shard_of(ts.back().decl.name);
  for (size_t i = 0; i + 1 < ts.size(); ++i) w.write(ts[i].decl.name, ts[i].bytes);
  const std::string msg = error_of([&] { w.commit(); });  // the last tensor never arrived
  EXPECT_NE(msg.find(w.shard_files()[last]), std::string::npos) << msg;
  EXPECT_NE(msg.find("tensor '" + ts.back().decl.name + "' is incomplete"), std::string::npos) << msg;
  EXPECT_TRUE(dir.entries().empty());
  EXPECT_THROW(w.write(ts[0].decl.name, ts[0].bytes), std::logic_error);

  // Skipping ahead into a later shard before the current one is complete.
  ShardedWriter skip(dir.path(), decls_of(ts), 128);
  skip.write(ts[0].decl.name, ts[0].bytes);
  EXPECT_THROW(skip.write(ts.back().decl.name, ts.back().bytes), std::invalid_argument);
  EXPECT_TRUE(dir.entries().empty());
}

TEST(ShardedWriter, FullDiskInALaterShardRemovesEveryShard) {
  TempDir dir;
  std::vector<Tensor> ts;
  for (int i = 0; i < 4; ++i) ts.push_back({{"w"s + std::to_string(i), FileDType::U8, {1 << 20}}, Bytes(1 << 20)});
  std::string msg;
  {
    // Every shard alone fits under the limit; the third fails when the limit is lowered mid-save.
    ShardedWriter w(dir.path(), decls_of(ts), 1 << 20);
    w.write("w0", ts[0].bytes);
    w.write("w1", ts[1].bytes);
    const auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
    rlimit old{};
    ::getrlimit(RLIMIT_FSIZE, &old);
    rlimit lim = old;
    lim.rlim_cur = 1 << 19;
    ::setrlimit(RLIMIT_FSIZE, &lim);
    msg = error_of([&] { w.write("w2", ts[2].bytes); });
    ::setrlimit(RLIMIT_FSIZE, &old);
    ::signal(SIGXFSZ, old_handler);
  }
  EXPECT_NE(msg.find("model-00003-of-00004.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::strerror(EFBIG)), std::string::npos) << msg;
  EXPECT_TRUE(dir.entries().empty());
}

TEST(ShardedWriter, RemovesStaleFilesOfAnEarlierSave) {
  TempDir dir;
  write_text(dir / "config.json", "{}");
  write_text(dir / "model.safetensors.backup", "keep me");
  const auto ts = random_tensors(9, 30);
  save(dir.path(), ts, 128);
  const size_t shards = CheckpointReader(dir.path()).files().size();
  ASSERT_GT(shards, 2u);
  // Now as one file: the old shards and index would otherwise sit beside it.
  save(dir.path(), ts, 1 << 20);
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"config.json", "model.safetensors", "model.safetensors.backup"}));
  // And sharded again, with fewer shards than the first time.
  save(dir.path(), ts, 512);
  const CheckpointReader r(dir.path());
  EXPECT_TRUE(r.sharded());
  EXPECT_EQ(dir.entries().size(), 3 + r.files().size());
  expect_checkpoint_holds(r, ts);
}

TEST(ShardedWriter, RejectsBadDeclarationsBeforeCreatingAnything) {
  TempDir dir;
  const auto sub = dir / "ckpt";
  EXPECT_THROW((ShardedWriter(sub, {{"a", FileDType::F32, {1}}, {"a", FileDType::F32, {1}}}, 100)),
               std::invalid_argument);
  EXPECT_THROW((ShardedWriter(sub, {{"a", FileDType::F32, {-1}}}, 100)), std::invalid_argument);
  EXPECT_THROW((ShardedWriter(sub, {{"a", FileDType::F32, {1}}}, 0)), std::invalid_argument);
  EXPECT_TRUE(dir.entries().empty());
  EXPECT_EQ(shard_file_name(2, 15), "model-00002-of-00015.safetensors");
}

// ---------------------------------------------------------------------------------------------------
// Inconsistent checkpoints

// A copy of the Hugging Face fixture whose index the test then edits.
fs::path copy_of_hf_checkpoint(const TempDir& dir) {
  for (const auto& e : fs::directory_iterator(kHfShards)) fs::copy_file(e.path(), dir / e.path().filename().string());
  return dir.path();
}

nlohmann::json hf_index() {
  std::ifstream in(kHfShards / kIndexFileName);
  return nlohmann::json::parse(in);
}

void expect_error(const fs::path& p, std::initializer_list<std::string_view> phrases) {
  const std::string msg = error_of([&] { CheckpointReader r(p); });
  for (std::string_view s : phrases) EXPECT_NE(msg.find(s), std::string::npos) << "'" << s << "' not in: " << msg;
}

TEST(CheckpointReader, MissingShardIsAnIoErrorNamingIt) {
  TempDir dir;
  copy_of_hf_checkpoint(dir);
  fs::remove(dir / "model-00002-of-00003.safetensors");
  EXPECT_THROW(CheckpointReader{dir.path()}, IoError);
  expect_error(dir.path(), {"cannot open shard listed in", "model-00002-of-00003.safetensors", std::strerror(ENOENT)});
}

TEST(CheckpointReader, IndexedTensorMissingFromItsShard) {
  TempDir dir;
  copy_of_hf_checkpoint(dir);
  auto index = hf_index();
  index["weight_map"]["layers.9.weight"] = "model-00001-of-00003.safetensors";
  write_text(dir / kIndexFileName, index.dump());
  EXPECT_THROW(CheckpointReader{dir.path()}, FormatError);
  expect_error(dir.path(), {kIndexFileName,
                            "tensor 'layers.9.weight' is mapped to 'model-00001-of-00003.safetensors', "
                            "which has no such tensor"});
}

TEST(CheckpointReader, ShardTensorMissingFromTheIndex) {
  TempDir dir;
  copy_of_hf_checkpoint(dir);
  auto index = hf_index();
  index["weight_map"].erase("layers.4.weight");
  write_text(dir / kIndexFileName, index.dump());
  expect_error(dir.path(), {"model-00002-of-00003.safetensors: tensor 'layers.4.weight' is not in the index"});
}

TEST(CheckpointReader, TensorInTwoShards) {
  TempDir dir;
  copy_of_hf_checkpoint(dir);
  // Shard 1 rewritten with a copy of layers.4.weight, which the index places in shard 2.
  auto ts = hf_tensors();
  const std::vector<Tensor> shard1 = {ts[0], ts[1], ts[2], ts[4]};
  SafetensorsWriter w(dir / "model-00001-of-00003.safetensors", decls_of(shard1));
  for (const Tensor& t : shard1) w.write(t.decl.name, t.bytes);
  w.commit();
  expect_error(dir.path(), {"model-00001-of-00003.safetensors: tensor 'layers.4.weight' is also here, but the index",
                            "places it in 'model-00002-of-00003.safetensors'"});
}

TEST(CheckpointReader, MalformedIndexes) {
  TempDir dir;
  copy_of_hf_checkpoint(dir);
  const auto idx = dir / kIndexFileName;
  write_text(idx, "{\"weight_map\": ");
  expect_error(dir.path(), {kIndexFileName, "invalid JSON"});
  write_text(idx, "{\"metadata\": {}}");
  expect_error(dir.path(), {"no \"weight_map\" object"});
  write_text(idx, "{\"weight_map\": {\"a\": 3}}");
  expect_error(dir.path(), {"tensor 'a' maps to a JSON number, not a file name"});
  write_text(idx, "{\"weight_map\": {\"a\": \"../model-00001-of-00003.safetensors\"}}");
  expect_error(dir.path(), {"'../model-00001-of-00003.safetensors', which is not a plain file name"});
  write_text(idx, "{\"weight_map\": {\"a\": \"x.safetensors\", \"a\": \"y.safetensors\"}}");
  expect_error(dir.path(), {"duplicate key 'a'"});
  write_text(idx, "[]");
  expect_error(dir.path(), {"the index is not a JSON object"});
  write_text(idx, "{\"metadata\": 5, \"weight_map\": {}}");
  expect_error(dir.path(), {"\"metadata\" is not an object"});
}

TEST(CheckpointReader, BadShardContentsAndPaths) {
  TempDir dir;
  copy_of_hf_checkpoint(dir);
  fs::resize_file(dir / "model-00003-of-00003.safetensors", 300);
  EXPECT_THROW(CheckpointReader{dir.path()}, FormatError);
  expect_error(dir.path(), {"model-00003-of-00003.safetensors: tensor 'layers.7.weight'", "outside the data area"});

  TempDir empty;
  expect_error(empty.path(), {"a checkpoint directory needs model.safetensors or model.safetensors.index.json"});
  EXPECT_THROW(CheckpointReader{empty / "nothing.safetensors"}, IoError);
}

TEST(CheckpointReader, PrefersTheSingleFileOverAnIndex) {
  TempDir dir;
  copy_of_hf_checkpoint(dir);
  const auto ts = random_tensors(10, 3);
  SafetensorsWriter w(dir / "model.safetensors", decls_of(ts));
  for (const Tensor& t : ts) w.write(t.decl.name, t.bytes);
  w.commit();
  const CheckpointReader r(dir.path());  // as `transformers` does
  EXPECT_FALSE(r.sharded());
  expect_checkpoint_holds(r, ts);
}

}  // namespace
}  // namespace hs::checkpoint
