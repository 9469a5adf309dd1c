#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "core/atomic_file.h"
#include "checkpoint/safetensors.h"
#include "test_util.h"

namespace hs::checkpoint {

using namespace std::string_literals;
namespace {

namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(hs::test::source_dir()) / "tests" / "fixtures" / "safetensors";

using test::error_of;
using test::read_bytes;
using test::TempDir;

void write_bytes(const fs::path& p, std::span<const std::byte> b) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Exact float -> binary16 for values binary16 represents exactly (all the fixture uses); NaN is
// 0x7e00, as torch writes it.
uint16_t half_bits(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const float a = std::fabs(f);
  if (std::isnan(f)) return 0x7e00;
  if (std::isinf(f)) return sign | 0x7c00;
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);  // a = m * 2^e with m in [0.5, 1)
  const int biased = e - 1 + 15;
  if (biased >= 1)
    return sign | static_cast<uint16_t>(biased << 10) | static_cast<uint16_t>(std::ldexp(a, 1 - e) * 1024 - 1024);
  return sign | static_cast<uint16_t>(std::ldexp(a, 24));
}

struct Expected {
  TensorDecl decl;
  std::vector<std::byte> bytes;
};

template <typename T, typename F> Expected make(std::string name, FileDType dt, Shape shape, F value) {
  Expected e{{std::move(name), dt, std::move(shape)}, {}};
  const auto n = static_cast<size_t>(numel(e.decl.shape));
  e.bytes.resize(n * sizeof(T));
  for (size_t i = 0; i < n; ++i) {
    const T v = static_cast<T>(value(static_cast<int64_t>(i)));
    std::memcpy(e.bytes.data() + i * sizeof(T), &v, sizeof(T));
  }
  return e;
}

const float kF16Special[] = {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 0x1p-14f, 0x1p-24f, INFINITY, -INFINITY, NAN};

// The tensors of tests/fixtures/safetensors/all_dtypes.safetensors, from the formulas in
// scripts/make_safetensors_fixtures.py, in an order unlike the file's.
std::vector<Expected> all_dtypes_tensors() {
  using D = FileDType;
  return {
      make<float>("odd \"name\"\twith \xc3\xa9", D::F32, {1}, [](int64_t) { return 42.0f; }),
      make<double>("f64.scalar", D::F64, {}, [](int64_t) { return -1.5; }),
      make<float>("f32.matrix", D::F32, {2, 3}, [](int64_t i) { return static_cast<float>(i - 5) * 0.25f; }),
      make<uint16_t>("f16.vector", D::F16, {5}, [](int64_t i) { return half_bits(static_cast<float>(i - 2) * 0.5f); }),
      make<uint16_t>("f16.special", D::F16, {10}, [](int64_t i) { return half_bits(kF16Special[i]); }),
      make<uint16_t>("bf16.cube", D::BF16, {2, 2, 3},
                     [](int64_t i) { return bf16::from_float(static_cast<float>(i - 7) * 0.5f); }),
      make<int64_t>("i64.vector", D::I64, {4}, [](int64_t i) { return (i - 2) * 3'000'000'000; }),
      make<int32_t>("i32.empty", D::I32, {0, 3}, [](int64_t) { return 0; }),
      make<int16_t>("i16.vector", D::I16, {3}, [](int64_t i) { return (i - 1) * 1000; }),
      make<int8_t>("i8.vector", D::I8, {7}, [](int64_t i) { return i - 5; }),
      make<uint8_t>("u8.vector", D::U8, {6}, [](int64_t i) { return i * 3; }),
      make<uint16_t>("u16.vector", D::U16, {2}, [](int64_t i) { return i * 1000 + 1; }),
      make<uint32_t>("u32.vector", D::U32, {2}, [](int64_t i) { return i * 100'000 + 1; }),
      make<uint64_t>("u64.vector", D::U64, {2}, [](int64_t i) { return (uint64_t(i) << 40) + 1; }),
      make<uint8_t>("bool.vector", D::BOOL, {5}, [](int64_t i) { return i % 3 == 0; }),
      make<uint8_t>("f8e4m3.vector", D::F8_E4M3, {4}, [](int64_t i) { return i * 7; }),
      make<uint8_t>("f8e5m2.vector", D::F8_E5M2, {4}, [](int64_t i) { return i * 5; }),
  };
}

std::vector<TensorDecl> decls_of(const std::vector<Expected>& ts) {
  std::vector<TensorDecl> out;
  for (const Expected& e : ts) out.push_back(e.decl);
  return out;
}

// Writes `ts` in the given declaration order, each tensor in pieces of at most `piece` bytes.
void write_file(const fs::path& path, const std::vector<Expected>& ts, const std::map<std::string, std::string>& meta,
                size_t piece = SIZE_MAX) {
  SafetensorsWriter w(path, decls_of(ts), meta);
  for (const Expected& e : ts) {
    std::span<const std::byte> rest(e.bytes);
    do {
      const size_t n = std::min(piece, rest.size());
      w.write(e.decl.name, rest.first(n));
      rest = rest.subspan(n);
    } while (!rest.empty());
  }
  w.commit();
}

const Expected* by_name(const std::vector<Expected>& ts, std::string_view name) {
  for (const Expected& e : ts)
    if (e.decl.name == name) return &e;
  return nullptr;
}

void expect_same_tensors(const SafetensorsReader& r, const std::vector<Expected>& ts) {
  ASSERT_EQ(r.tensors().size(), ts.size());
  for (const TensorInfo& t : r.tensors()) {
    const Expected* e = by_name(ts, t.name);
    ASSERT_NE(e, nullptr) << t.name;
    EXPECT_EQ(t.dtype, e->decl.dtype) << t.name;
    EXPECT_EQ(t.shape, e->decl.shape) << t.name;
    const auto b = r.bytes(t);
    EXPECT_TRUE(std::equal(b.begin(), b.end(), e->bytes.begin(), e->bytes.end())) << t.name;
  }
}

// ---------------------------------------------------------------------------------------------------
// Files written by the Python library

TEST(SafetensorsFixture, ReadsEveryDtypeWrittenByPython) {
  const SafetensorsReader r(kFixtures / "all_dtypes.safetensors");
  expect_same_tensors(r, all_dtypes_tensors());
  EXPECT_EQ(r.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  // File order is data order: offsets increase.
  for (size_t i = 1; i < r.tensors().size(); ++i) EXPECT_EQ(r.tensors()[i].begin, r.tensors()[i - 1].end);
  const TensorInfo& scalar = r.at("f64.scalar");
  EXPECT_TRUE(scalar.shape.empty());
  EXPECT_EQ(scalar.numel(), 1u);
  EXPECT_EQ(r.at("i32.empty").nbytes(), 0u);
  EXPECT_EQ(r.find("missing"), nullptr);
  EXPECT_NE(error_of([&] { (void)r.at("missing"); }).find("no tensor named 'missing'"), std::string::npos);
}

TEST(SafetensorsFixture, ReadsFilesWithoutMetadataOrTensors) {
  const SafetensorsReader plain(kFixtures / "no_metadata.safetensors");
  EXPECT_TRUE(plain.metadata().empty());
  ASSERT_EQ(plain.tensors().size(), 2u);
  std::vector<float> a(3);
  plain.read_f32("a", a);
  EXPECT_EQ(a, (std::vector<float>{0, 1, 2}));
  const SafetensorsReader empty(kFixtures / "empty.safetensors");
  EXPECT_TRUE(empty.tensors().empty());
}

TEST(SafetensorsFixture, ConvertsF32Bf16AndF16ToF32Exactly) {
  const SafetensorsReader r(kFixtures / "all_dtypes.safetensors");
  std::vector<float> m(6), cube(12), vec(5), special(10);
  r.read_f32("f32.matrix", m);
  r.read_f32("bf16.cube", cube);
  r.read_f32("f16.vector", vec);
  r.read_f32("f16.special", special);
  // Every value is exactly representable in its storage type, so conversions must be exact.
  for (int i = 0; i < 6; ++i) EXPECT_EQ(m[i], (i - 5) * 0.25f);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(cube[i], (i - 7) * 0.5f);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(vec[i], (i - 2) * 0.5f);
  for (int i = 0; i < 9; ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(special[i]), std::bit_cast<uint32_t>(kF16Special[i])) << i;
  }
  EXPECT_TRUE(std::isnan(special[9]));
}

TEST(SafetensorsFixture, ReadF32RejectsOtherDtypesAndWrongSizes) {
  const SafetensorsReader r(kFixtures / "all_dtypes.safetensors");
  std::vector<float> out(4);
  const std::string dtype_error = error_of([&] { r.read_f32("i64.vector", out); });
  EXPECT_NE(dtype_error.find("all_dtypes.safetensors"), std::string::npos) << dtype_error;
  EXPECT_NE(dtype_error.find("tensor 'i64.vector' is I64"), std::string::npos) << dtype_error;
  EXPECT_THROW(r.read_f32("i64.vector", out), FormatError);
  EXPECT_THROW(r.read_f32("f32.matrix", out), std::invalid_argument);  // 6 elements into 4
}

// Our writer, given the same tensors in the Python library's layout order, reproduces its files.
TEST(SafetensorsFixture, WriterReproducesPythonBytes) {
  TempDir dir;
  std::vector<Expected> ts = all_dtypes_tensors();
  std::vector<TensorDecl> order = decls_of(ts);
  sort_like_reference_writer(order);
  std::vector<Expected> sorted;
  for (const TensorDecl& d : order) sorted.push_back(*by_name(ts, d.name));
  write_file(dir / "all.safetensors", sorted, {{"format", "pt"}});
  EXPECT_EQ(read_bytes(dir / "all.safetensors"), read_bytes(kFixtures / "all_dtypes.safetensors"));

  const std::vector<Expected> plain = {
      make<float>("a", FileDType::F32, {3}, [](int64_t i) { return static_cast<float>(i); }),
      make<int16_t>("b", FileDType::I16, {2}, [](int64_t i) { return i; })};
  write_file(dir / "plain.safetensors", plain, {});
  EXPECT_EQ(read_bytes(dir / "plain.safetensors"), read_bytes(kFixtures / "no_metadata.safetensors"));

  write_file(dir / "empty.safetensors", {}, {});
  EXPECT_EQ(read_bytes(dir / "empty.safetensors"), read_bytes(kFixtures / "empty.safetensors"));

  // A header that needs no padding (the fixture script picked the name length for that).
  const SafetensorsReader unpadded(kFixtures / "unpadded.safetensors");
  ASSERT_EQ(unpadded.tensors().size(), 1u);
  write_file(dir / "unpadded.safetensors",
             {make<double>(unpadded.tensors()[0].name, FileDType::F64, {1}, [](int64_t) { return 1.0; })}, {});
  EXPECT_EQ(read_bytes(dir / "unpadded.safetensors"), read_bytes(kFixtures / "unpadded.safetensors"));
}

// ---------------------------------------------------------------------------------------------------
// Round trips and the writer's contract

std::vector<Expected> random_tensors(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Expected> ts;
  const FileDType all[] = {FileDType::F64, FileDType::F32, FileDType::F16, FileDType::BF16,    FileDType::I64,
                           FileDType::I32, FileDType::I16, FileDType::I8,  FileDType::U8,      FileDType::BOOL,
                           FileDType::U16, FileDType::U32, FileDType::U64, FileDType::F8_E4M3, FileDType::F8_E5M2};
  const Shape shapes[] = {{}, {0}, {3, 0, 2}, {1}, {7}, {3, 5}, {2, 3, 4}};
  int k = 0;
  for (FileDType dt : all) {
    for (const Shape& s : shapes) {
      std::string name = "t";  // built by appends: GCC 12 warns falsely on "literal" + std::string
      name += std::to_string(k++);
      name += '.';
      name += file_dtype_name(dt);
      Expected e{{name, dt, s}, {}};
      e.bytes.resize(e.decl.nbytes());
      for (std::byte& b : e.bytes) b = static_cast<std::byte>(rng());
      ts.push_back(std::move(e));
    }
  }
  std::shuffle(ts.begin(), ts.end(), rng);
  return ts;
}

TEST(SafetensorsRoundTrip, AllDtypesScalarsEmptiesAndMetadata) {
  TempDir dir;
  const auto ts = random_tensors(1);
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"zeta", "\"quoted\"\n"}, {"alpha", "\xc3\xa9"}};
  write_file(dir / "x.safetensors", ts, meta, 5);  // pieces of 5 bytes cut across elements
  const SafetensorsReader r(dir / "x.safetensors");
  expect_same_tensors(r, ts);
  EXPECT_EQ(r.metadata(), meta);
  // File order is declaration order.
  for (size_t i = 0; i < ts.size(); ++i) EXPECT_EQ(r.tensors()[i].name, ts[i].decl.name);
  EXPECT_EQ(r.file_size(), fs::file_size(dir / "x.safetensors"));
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"x.safetensors"});
}

TEST(SafetensorsRoundTrip, OutputIsDeterministicAndHeaderAligned) {
  TempDir dir;
  const auto ts = random_tensors(2);
  const std::map<std::string, std::string> meta = {{"b", "2"}, {"a", "1"}};
  write_file(dir / "1.safetensors", ts, meta);
  write_file(dir / "2.safetensors", ts, meta, 3);
  const auto bytes = read_bytes(dir / "1.safetensors");
  EXPECT_EQ(bytes, read_bytes(dir / "2.safetensors"));
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const std::string header(reinterpret_cast<const char*>(bytes.data()) + 8, n);
  EXPECT_EQ(header.rfind("{\"__metadata__\":{\"a\":\"1\",\"b\":\"2\"},", 0), 0u) << header;
  EXPECT_EQ(header, safetensors_header(decls_of(ts), meta).substr(8));
}

TEST(SafetensorsWriter, RejectsBadDeclarationsBeforeCreatingAnything) {
  TempDir dir;
  const auto p = dir / "x.safetensors";
  const auto bad = [&](std::vector<TensorDecl> d, std::map<std::string, std::string> m, std::string_view phrase) {
    const std::string msg = error_of([&] { SafetensorsWriter w(p, d, m); });
    EXPECT_NE(msg.find(phrase), std::string::npos) << msg;
    EXPECT_THROW((void)SafetensorsWriter(p, d, m), std::invalid_argument);
  };
  bad({{"a", FileDType::F32, {1}}, {"a", FileDType::I8, {1}}}, {}, "tensor 'a' is declared twice");
  bad({{"__metadata__", FileDType::F32, {1}}}, {}, "'__metadata__' is reserved");
  bad({{"a", FileDType::F32, {2, -1}}}, {}, "negative dimension");
  bad({{"a", FileDType::F32, {INT64_MAX, 4}}}, {}, "too large");
  bad({{"bad\xff", FileDType::F32, {1}}}, {}, "not valid UTF-8");
  bad({}, {{"k", "\xc3"}}, "not valid UTF-8");
  EXPECT_TRUE(dir.entries().empty());
}

TEST(SafetensorsWriter, RejectsWrongByteCountsAndOrderAndLeavesNothing) {
  TempDir dir;
  const auto p = dir / "x.safetensors";
  const std::vector<TensorDecl> d = {{"a", FileDType::F32, {2}}, {"e", FileDType::F32, {0}}, {"b", FileDType::I8, {3}}};
  const std::vector<std::byte> eight(8), three(3), nine(9);
  {
    SafetensorsWriter w(p, d);
    EXPECT_EQ(dir.entries().size(), 1u);  // the temporary
    const std::string msg = error_of([&] { w.write("a", nine); });
    EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("tensor 'a': 9 more bytes but only 8"), std::string::npos) << msg;
    EXPECT_TRUE(dir.entries().empty());
    EXPECT_THROW(w.write("a", eight), std::logic_error);  // a failed writer stays failed
  }
  {
    SafetensorsWriter w(p, d);
    w.write("a", std::span(eight).first(4));
    const std::string msg = error_of([&] { w.write("b", three); });
    EXPECT_NE(msg.find("tensor 'b': written before 'a' is complete (4 of 8 bytes)"), std::string::npos) << msg;
    EXPECT_TRUE(dir.entries().empty());
  }
  {
    SafetensorsWriter w(p, d);
    w.write("a", eight);
    w.write("e", {});  // empty pieces are accepted for any declared tensor
    w.write("b", std::span(three).first(2));
    const std::string msg = error_of([&] { w.commit(); });
    EXPECT_NE(msg.find("tensor 'b' is incomplete: 2 of 3 bytes written"), std::string::npos) << msg;
    EXPECT_TRUE(dir.entries().empty());
  }
  {
    SafetensorsWriter w(p, d);
    w.write("a", eight);
    EXPECT_NE(error_of([&] { w.write("a", three); }).find("tensor 'a': is already complete"), std::string::npos);
  }
  {
    SafetensorsWriter w(p, d);
    EXPECT_NE(error_of([&] { w.write("zz", three); }).find("tensor 'zz': was not declared"), std::string::npos);
  }
  EXPECT_TRUE(dir.entries().empty());
}

