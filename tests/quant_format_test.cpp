// The GGUF block formats (src/kernels/quant.h) against independent peers: dequantization bit for bit against PyPI
// `gguf` (tests/quant_reference.py runs it now) on random blocks and edge scales (+-0, subnormal, largest, infinite
// and NaN fp16 scales); the quantizers it implements (Q8_0, Q4_0, F16, BF16) byte for byte; the K-quant quantizers
// (which the package lacks) by their error bounds here and byte for byte against libggml in
// tests/quant_ggml_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/quant.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace hs::kernels;

namespace {

const fs::path kSource = hs::test::source_dir();

struct Case {
  uint32_t kind = 0;
  GgmlType type{};
  uint64_t n = 0;
  std::string label;
  std::vector<uint8_t> blocks;
  std::vector<float> floats;  // kind 0: the expected output; kind 1: the input
};

template <typename V> V read_pod(std::istream& in) {
  V v{};
  in.read(reinterpret_cast<char*>(&v), sizeof(V));
  return v;
}

// Runs the Python peer once per test program and reads its cases.
const std::vector<Case>& reference_cases() {
  static const std::vector<Case> cases = [] {
    std::vector<Case> out;
    const fs::path python = kSource / ".venv" / "bin" / "python";
    if (!fs::exists(python)) {
      ADD_FAILURE() << python << " is missing (run scripts/setup.sh)";
      return out;
    }
    hs::test::TempDir dir;
    const fs::path file = dir / "quant_reference.bin";
    std::string cmd = "'";  // appended piece by piece: GCC 12 warns falsely on "'" + std::string
    cmd += python.string() + "' '" + (kSource / "tests" / "quant_reference.py").string() + "' '" + file.string() + "'";
    if (std::system(cmd.c_str()) != 0) {
      ADD_FAILURE() << "the Python peer failed: " << cmd << " (is gguf installed in .venv? scripts/requirements-test.txt)";
      return out;
    }
    std::ifstream in(file, std::ios::binary);
    char magic[4] = {};
    in.read(magic, 4);
    if (std::string(magic, 4) != "HSQR") {
      ADD_FAILURE() << file << " is not a reference";
      return out;
    }
    const uint32_t count = read_pod<uint32_t>(in);
    for (uint32_t i = 0; i < count && in; ++i) {
      Case c;
      c.kind = read_pod<uint32_t>(in);
      c.type = static_cast<GgmlType>(read_pod<uint32_t>(in));
      c.n = read_pod<uint64_t>(in);
      c.label.resize(read_pod<uint32_t>(in));
      in.read(c.label.data(), static_cast<std::streamsize>(c.label.size()));
      c.floats.resize(c.n);
      if (c.kind == 0) {
        c.blocks.resize(read_pod<uint64_t>(in));
        in.read(reinterpret_cast<char*>(c.blocks.data()), static_cast<std::streamsize>(c.blocks.size()));
        in.read(reinterpret_cast<char*>(c.floats.data()), static_cast<std::streamsize>(c.n * 4));
      } else {
        in.read(reinterpret_cast<char*>(c.floats.data()), static_cast<std::streamsize>(c.n * 4));
        c.blocks.resize(read_pod<uint64_t>(in));
        in.read(reinterpret_cast<char*>(c.blocks.data()), static_cast<std::streamsize>(c.blocks.size()));
      }
      out.push_back(std::move(c));
    }
    if (!in || out.size() != count) {
      ADD_FAILURE() << file << " is truncated";
      out.clear();
    }
    return out;
  }();
  return cases;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Equal bits; a NaN matches any NaN (numpy and this code both use the hardware's products, but NumPy does not
// promise which operand's payload a NaN result carries).
bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits(a) == bits(b); }

std::vector<float> random_row(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = dist(rng);
  return x;
}

}  // namespace

TEST(QuantFormat, TypeTableIsGgmls) {
  // ggml-common.h's block sizes and ggml.h's ids (the same numbers PyPI gguf's GGML_QUANT_SIZES holds).
  struct Row {
    uint32_t id;
    const char* name;
    int64_t elems, bytes;
  } rows[] = {{0, "F32", 1, 4},      {1, "F16", 1, 2},       {2, "Q4_0", 32, 18},    {8, "Q8_0", 32, 34},
              {12, "Q4_K", 256, 144}, {13, "Q5_K", 256, 176}, {14, "Q6_K", 256, 210}, {15, "Q8_K", 256, 292},
              {30, "BF16", 1, 2}};
  for (const Row& r : rows) {
    const GgmlTypeInfo* t = ggml_type_info(r.id);
    ASSERT_NE(t, nullptr) << r.name;
    EXPECT_STREQ(t->name, r.name);
    EXPECT_EQ(static_cast<uint32_t>(t->type), r.id);
    EXPECT_EQ(t->block_elems, r.elems) << r.name;
    EXPECT_EQ(t->block_bytes, r.bytes) << r.name;
    EXPECT_EQ(ggml_type_name(r.id), r.name);
  }
  EXPECT_EQ(ggml_type_info(3), nullptr);  // Q4_1: named, not read
  EXPECT_EQ(ggml_type_name(3), "Q4_1");
  EXPECT_EQ(ggml_type_name(16), "IQ2_XXS");
  EXPECT_EQ(ggml_type_name(39), "MXFP4");
  EXPECT_EQ(ggml_type_name(1000), "type 1000");
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q4_K, 2048), 8 * 144);
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q8_0, 64), 68);
  EXPECT_EQ(ggml_row_bytes(GgmlType::BF16, 7), 14);
  EXPECT_EQ(hs::test::error_of([] { ggml_row_bytes(GgmlType::Q6_K, 300); }),
            "Q6_K stores rows in blocks of 256 elements; a row of 300 is not a whole number of them");
}

