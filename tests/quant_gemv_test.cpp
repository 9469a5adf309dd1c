// The quantized decode products (kernels/quant_gemv.h): every path (Scalar, AVX2, AVX-512; VNNI or not) gives
// the Scalar path's bits, which are within the fp32 bound of the double reference (dequantized weights times the
// quantized activations); the same bits at any thread count and any split of the rows; row ranges read and write
// only their rows; the activations' quantization is ggml's (Q8_K) or within half a step (32-blocks).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/quant.h"
#include "kernels/paths.h"
#include "kernels/quant_gemv.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

constexpr GgmlType kTypes[] = {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K};

struct Path {
  cpu::Level isa;
  bool vnni;
};
std::vector<Path> paths() {
  std::vector<Path> v{{cpu::Level::Scalar, false}, {cpu::Level::Avx2, false}};
  if (cpu::detected().avx_vnni) v.push_back({cpu::Level::Avx2, true});
  if (cpu::allows(cpu::Level::Avx512)) {
    v.push_back({cpu::Level::Avx512, false});
    if (cpu::detected().avx512_vnni || cpu::detected().avx_vnni) v.push_back({cpu::Level::Avx512, true});
  }
  return v;
}
std::string path_name(const Path& p) { return std::string(cpu::level_name(p.isa)) + (p.vnni ? "+vnni" : ""); }

struct VnniScope {
  explicit VnniScope(bool on) { set_quant_gemv_vnni(on); }
  ~VnniScope() { set_quant_gemv_vnni(true); }
};

// N rows of K weights of type t. Half the rows are ggml's quantization of Gaussian rows (what files hold); the other
// half random bytes with the fp16 scale fields set to small finite values, so every level, 6-bit scale and min, and
// Q6_K's signed scales down to -128 occur (Q8_0's levels kept in [-127, 127], the domain the header states).
std::vector<uint8_t> make_weights(GgmlType t, int64_t N, int64_t K, uint32_t seed) {
  const int64_t rb = ggml_row_bytes(t, K);
  std::vector<uint8_t> W(static_cast<size_t>(N * rb));
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.f, 0.02f);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<float> row(static_cast<size_t>(K));
  const GgmlTypeInfo& info = ggml_type_info(t);
  for (int64_t n = 0; n < N; ++n) {
    uint8_t* dst = W.data() + n * rb;
    if (n % 2 == 0) {
      for (auto& v : row) v = g(rng);
      quantize_row(t, row.data(), dst, K);
      continue;
    }
    for (int64_t i = 0; i < rb; ++i) dst[i] = static_cast<uint8_t>(byte(rng));
    for (int64_t b = 0; b < rb / info.block_bytes; ++b) {
      uint8_t* blk = dst + b * info.block_bytes;
      auto set_scale = [&](int offset) {
        const uint16_t h = fp32_to_fp16(g(rng) * 0.05f);
        std::memcpy(blk + offset, &h, 2);
      };
      switch (t) {
        case GgmlType::Q8_0:
          set_scale(0);
          for (int j = 0; j < 32; ++j)
            if (blk[2 + j] == 0x80) blk[2 + j] = 0x81;
          break;
        case GgmlType::Q4_0: set_scale(0); break;
        case GgmlType::Q4_K:
        case GgmlType::Q5_K: set_scale(0); set_scale(2); break;
        case GgmlType::Q6_K: set_scale(208); break;
        default: break;
      }
    }
  }
  return W;
}

std::vector<float> run(GgmlType t, const std::vector<float>& x, const std::vector<uint8_t>& W, int64_t M, int64_t N,
                       int64_t K, const Path& p) {
  VnniScope vnni(p.vnni);
  std::vector<float> y(static_cast<size_t>(M * N), -1.f);
  quant_gemv(t, x.data(), W.data(), y.data(), M, N, K, 0, 0, p.isa);
  return y;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b, std::string& where) {
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], 4) != 0) {
      where = "element " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
      return false;
    }
  return true;
}