TEST(SafetensorsWriter, NothingAppearsUntilCommitAndAbandonedWritesVanish) {
  TempDir dir;
  const auto p = dir / "x.safetensors";
  write_bytes(p, std::as_bytes(std::span("old", 3)));
  const std::vector<std::byte> data(8, std::byte{1});
  try {
    SafetensorsWriter w(p, {{"a", FileDType::F32, {2}}});
    w.write("a", std::span(data).first(4));
    // The temporary sits beside the target, named after it.
    const auto names = dir.entries();
    ASSERT_EQ(names.size(), 2u);
    EXPECT_EQ(names[0].rfind(".x.safetensors.tmp-"s + std::to_string(::getpid()) + "-", 0), 0u) << names[0];
    throw std::runtime_error("converter failed mid-stream");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"x.safetensors"});
  EXPECT_EQ(read_bytes(p).size(), 3u);  // the old file is untouched
  {
    SafetensorsWriter w(p, {{"a", FileDType::F32, {2}}});
    w.write("a", data);
    w.finish();  // durable but not visible
    EXPECT_EQ(read_bytes(p).size(), 3u);
    w.commit();
  }
  EXPECT_EQ(SafetensorsReader(p).at("a").nbytes(), 8u);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"x.safetensors"});
}

// Writes fail with EFBIG once the file would pass RLIMIT_FSIZE (with SIGXFSZ ignored), as they fail
// with ENOSPC on a full disk.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &old_);
    rlimit lim = old_;
    lim.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &lim);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    ::signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit old_{};
  sighandler_t old_handler_;
};

