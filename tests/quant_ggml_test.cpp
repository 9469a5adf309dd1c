// The quantizers (kernels/quant.h) against libggml's own: tests/fixtures/quant/ggml_quantizers.bin holds float rows
// and the blocks llama.cpp's quantize_row_*_ref wrote for them (tests/quant_ggml_fixtures.py, run on the
// libggml-base.so of llama-cpp-python 0.3.36's llama.cpp), for the types PyPI gguf cannot quantize (Q4_K, Q5_K, Q6_K,
// Q8_K) and for Q4_0's all-negative-zero block, where that package and ggml part (QuantFormat.QuantizeEqualsGgufPackage).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/quant.h"
#include "test_util.h"

using namespace hs::kernels;

namespace {

template <typename V> V read_pod(std::istream& in) {
  V v{};
  in.read(reinterpret_cast<char*>(&v), sizeof(V));
  return v;
}

}  // namespace

TEST(QuantGgml, QuantizersWriteGgmlsBlocks) {
  const std::filesystem::path file =
      std::filesystem::path(hs::test::source_dir()) / "tests" / "fixtures" / "quant" / "ggml_quantizers.bin";
  std::ifstream in(file, std::ios::binary);
  ASSERT_TRUE(in) << file << " is missing (tests/quant_ggml_fixtures.py writes it)";
  char magic[4] = {};
  in.read(magic, 4);
  ASSERT_EQ(std::string(magic, 4), "HSQG");
  const uint32_t count = read_pod<uint32_t>(in);
  int per_type[64] = {};
  for (uint32_t c = 0; c < count; ++c) {
    const uint32_t id = read_pod<uint32_t>(in);
    const uint64_t n = read_pod<uint64_t>(in);
    std::string label(read_pod<uint32_t>(in), '\0');
    in.read(label.data(), static_cast<std::streamsize>(label.size()));
    std::vector<float> x(n);
    in.read(reinterpret_cast<char*>(x.data()), static_cast<std::streamsize>(4 * n));
    std::vector<uint8_t> want(read_pod<uint64_t>(in));
    in.read(reinterpret_cast<char*>(want.data()), static_cast<std::streamsize>(want.size()));
    ASSERT_TRUE(in) << file << " is truncated";
    const GgmlTypeInfo* t = ggml_type_info(id);
    ASSERT_NE(t, nullptr) << label;
    ++per_type[id];
    std::vector<uint8_t> got(static_cast<size_t>(ggml_row_bytes(t->type, static_cast<int64_t>(n))));
    ASSERT_EQ(got.size(), want.size()) << label;
    quantize_row(t->type, x.data(), got.data(), static_cast<int64_t>(n));
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != want[i] && ++bad <= 3)
        ADD_FAILURE() << label << ": byte " << i % t->block_bytes << " of block " << i / t->block_bytes << " is "
                      << int(got[i]) << ", ggml wrote " << int(want[i]);
    EXPECT_EQ(bad, 0) << label;
  }
  for (int id : {12, 13, 14, 15}) EXPECT_EQ(per_type[id], 6) << ggml_type_name(id);
  EXPECT_EQ(per_type[2], 1);
}