TEST(QuantGemv, EveryPathGivesTheScalarBitsWithinTheBound) {
  for (GgmlType t : kTypes)
    for (int64_t K : {256, 768})
      for (int64_t M : {1, 2, 3, 8, 9, 16}) {
        const int64_t N = 37;  // odd: AVX-512's row pairs end in a half pair
        const std::vector<uint8_t> W = make_weights(t, N, K, 11);
        const std::vector<float> x = test::randn(static_cast<size_t>(M * K), 5);
        const std::vector<float> scalar = run(t, x, W, M, N, K, {cpu::Level::Scalar, false});
        // The bound of the header: (nb + 8) 2^-24 times the terms' magnitude, against the double reference.
        QuantizedRows xq;
        quantize_rows(t, x.data(), M, K, 0, xq);
        std::vector<double> ref, mag;
        reference::quant_gemv(xq, W.data(), N, ref, mag);
        const double nb = double(K) / ggml_type_info(t).block_elems;
        for (int64_t i = 0; i < M * N; ++i)
          ASSERT_LE(std::fabs(scalar[i] - ref[i]), (nb + 8) * std::ldexp(1.0, -24) * mag[i] + 1e-30)
              << ggml_type_info(t).name << " K " << K << " M " << M << " element " << i << ": " << scalar[i]
              << " vs " << ref[i];
        for (const Path& p : paths()) {
          std::string where;
          EXPECT_TRUE(same_bits(run(t, x, W, M, N, K, p), scalar, where))
              << ggml_type_info(t).name << " K " << K << " M " << M << " " << path_name(p) << " " << where;
        }
      }
}

TEST(QuantGemv, SameBitsAtAnyThreadCountAndSplit) {
  const int64_t M = 3, N = 2101, K = 512;  // >= 512 KiB of weights for every type: the threaded path
  for (GgmlType t : kTypes) {
    const std::vector<uint8_t> W = make_weights(t, N, K, 3);
    const std::vector<float> x = test::randn(static_cast<size_t>(M * K), 9);
    const Path widest = paths().back();
    const std::vector<float> one = test::with_threads(1, [&] { return run(t, x, W, M, N, K, widest); });
    std::string where;
    for (int threads : {2, 3}) {
      const std::vector<float> many = test::with_threads(threads, [&] { return run(t, x, W, M, N, K, widest); });
      EXPECT_TRUE(same_bits(many, one, where)) << ggml_type_info(t).name << " " << threads << " threads " << where;
    }
    // Rows in pieces of odd sizes on the calling thread, and row ranges with gaps (the rest untouched).
    QuantizedRows xq;
    quantize_rows(t, x.data(), M, K, 0, xq);
    VnniScope vnni(widest.vnni);
    std::vector<float> pieces(static_cast<size_t>(M * N), -1.f);
    for (int64_t n0 = 0; n0 < N; n0 += 37) quant_gemv_rows(xq, W.data(), pieces.data(), N, n0, std::min(N, n0 + 37), widest.isa);
    // and against the plain path on one thread (the threaded path must not only agree with itself)
    const std::vector<float> scalar = test::with_threads(1, [&] { return run(t, x, W, M, N, K, {cpu::Level::Scalar, false}); });
    EXPECT_TRUE(same_bits(one, scalar, where)) << ggml_type_info(t).name << " " << where;
    EXPECT_TRUE(same_bits(pieces, one, where)) << ggml_type_info(t).name << " pieces " << where;
    const std::vector<std::pair<int64_t, int64_t>> ranges = {{5, 40}, {100, 101}, {200, 290}, {300, 2101}};  // >= 512 KiB: threaded
    std::vector<float> ranged(static_cast<size_t>(M * N), -7.f);
    test::with_threads(2, [&] { quant_gemv_ranges(xq, W.data(), ranged.data(), N, ranges, widest.isa); return 0; });
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        bool in = false;
        for (const auto& [a, b] : ranges) in = in || (n >= a && n < b);
        const float want = in ? one[m * N + n] : -7.f;
        ASSERT_EQ(std::memcmp(&ranged[m * N + n], &want, 4), 0) << ggml_type_info(t).name << " m " << m << " n " << n;
      }
  }
}