TEST(SafetensorsWriter, FullDiskLeavesNothingAndNamesTheError) {
  TempDir dir;
  const auto p = dir / "big.safetensors";
  const std::vector<std::byte> chunk(size_t(1) << 20, std::byte{7});  // bypasses the writer's buffer
  std::string msg;
  {
    const FileSizeLimit limit(256 << 10);
    msg = error_of([&] {
      SafetensorsWriter w(p, {{"w", FileDType::U8, {4 << 20}}});
      for (int i = 0; i < 4; ++i) w.write("w", chunk);
      w.commit();
    });
  }
  EXPECT_NE(msg.find(".big.safetensors.tmp-"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::strerror(EFBIG)), std::string::npos) << msg;
  EXPECT_TRUE(dir.entries().empty());

  // Small writes are buffered, so the failure surfaces at commit's flush; same outcome.
  {
    const FileSizeLimit limit(1000);
    msg = error_of([&] {
      SafetensorsWriter w(p, {{"w", FileDType::U8, {4000}}});
      w.write("w", std::span(chunk).first(4000));
      w.commit();
    });
  }
  EXPECT_NE(msg.find(std::strerror(EFBIG)), std::string::npos) << msg;
  EXPECT_TRUE(dir.entries().empty());
}

TEST(SafetensorsWriter, ADiskTooSmallFailsBeforeAnyData) {
  TempDir dir;
  const auto p = dir / "huge.safetensors";
  std::string msg = "(no exception)";
  try {
    SafetensorsWriter w(p, {{"w", FileDType::U8, {int64_t(1) << 50}}});  // a petabyte
  } catch (const IoError& e) {
    msg = e.what();
  }
  if (msg == "(no exception)") GTEST_SKIP() << "this file system does not implement fallocate";
  EXPECT_NE(msg.find("cannot reserve"), std::string::npos) << msg;
  EXPECT_NE(msg.find(".huge.safetensors.tmp-"), std::string::npos) << msg;
  EXPECT_TRUE(dir.entries().empty());
}