TEST(QuantFormat, DequantizeEqualsGgufPackage) {
  const auto& cases = reference_cases();
  int checked = 0;
  for (const Case& c : cases) {
    if (c.kind != 0) continue;
    ++checked;
    std::vector<float> got(c.n);
    dequantize_row(c.type, c.blocks.data(), got.data(), static_cast<int64_t>(c.n));
    int64_t bad = 0;
    for (uint64_t i = 0; i < c.n; ++i)
      if (!same(got[i], c.floats[i]) && ++bad <= 3)
        ADD_FAILURE() << c.label << ": element " << i << " is " << got[i] << " (0x" << std::hex << bits(got[i])
                      << "), gguf says " << c.floats[i] << " (0x" << bits(c.floats[i]) << std::dec << ")";
    EXPECT_EQ(bad, 0) << c.label << " (" << c.n << " elements)";
  }
  EXPECT_EQ(checked, 31);  // every type's random and edge cases
}

// The bf16 overload (the prefill's weight tiles on CPUs with bf16 products) gives each gguf value rounded as
// bf16::from_float rounds it: to nearest even, NaNs quiet (BF16 rows: the stored bits). A lane taking another element's scale, or truncating
// instead of rounding, changes the bits of about half the elements.
TEST(QuantFormat, DequantizeToBf16RoundsTheGgufValues) {
  int checked = 0;
  for (const Case& c : reference_cases()) {
    if (c.kind != 0 || c.type == GgmlType::Q8_K) continue;
    ++checked;
    std::vector<hs::bf16> got(c.n);
    dequantize_row(c.type, c.blocks.data(), got.data(), static_cast<int64_t>(c.n));
    int64_t bad = 0;
    for (uint64_t i = 0; i < c.n; ++i) {
      uint16_t want = hs::bf16(c.floats[i]).bits;
      if (c.type == GgmlType::BF16) std::memcpy(&want, c.blocks.data() + 2 * i, 2);  // copied as stored (NaNs too)
      if (got[i].bits != want && ++bad <= 3)
        ADD_FAILURE() << c.label << ": element " << i << " is 0x" << std::hex << got[i].bits << ", gguf's "
                      << c.floats[i] << " gives 0x" << want << std::dec;
    }
    EXPECT_EQ(bad, 0) << c.label << " (" << c.n << " elements)";
  }
  EXPECT_GE(checked, 25);
}