TEST(QuantGemv, ActivationsAreQuantizedAsGgmlDoes) {
  const int64_t M = 2, K = 512;
  const std::vector<float> x = test::randn(static_cast<size_t>(M * K), 21);
  for (GgmlType t : {GgmlType::Q4_K, GgmlType::Q6_K}) {  // Q8_K: ggml's quantize_row_q8_K_ref, bits and all
    QuantizedRows xq;
    quantize_rows(t, x.data(), M, K, 0, xq);
    std::vector<uint8_t> want(static_cast<size_t>(ggml_row_bytes(GgmlType::Q8_K, K)));
    for (int64_t m = 0; m < M; ++m) {
      quantize_row(GgmlType::Q8_K, x.data() + m * K, want.data(), K);
      EXPECT_EQ(std::memcmp(xq.row(m), want.data(), want.size()), 0);
    }
  }
  // 32-blocks: every value within half a step d/2 of x, d = max |x| / 127, and the sums the sums of the int8.
  QuantizedRows xq;
  quantize_rows(GgmlType::Q8_0, x.data(), M, K, 0, xq);
  std::vector<float> back(static_cast<size_t>(K));
  for (int64_t m = 0; m < M; ++m) {
    dequantize_quantized_row(xq, m, back.data());
    const auto* a = reinterpret_cast<const QuantAct32*>(xq.row(m));
    for (int64_t b = 0; b < K / 32; ++b) {
      float amax = 0;
      int32_t sum = 0;
      for (int j = 0; j < 32; ++j) {
        amax = std::max(amax, std::fabs(x[m * K + b * 32 + j]));
        sum += a[b].qs[j];
      }
      EXPECT_EQ(a[b].sum, sum);
      EXPECT_EQ(a[b].d, amax / 127);
      for (int j = 0; j < 32; ++j)
        EXPECT_LE(std::fabs(back[b * 32 + j] - x[m * K + b * 32 + j]), a[b].d * 0.5f * (1 + 1e-6f));
    }
  }
}

// End to end against fp32 activations and the dequantized weights: the error is the activations' quantization
// (int8 per 32 or 256 elements: relative RMS ~ 1/(127 sqrt(12)) times the block's max / RMS ratio, ~0.7 % for
// Gaussian rows; bounded at 2 %).
TEST(QuantGemv, CloseToTheFp32Product) {
  const int64_t M = 4, N = 64, K = 1024;
  for (GgmlType t : kTypes) {
    const std::vector<uint8_t> W = make_weights(t, N, K, 17);
    const std::vector<float> x = test::randn(static_cast<size_t>(M * K), 19);
    std::vector<float> y(static_cast<size_t>(M * N)), w(static_cast<size_t>(K));
    quant_gemv(t, x.data(), W.data(), y.data(), M, N, K);
    double err = 0, ref2 = 0;
    for (int64_t n = 0; n < N; ++n) {
      dequantize_row(t, W.data() + n * ggml_row_bytes(t, K), w.data(), K);
      for (int64_t m = 0; m < M; ++m) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += double(w[k]) * x[m * K + k];
        err += (y[m * N + n] - s) * (y[m * N + n] - s);
        ref2 += s * s;
      }
    }
    EXPECT_LT(std::sqrt(err / ref2), 0.02) << ggml_type_info(t).name;
  }
  // bf16 activations are widened exactly first: the same bits as the same values in fp32.
  const std::vector<float> x = test::cast<float>(test::cast<bf16>(test::randn(K, 23)));
  const std::vector<bf16> xb = test::cast<bf16>(x);
  const std::vector<uint8_t> W = make_weights(GgmlType::Q4_K, N, K, 29);
  std::vector<float> a(N), b(N);
  quant_gemv(GgmlType::Q4_K, x.data(), W.data(), a.data(), 1, N, K);
  quant_gemv(GgmlType::Q4_K, xb.data(), W.data(), b.data(), 1, N, K);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), 4 * N), 0);
}