TEST(SafetensorsWriter, OsErrorsNameThePath) {
  TempDir dir;
  const auto p = dir / "no_such_dir" / "x.safetensors";
  const std::string msg = error_of([&] { SafetensorsWriter w(p, {}); });
  EXPECT_NE(msg.find((dir / "no_such_dir").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::strerror(ENOENT)), std::string::npos) << msg;
  EXPECT_THROW(SafetensorsReader(dir / "absent.safetensors"), IoError);
  EXPECT_THROW(SafetensorsReader(dir.path()), FormatError);  // a directory is not a file
}

TEST(AtomicFile, WritesSmallFilesAndReplacesOldOnes) {
  TempDir dir;
  write_file_atomically(dir / "config.json", "{\"a\": 1}\n");
  write_file_atomically(dir / "config.json", "{}\n");
  EXPECT_EQ(read_bytes(dir / "config.json").size(), 3u);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"config.json"});
  {
    AtomicFile f(dir / "other.json");
    f.write("partial");
  }
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"config.json"});
}

// ---------------------------------------------------------------------------------------------------
// Rejection rules: one test each, checking the message names the file, the tensor and the problem.

std::vector<std::byte> file_from(std::string_view header, size_t data_bytes, std::optional<uint64_t> n = {}) {
  std::vector<std::byte> f(8 + header.size() + data_bytes);
  const uint64_t len = n.value_or(header.size());
  std::memcpy(f.data(), &len, 8);
  std::memcpy(f.data() + 8, header.data(), header.size());
  return f;
}