TEST(QuantFormat, QuantizeEqualsGgufPackage) {
  const auto& cases = reference_cases();
  int checked = 0;
  for (const Case& c : cases) {
    if (c.kind != 1) continue;
    ++checked;
    std::vector<uint8_t> got(c.blocks.size());
    ASSERT_EQ(ggml_row_bytes(c.type, static_cast<int64_t>(c.n)), static_cast<int64_t>(got.size())) << c.label;
    quantize_row(c.type, c.floats.data(), got.data(), static_cast<int64_t>(c.n));
    std::vector<uint8_t> want = c.blocks;
    if (c.type == GgmlType::Q4_0 && c.label.find("negative zeros only") != std::string::npos) {
      // Where the package and ggml part: ggml's signed maximum starts at +0 and stays there, so d = +0 / -8 = -0
      // (0x8000); the package takes the element itself, -0, and writes +0. We write ggml's block (confirmed
      // against libggml in tests/quant_ggml_test.cpp); the quants agree.
      ASSERT_EQ(want[0] | want[1] << 8, 0x0000);
      want[1] = 0x80;
    }
    int64_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != want[i] && ++bad <= 3)
        ADD_FAILURE() << c.label << ": byte " << i << " (block " << i / ggml_type_info(c.type).block_bytes
                      << ") is " << int(got[i]) << ", gguf writes " << int(want[i]);
    EXPECT_EQ(bad, 0) << c.label;
  }
  EXPECT_EQ(checked, 4 * 6);
}

// Bounds that ggml's quantizers meet on Gaussian rows (measured here, relative RMS at scales 1e-3 / 1 / 100: Q8_0
// 0.0054, Q4_0 0.086, Q4_K 0.071, Q5_K 0.037, Q6_K 0.018-0.020, Q8_K 0.0069; the bounds leave ~20 %): a wrong bit in packing or scale handling
// moves whole sub-blocks and breaks them by far.
TEST(QuantFormat, RoundTripErrorIsTheFormatsOwn) {
  struct Bound {
    GgmlType type;
    double rel_rms;
  } bounds[] = {{GgmlType::Q8_0, 0.0065}, {GgmlType::Q4_0, 0.10}, {GgmlType::Q4_K, 0.085},
                {GgmlType::Q5_K, 0.044}, {GgmlType::Q6_K, 0.024}, {GgmlType::Q8_K, 0.0083}};
  const int64_t n = 256 * 64;
  for (const Bound& b : bounds)
    for (float scale : {1e-3f, 1.f, 100.f}) {
      const std::vector<float> x = random_row(n, 7, scale);
      std::vector<uint8_t> q(static_cast<size_t>(ggml_row_bytes(b.type, n)));
      std::vector<float> y(static_cast<size_t>(n));
      quantize_row(b.type, x.data(), q.data(), n);
      dequantize_row(b.type, q.data(), y.data(), n);
      double err = 0, ref = 0;
      for (int64_t i = 0; i < n; ++i) {
        err += (double(y[i]) - x[i]) * (double(y[i]) - x[i]);
        ref += double(x[i]) * x[i];
      }
      const double rel = std::sqrt(err / ref);
      EXPECT_LT(rel, b.rel_rms) << ggml_type_info(b.type).name << " at scale " << scale;
      std::cout << ggml_type_info(b.type).name << " scale " << scale << ": relative RMS " << rel << "\n";
    }
}

TEST(QuantFormat, KQuantZeroRowsAndQ8KSums) {
  // All-zero rows give all-zero blocks' values, and Q8_K's bsums are the sums of its 16-element groups.
  for (GgmlType t : {GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q8_K, GgmlType::Q8_0, GgmlType::Q4_0}) {
    std::vector<float> x(512, 0.f), y(512, 1.f);
    std::vector<uint8_t> q(static_cast<size_t>(ggml_row_bytes(t, 512)));
    quantize_row(t, x.data(), q.data(), 512);
    dequantize_row(t, q.data(), y.data(), 512);
    for (float v : y) ASSERT_EQ(v, 0.f) << ggml_type_info(t).name;
  }
  const std::vector<float> x = random_row(512, 3, 1.f);
  BlockQ8_K b[2];
  quantize_row(GgmlType::Q8_K, x.data(), b, 512);
  for (const BlockQ8_K& blk : b)
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int l = 0; l < 16; ++l) s += blk.qs[16 * g + l];
      EXPECT_EQ(blk.bsums[g], s);
    }
}