// Prefill: the int8 way gives every row the bits quant_gemv gives it; the dequantized ways (oneDNN on dequantized
// tiles) are within fp32 summation (fp32 x) or bf16's rounding of x and the weights (bf16 x, or fp32 x rounded by
// DequantizedBf16: 2 * 2^-9 per product, bounded relative to sum |w x|) of the product of the dequantized weights.
TEST(QuantGemv, PrefillProducts) {
  const int64_t M = 40, N = 300, K = 512;
  for (GgmlType t : kTypes) {
    const std::vector<uint8_t> W = make_weights(t, N, K, 31);
    const std::vector<float> x = test::randn(static_cast<size_t>(M * K), 37);
    std::vector<float> int8(static_cast<size_t>(M * N)), rows(static_cast<size_t>(M * N));
    quant_matmul(t, x.data(), W.data(), int8.data(), M, N, K, 0, 0, QuantMatmul::Int8);
    for (int64_t m0 = 0; m0 < M; m0 += kGemvMaxRows) {
      const int64_t mr = std::min(kGemvMaxRows, M - m0);
      quant_gemv(t, x.data() + m0 * K, W.data(), rows.data() + m0 * N, mr, N, K);
    }
    std::string where;
    EXPECT_TRUE(same_bits(int8, rows, where)) << ggml_type_info(t).name << " " << where;
    std::vector<float> w(static_cast<size_t>(N * K));
    for (int64_t n = 0; n < N; ++n) dequantize_row(t, W.data() + n * ggml_row_bytes(t, K), w.data() + n * K, K);
    // way 0: fp32 x, dequantized to fp32; 1: bf16 x, dequantized to bf16; 2: fp32 x, DequantizedBf16 (x rounded to
    // bf16 inside, in a workspace of exactly the size quant_matmul_workspace_bytes gives, tiles in bf16).
    for (int way = 0; way < 3; ++way) {
      std::vector<float> y(static_cast<size_t>(M * N));
      const std::vector<bf16> xb = test::cast<bf16>(x);
      if (way == 1) {
        quant_matmul(t, xb.data(), W.data(), y.data(), M, N, K, 0, 0, QuantMatmul::Dequantized);
      } else if (way == 0) {
        quant_matmul(t, x.data(), W.data(), y.data(), M, N, K, 0, 0, QuantMatmul::Dequantized);
      } else {
        const int64_t bytes = quant_matmul_workspace_bytes<float>(t, M, N, K, QuantMatmul::DequantizedBf16);
        EXPECT_EQ(bytes, (M * K * 2 + 63) / 64 * 64 + std::min<int64_t>(N, 256) * K * 2);
        std::vector<uint8_t> ws(static_cast<size_t>(bytes + 64));
        void* p = ws.data() + (64 - reinterpret_cast<uintptr_t>(ws.data()) % 64) % 64;
        quant_matmul(t, x.data(), W.data(), y.data(), M, N, K, 0, 0, QuantMatmul::DequantizedBf16, p, bytes);
      }
      const char* name = way == 0 ? " fp32" : way == 1 ? " bf16 x" : " DequantizedBf16";
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double s = 0, a = 0;
          for (int64_t k = 0; k < K; ++k) {
            const double xk = way == 1 ? double(to_f32(xb[m * K + k])) : double(x[m * K + k]);
            s += double(w[n * K + k]) * xk;
            a += std::fabs(double(w[n * K + k]) * xk);
          }
          // DequantizedBf16: each product of w (1 + e1) and x (1 + e2), |e| <= 2^-9, is off by (2^-8 + 2^-18) |w x|;
          // then the fp32 sum's K 2^-24.
          const double tol = way == 1   ? std::ldexp(1.0, -8) * a
                             : way == 0 ? K * std::ldexp(1.0, -24) * a
                                        : (std::ldexp(1.0, -8) + std::ldexp(1.0, -18) + K * std::ldexp(1.0, -24)) * a;
          ASSERT_LE(std::fabs(y[m * N + n] - s), tol) << ggml_type_info(t).name << name << " m " << m << " n " << n;
        }
    }
  }
}

TEST(QuantGemv, ChoosesWithinTheLevelAndSaysSo) {
  EXPECT_EQ(quant_gemv_level(), cpu::allows(cpu::Level::Avx512) ? cpu::Level::Avx512 : cpu::Level::Avx2);
  const std::string report = kernel_paths_report();
  EXPECT_NE(report.find(std::string("quantized gemv (decode, GGUF blocks): ") + cpu::level_name(quant_gemv_level())),
            std::string::npos)
      << report;
}

TEST(QuantGemv, RefusesWhatItCannotDo) {
  std::vector<float> x(256), y(4);
  std::vector<uint8_t> W(4 * 256);
  EXPECT_EQ(test::error_of([&] { quant_gemv(GgmlType::F16, x.data(), W.data(), y.data(), 1, 4, 256); }),
            "no quantized products for F16 weights");
  EXPECT_EQ(test::error_of([&] { quant_gemv(GgmlType::Q4_K, x.data(), W.data(), y.data(), 1, 4, 96); }),
            "Q4_K rows hold 256-element blocks; K = 96 is not a multiple");
  EXPECT_THROW(quant_gemv(GgmlType::Q8_0, x.data(), W.data(), y.data(), kGemvMaxRows + 1, 4, 32), std::invalid_argument);
  cpu::ScopedLevel avx2(cpu::Level::Avx2);
  EXPECT_THROW(quant_gemv(GgmlType::Q8_0, x.data(), W.data(), y.data(), 1, 4, 32, 0, 0, cpu::Level::Avx512),
               std::invalid_argument);
}

}  // namespace
}  // namespace hs::kernels