void expect_rejected(const std::vector<std::byte>& file, std::initializer_list<std::string_view> phrases) {
  const std::string msg = error_of([&] {
    try {
      parse_safetensors(file, "bad.safetensors");
    } catch (const FormatError&) {
      throw;
    } catch (const std::exception& e) {
      throw std::runtime_error("not a FormatError: "s + e.what());
    }
  });
  EXPECT_EQ(msg.rfind("bad.safetensors: ", 0), 0u) << msg;
  for (std::string_view p : phrases) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

void expect_rejected(std::string_view header, size_t data_bytes, std::initializer_list<std::string_view> phrases) {
  expect_rejected(file_from(header, data_bytes), phrases);
}

TEST(SafetensorsReject, FileShorterThanTheLengthField) {
  expect_rejected(std::vector<std::byte>(5), {"5 bytes, too short"});
}
TEST(SafetensorsReject, HeaderLengthPastEndOfFile) {
  expect_rejected(file_from("{}", 0, 3), {"header length 3 runs past the end of the 10-byte file"});
}
TEST(SafetensorsReject, AbsurdHeaderLength) {
  expect_rejected(file_from("{}", 0, 100'000'001), {"header length 100000001 exceeds the limit"});
}
TEST(SafetensorsReject, InvalidJson) { expect_rejected(R"({"w": {"dtype": "F32",)", 0, {"invalid JSON"}); }
TEST(SafetensorsReject, InvalidUtf8) { expect_rejected("{\"w\xff\":{}}", 0, {"invalid JSON"}); }
TEST(SafetensorsReject, TrailingGarbageAfterJson) { expect_rejected("{} x", 0, {"invalid JSON"}); }
TEST(SafetensorsReject, HeaderNotAnObject) { expect_rejected("[1, 2]", 0, {"header is a JSON array"}); }
TEST(SafetensorsReject, EntryNotAnObject) { expect_rejected(R"({"w": 3})", 0, {"tensor 'w': entry is a JSON number"}); }
TEST(SafetensorsReject, MissingField) {
  expect_rejected(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", 4, {"tensor 'w': no \"shape\""});
  expect_rejected(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", 4, {"tensor 'w': no \"dtype\""});
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [1]}})", 4, {"tensor 'w': no \"data_offsets\""});
}
TEST(SafetensorsReject, UnknownDtype) {
  expect_rejected(R"({"w": {"dtype": "F31", "shape": [1], "data_offsets": [0, 4]}})", 4,
                  {"tensor 'w': unknown dtype 'F31'"});
  expect_rejected(R"({"w": {"dtype": "f32", "shape": [1], "data_offsets": [0, 4]}})", 4, {"unknown dtype 'f32'"});
  expect_rejected(R"({"w": {"dtype": 7, "shape": [1], "data_offsets": [0, 4]}})", 4, {"dtype is a JSON number"});
}
TEST(SafetensorsReject, NegativeDimension) {
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 4]}})", 4,
                  {"tensor 'w': shape dimension 1 is -1, not a non-negative integer"});
}
TEST(SafetensorsReject, NonIntegerDimension) {
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}})", 4, {"dimension 0 is 1.0"});
  expect_rejected(R"({"w": {"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]}})", 4, {"dimension 0 is \"1\""});
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [9223372036854775808], "data_offsets": [0, 4]}})", 4,
                  {"dimension 0 is 9223372036854775808"});
  expect_rejected(R"({"w": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}})", 4, {"shape is a JSON number"});
}
TEST(SafetensorsReject, ShapeTooLargeToAddress) {
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}})", 4,
                  {"tensor 'w': shape [4294967296, 4294967296] is too large"});
}
TEST(SafetensorsReject, MalformedOffsets) {
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}})", 4,
                  {"tensor 'w': data_offsets is [0,4,8], not two non-negative integers"});
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 4, {"not two non-negative"});
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}})", 4, {"not two non-negative"});
}
TEST(SafetensorsReject, ReversedOffsets) {
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}})", 4,
                  {"tensor 'w': data_offsets [4,0] are reversed"});
}
TEST(SafetensorsReject, OffsetsOutsideTheDataArea) {
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 4,
                  {"tensor 'w': data_offsets [0,8] lie outside the data area of 4 bytes"});
}
TEST(SafetensorsReject, ByteSizeDisagreesWithDtypeAndShape) {
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8,
                  {"tensor 'w': F32 [3] needs 12 bytes but data_offsets [0, 8) hold 8"});
}
TEST(SafetensorsReject, OverlappingRanges) {
  expect_rejected(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                  12, {"tensor 'b': bytes [4, 12) overlap tensor 'a' [0, 8)"});
}
TEST(SafetensorsReject, HoleBetweenTensors) {
  expect_rejected(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                      "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
                  12, {"tensor 'b': starts at byte 8 but the data before it ends at 4 (a hole of 4 bytes)"});
}
TEST(SafetensorsReject, TrailingBytesAfterTheLastTensor) {
  expect_rejected(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 6,
                  {"the tensors cover 4 bytes but the data area holds 6"});
}
TEST(SafetensorsReject, DuplicateTensorName) {
  expect_rejected(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                      "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                  8, {"duplicate key 'a'"});
}
TEST(SafetensorsReject, DuplicateFieldInsideAnEntry) {
  expect_rejected(R"({"a": {"dtype": "F32", "dtype": "I32", "shape": [1], "data_offsets": [0, 4]}})", 4,
                  {"duplicate key 'dtype'"});
}
TEST(SafetensorsReject, MetadataNotAStringToStringMap) {
  expect_rejected(R"({"__metadata__": ["a"]})", 0, {"__metadata__ is a JSON array"});
  expect_rejected(R"({"__metadata__": {"epoch": 3}})", 0,
                  {"__metadata__ must map strings to strings, but 'epoch' is a JSON number"});
  expect_rejected(R"({"__metadata__": {"x": {"y": "z"}}})", 0, {"'x' is a JSON object"});
  expect_rejected(R"({"__metadata__": {"x": "1"}, "__metadata__": {}})", 0, {"duplicate key '__metadata__'"});
}

TEST(SafetensorsReject, ReaderNamesThePathOnDisk) {
  TempDir dir;
  write_bytes(dir / "w.safetensors", file_from(R"({"w": {"dtype": "X", "shape": [], "data_offsets": [0, 0]}})", 0));
  const std::string msg = error_of([&] { SafetensorsReader r(dir / "w.safetensors"); });
  EXPECT_EQ(msg, (dir / "w.safetensors").string() + ": tensor 'w': unknown dtype 'X'");
  write_bytes(dir / "tiny.safetensors", std::vector<std::byte>(3));
  EXPECT_THROW(SafetensorsReader(dir / "tiny.safetensors"), FormatError);
}

// Accepted: what the reference implementation accepts that a naive reader might not.
TEST(SafetensorsAccept, KeyOrderUnknownFieldsAndEmptyTensorsSharingAnOffset) {
  const auto file = file_from(R"({"z": {"dtype": "I8", "shape": [2], "data_offsets": [4, 6], "extra": [1]},
                                  "e2": {"dtype": "F64", "shape": [0, 5], "data_offsets": [4, 4]},
                                  "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                  "e1": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}})",
                              6);
  const SafetensorsLayout l = parse_safetensors(file, "ok");
  std::vector<std::string> names;
  for (const TensorInfo& t : l.tensors) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"a", "e2", "e1", "z"}));  // e2 precedes e1 in the header
  EXPECT_EQ(l.data_start(), 8 + l.header_size);
}

