// The GGUF container (src/gguf/gguf_file.h): our writer's files read back with every value type, PyPI gguf's reading
// of them (gguf_reader.py), split files, and every kind of bad file refused with a message
// naming the tensor or key. Each rejection test also proves the file it breaks was accepted before the break, so a
// parser that refused everything would fail here.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "gguf/gguf_file.h"
#include "test_util.h"

namespace hs::gguf {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::byte>;

void fill_pattern(std::span<std::byte> out) {
  for (size_t i = 0; i < out.size(); ++i) out[i] = std::byte(static_cast<uint8_t>(i * 7 + 1));
}

GgufWriter sample_writer() {
  GgufWriter w;
  w.set_string("general.architecture", "test");
  Value v;
  for (uint32_t t : {0u, 1u, 2u, 3u, 4u, 5u, 7u, 10u, 11u}) {
    v = Value{};
    v.type = static_cast<ValueType>(t);
    v.i = t == 7 ? 1 : -3 + static_cast<int64_t>(t) * 5;
    if (t == 0 || t == 2 || t == 4 || t == 10) v.i = 200 + t;  // unsigned
    w.set("k." + std::string(value_type_name(v.type)), v);
  }
  w.set_f32("k.f32", 0.5f);
  v = Value{};
  v.type = ValueType::F64;
  v.f = -1.25;
  w.set("k.f64", v);
  w.set_strings("k.strings", {"a", "", "\xc3\xa9t\xc3\xa9"});
  w.set_i32s("k.ints", {1, -2, 3});
  w.set_f32s("k.floats", {0.25, -8});
  w.add_tensor("a", {64, 3}, ggml_type::F32, fill_pattern);
  w.add_tensor("b", {32, 2}, ggml_type::Q8_0, fill_pattern);
  w.add_tensor("c", {256}, ggml_type::Q4_K, fill_pattern);
  return w;
}

std::string error_of(const Bytes& f) {
  try {
    parse_gguf(f, "test.gguf");
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

TEST(GgufFile, WriterOutputReadsBackWithEveryValueType) {
  const Bytes f = sample_writer().to_bytes();
  const GgufLayout l = parse_gguf(f, "x");
  EXPECT_EQ(l.version, 3u);
  EXPECT_EQ(l.data_start % 32, 0u);
  std::map<std::string, Value> m(l.metadata.begin(), l.metadata.end());
  EXPECT_EQ(m.at("general.architecture").s, "test");
  EXPECT_EQ(m.at("k.u8").i, 200);
  EXPECT_EQ(m.at("k.i8").i, 2);
  EXPECT_EQ(m.at("k.i16").i, 12);
  EXPECT_EQ(m.at("k.u64").i, 210);
  EXPECT_EQ(m.at("k.i64").i, 52);
  EXPECT_EQ(m.at("k.bool").i, 1);
  EXPECT_EQ(m.at("k.f32").f, 0.5);
  EXPECT_EQ(m.at("k.f64").f, -1.25);
  EXPECT_EQ(m.at("k.strings").strings, (std::vector<std::string>{"a", "", "\xc3\xa9t\xc3\xa9"}));
  EXPECT_EQ(m.at("k.ints").ints, (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(m.at("k.floats").floats, (std::vector<double>{0.25, -8}));
  ASSERT_EQ(l.tensors.size(), 3u);
  EXPECT_EQ(l.tensors[0].shape(), (Shape{3, 64}));
  EXPECT_EQ(l.tensors[0].nbytes, 64u * 3 * 4);
  EXPECT_EQ(l.tensors[1].nbytes, 2u * 34);
  EXPECT_EQ(l.tensors[2].nbytes, 144u);
  for (const TensorInfo& t : l.tensors) {
    EXPECT_EQ(t.offset % 32, 0u) << t.name;
    for (uint64_t i = 0; i < t.nbytes; ++i)
      ASSERT_EQ(f[l.data_start + t.offset + i], std::byte(static_cast<uint8_t>(i * 7 + 1))) << t.name;
  }
}

// PyPI gguf (the package llama.cpp's converter writes with) reads our file and finds the same metadata and tensors.
TEST(GgufFile, PyPiGgufReadsOurFile) {
  const fs::path dir = fs::temp_directory_path() / ("gguf_file_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  sample_writer().write(dir / "w.gguf", 64);
  const auto run = test::run_command(test::source_dir() + "/.venv/bin/python -c \"import gguf,sys; r=gguf.GGUFReader('" +
                                     (dir / "w.gguf").string() +
                                     "'); print(r.fields['k.i16'].contents(), r.fields['k.strings'].contents(), "
                                     "r.fields['general.alignment'].contents(), [(t.name, t.tensor_type.name, "
                                     "int(t.n_bytes)) for t in r.tensors])\"");
  fs::remove_all(dir);
  if (run.out.find("No module named") != std::string::npos) GTEST_SKIP() << "PyPI gguf is not installed in .venv";
  ASSERT_EQ(run.rc, 0) << run.out;
  EXPECT_NE(run.out.find("12 ['a', '', 'été'] 64 [('a', 'F32', 768), ('b', 'Q8_0', 68), ('c', 'Q4_K', 144)]"),
            std::string::npos)
      << run.out;
}

TEST(GgufFile, AlignmentFromMetadata) {
  const Bytes f = sample_writer().to_bytes(256);
  const GgufLayout l = parse_gguf(f, "x");
  EXPECT_EQ(l.alignment, 256u);
  EXPECT_EQ(l.data_start % 256, 0u);
  for (const TensorInfo& t : l.tensors) EXPECT_EQ(t.offset % 256, 0u);
}

// Offsets of the fields the rejection tests corrupt, found by parsing the good file's header again.
struct Fields {
  size_t tensor_type_at[3];
  size_t tensor_offset_at[3];
  size_t data_start;
};

Fields locate(const Bytes& f) {
  const GgufLayout l = parse_gguf(f, "x");
  Fields out{};
  // Each tensor info ends with type (u32) and offset (u64); find them by name.
  for (size_t k = 0; k < l.tensors.size(); ++k) {
    const std::string& n = l.tensors[k].name;
    for (size_t p = 0; p + 8 + n.size() < f.size(); ++p) {
      uint64_t len;
      std::memcpy(&len, f.data() + p, 8);
      if (len == n.size() && std::memcmp(f.data() + p + 8, n.data(), n.size()) == 0) {
        size_t q = p + 8 + n.size();
        uint32_t dims;
        std::memcpy(&dims, f.data() + q, 4);
        q += 4 + 8 * dims;
        out.tensor_type_at[k] = q;
        out.tensor_offset_at[k] = q + 4;
      }
    }
  }
  out.data_start = l.data_start;
  return out;
}

template <typename T> void poke(Bytes& f, size_t at, T v) { std::memcpy(f.data() + at, &v, sizeof v); }

TEST(GgufReject, TruncatedFileNamesTheTensor) {
  const Bytes good = sample_writer().to_bytes();
  ASSERT_EQ(error_of(good), "");
  Bytes f(good.begin(), good.end() - 10);
  const std::string e = error_of(f);
  EXPECT_NE(e.find("tensor 'c'"), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  // Every shorter prefix is refused too, never read past its end (the sanitizer pass would see it).
  for (size_t n = 0; n < good.size(); n += 7) EXPECT_NE(error_of(Bytes(good.begin(), good.begin() + n)), "") << n;
}

TEST(GgufReject, UnknownTensorTypeNamesTheTensor) {
  Bytes f = sample_writer().to_bytes();
  ASSERT_EQ(error_of(f), "");
  poke<uint32_t>(f, locate(f).tensor_type_at[1], 99);
  const std::string e = error_of(f);
  EXPECT_NE(e.find("tensor 'b' has unknown ggml type 99"), std::string::npos) << e;
}

TEST(GgufReject, MisalignedOffsetNamesTheTensor) {
  Bytes f = sample_writer().to_bytes();
  const Fields at = locate(f);
  const GgufLayout l = parse_gguf(f, "x");
  poke<uint64_t>(f, at.tensor_offset_at[2], l.tensors[2].offset + 4);
  const std::string e = error_of(f);
  EXPECT_NE(e.find("tensor 'c' starts at data offset"), std::string::npos) << e;
  EXPECT_NE(e.find("not a multiple of the alignment 32"), std::string::npos) << e;
}

TEST(GgufReject, OverlappingOffsetsNameBothTensors) {
  Bytes f = sample_writer().to_bytes();
  const Fields at = locate(f);
  poke<uint64_t>(f, at.tensor_offset_at[1], 0);  // b onto a
  const std::string e = error_of(f);
  EXPECT_NE(e.find("overlaps tensor"), std::string::npos) << e;
  EXPECT_NE(e.find("'a'"), std::string::npos) << e;
  EXPECT_NE(e.find("'b'"), std::string::npos) << e;
}

TEST(GgufReject, OffsetPastTheEndNamesTheTensor) {
  Bytes f = sample_writer().to_bytes();
  poke<uint64_t>(f, locate(f).tensor_offset_at[0], uint64_t{1} << 40);
  const std::string e = error_of(f);
  EXPECT_NE(e.find("tensor 'a'"), std::string::npos) << e;
  EXPECT_NE(e.find("extends past the end"), std::string::npos) << e;
}

TEST(GgufReject, RowNotAWholeNumberOfBlocks) {
  GgufWriter w;
  EXPECT_THROW(w.add_tensor("q", {33}, ggml_type::Q8_0, fill_pattern), FormatError);
  Bytes f = sample_writer().to_bytes();
  poke<uint32_t>(f, locate(f).tensor_type_at[0], ggml_type::Q4_K);  // a: rows of 64, Q4_K blocks of 256
  const std::string e = error_of(f);
  EXPECT_NE(e.find("tensor 'a'"), std::string::npos) << e;
  EXPECT_NE(e.find("not a whole number of Q4_K blocks"), std::string::npos) << e;
}

TEST(GgufReject, BadMagicVersionAndAlignment) {
  Bytes f = sample_writer().to_bytes();
  Bytes g = f;
  g[0] = std::byte{'X'};
  EXPECT_NE(error_of(g).find("not a GGUF file"), std::string::npos);
  g = f;
  poke<uint32_t>(g, 4, 1);
  EXPECT_NE(error_of(g).find("version 1"), std::string::npos);
  GgufWriter w = sample_writer();
  w.set_u32("general.alignment", 48);
  EXPECT_NE(error_of(w.to_bytes()).find("general.alignment must be a power of two"), std::string::npos);
}

TEST(GgufReject, HugeCountsAreRefusedBeforeAllocating) {
  Bytes f = sample_writer().to_bytes();
  Bytes g = f;
  poke<uint64_t>(g, 8, uint64_t{1} << 60);  // tensor count
  EXPECT_NE(error_of(g).find("tensor count"), std::string::npos);
  g = f;
  poke<uint64_t>(g, 16, uint64_t{1} << 60);  // metadata count
  EXPECT_NE(error_of(g).find("metadata count"), std::string::npos);
}

TEST(GgufReject, DuplicateTensorName) {
  GgufWriter w;
  w.add_tensor("x", {4}, ggml_type::F32, fill_pattern);
  w.add_tensor("x", {4}, ggml_type::F32, fill_pattern);
  EXPECT_NE(error_of(w.to_bytes()).find("duplicate tensor name 'x'"), std::string::npos);
}

TEST(GgufFile, SplitFilesAreOneModel) {
  const fs::path dir = fs::temp_directory_path() / ("gguf_split_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (int k = 1; k <= 3; ++k) {
    GgufWriter w;
    if (k == 1) w.set_string("general.architecture", "test");
    w.set("split.no", Value{ValueType::U16, ValueType::U32, k - 1, 0, {}, {}, {}, {}});
    w.set("split.count", Value{ValueType::U16, ValueType::U32, 3, 0, {}, {}, {}, {}});
    w.add_tensor("t" + std::to_string(k), {32}, ggml_type::F32, fill_pattern);
    w.write(dir / split_file_name("m", k, 3));
  }
  {
    const GgufReader r(dir / "m-00002-of-00003.gguf");
    EXPECT_EQ(r.files().size(), 3u);
    EXPECT_EQ(r.get_string("general.architecture"), "test");
    ASSERT_EQ(r.tensors().size(), 3u);
    EXPECT_EQ(r.tensor("t3").file, 2u);
    EXPECT_EQ(r.bytes(r.tensor("t3"))[5], std::byte{36});
  }
  fs::remove(dir / "m-00003-of-00003.gguf");
  const std::string e = test::error_of([&] { GgufReader r(dir / "m-00001-of-00003.gguf"); });
  EXPECT_NE(e.find("part 3 of 3"), std::string::npos) << e;
  EXPECT_NE(e.find("is missing"), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(GgufFile, SplitNames) {
  const auto s = parse_split_name("Qwen3.5-35B-A3B-Q4_K_M-00002-of-00004.gguf");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->prefix, "Qwen3.5-35B-A3B-Q4_K_M");
  EXPECT_EQ(s->index, 2);
  EXPECT_EQ(s->count, 4);
  EXPECT_FALSE(parse_split_name("model.gguf"));
  EXPECT_FALSE(parse_split_name("m-00005-of-00004.gguf"));
}

// Random corruption of a good file: every mutant parses or throws FormatError, nothing else (the sanitizer pass
// turns an out-of-bounds read into a failure). scripts/fuzz.sh gguf runs the coverage-guided version.
TEST(GgufFuzz, RandomMutantsParseOrThrowFormatError) {
  const Bytes good = sample_writer().to_bytes();
  std::mt19937 rng(7);
  int accepted = 0;
  for (int it = 0; it < 3000; ++it) {
    Bytes f = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) f[rng() % f.size()] = std::byte(static_cast<uint8_t>(rng()));
    try {
      const GgufLayout l = parse_gguf(f, "fuzz");
      ++accepted;
      for (const TensorInfo& t : l.tensors) ASSERT_LE(l.data_start + t.offset + t.nbytes, f.size());
    } catch (const FormatError&) {
    }
  }
  EXPECT_GT(accepted, 0);  // some mutants only touch tensor bytes
}

}  // namespace
}  // namespace hs::gguf