TEST(SafetensorsReject, EveryTruncationOfAValidFile) {
  TempDir dir;
  const auto full = read_bytes(kFixtures / "all_dtypes.safetensors");
  ASSERT_NO_THROW(parse_safetensors(full, "x"));
  // The ranges must reach the end of the file exactly, so every proper prefix is invalid.
  for (size_t cut = 0; cut < full.size(); ++cut)
    EXPECT_THROW(parse_safetensors(std::span(full).first(cut), "x"), FormatError) << cut;
  // The same through the memory map, at a few cut points (header, mid-data, last byte).
  for (size_t cut : {size_t(0), size_t(7), size_t(8), size_t(100), full.size() / 2, full.size() - 1}) {
    write_bytes(dir / "cut.safetensors", std::span(full).first(cut));
    EXPECT_THROW(SafetensorsReader(dir / "cut.safetensors"), FormatError) << cut;
  }
}

TEST(SafetensorsDType, NamesSizesAndEngineTypes) {
  for (int i = 0; i <= static_cast<int>(FileDType::U64); ++i) {
    const auto t = static_cast<FileDType>(i);
    EXPECT_EQ(parse_file_dtype(file_dtype_name(t)), t);
  }
  EXPECT_EQ(file_dtype_size(FileDType::BF16), 2u);
  EXPECT_EQ(file_dtype_size(FileDType::F64), 8u);
  EXPECT_EQ(file_dtype_size(FileDType::F8_E4M3), 1u);
  EXPECT_EQ(to_file_dtype(DType::BF16), FileDType::BF16);
  EXPECT_EQ(to_engine_dtype(FileDType::F32), DType::F32);
  EXPECT_EQ(to_engine_dtype(FileDType::F16), std::nullopt);
  EXPECT_EQ(parse_file_dtype("F8_E4M3FN"), std::nullopt);
}

}  // namespace
}  // namespace hs::checkpoint
