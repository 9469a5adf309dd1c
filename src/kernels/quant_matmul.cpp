// Prefill products on quantized weights (kernels/quant_gemv.h, quant_matmul).
#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/matmul.h"
#include "kernels/paths.h"
#include "kernels/quant_gemv.h"

namespace hs::kernels {
namespace {

// Weight rows per tile of the int8 way: 64 rows of K = 2048 at Q8_0 are 139 KiB, within L2 while every activation
// row group passes over them.
constexpr int64_t kInt8TileRows = 64;
// Weight rows per tile of the dequantized way: 256 rows of K = 2048 are 1 MiB of bf16, one oneDNN call each.
constexpr int64_t kDequantTileRows = 256;

template <typename T> void dequantize_tile(GgmlType t, const uint8_t* W, int64_t rows, int64_t K, T* out) {
  const int64_t rb = ggml_row_bytes(t, K);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) dequantize_row(t, W + n * rb, out + n * K, K);
}

constexpr int64_t align64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// Tiles of kDequantTileRows weight rows dequantized to Tw (x's element type) into `tile`, each multiplied by x.
template <typename Tw>
void dequantized_products(GgmlType t, const Tw* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
                          int64_t ldx, int64_t ldy, Tw* tile) {
  const int64_t rb = ggml_row_bytes(t, K);
  for (int64_t n0 = 0; n0 < N; n0 += kDequantTileRows) {
    const int64_t rows = std::min(kDequantTileRows, N - n0);
    dequantize_tile(t, w + n0 * rb, rows, K, tile);
    MatmulLayout ld;
    ld.lda = ldx;
    ld.ldc = ldy;
    matmul(x, tile, y + n0, M, rows, K, false, true, false, ld);
  }
}

}  // namespace

QuantMatmul quant_matmul_way(GgmlType t, int64_t M, QuantMatmul how, bool fp32_activations) {
  if (how != QuantMatmul::Auto) return how;
  // A few rows: the decode product (each weight block read once for all rows). More (M = 512, N = K = 2048, 2
  // threads): with bf16 x (AMD EPYC, medians of 5 alternated runs) Q8_0 244 GFLOP/s dequantized against 82 int8, Q4_K
  // 59 dequantized (its dequantization, scalar then, was the slower part) against 83 int8; with fp32 x (Intel Xeon
  // with AVX-512 and AMX, quiet, medians of 5; bench/qdecode_bench matmul) Q8_0 65 int8, 134-152 dequantized to
  // fp32, 366 DequantizedBf16; Q4_K 75, 109-154, 466 (the tiles dequantized in AVX2 lanes). Capped at AVX2 there:
  // Q8_0 69 int8, 98 dequantized; Q4_K 78-94 against 79-97 (even: fp32, the exact one, taken).
  if (M <= kGemvMaxRows) return QuantMatmul::Int8;
  if (matmul_bf16_on_onednn()) return QuantMatmul::DequantizedBf16;
  if (fp32_activations) return QuantMatmul::Dequantized;
  return (t == GgmlType::Q8_0 || t == GgmlType::Q4_0) ? QuantMatmul::Dequantized : QuantMatmul::Int8;
}

template <typename T> int64_t quant_matmul_workspace_bytes(GgmlType t, int64_t M, int64_t N, int64_t K, QuantMatmul how) {
  if (M <= 0 || N <= 0) return 0;
  const QuantMatmul way = quant_matmul_way(t, M, how, std::is_same_v<T, float>);
  if (way == QuantMatmul::Int8) return quantized_rows_bytes(t, M, K);
  if (way == QuantMatmul::DequantizedBf16 && std::is_same_v<T, float>)
    return align64(M * K * 2) + std::min(N, kDequantTileRows) * K * 2;
  return std::min(N, kDequantTileRows) * K * static_cast<int64_t>(sizeof(T));
}

template <typename T>
void quant_matmul(GgmlType t, const T* x, const void* W, float* y, int64_t M, int64_t N, int64_t K, int64_t ldx,
                  int64_t ldy, QuantMatmul how, void* workspace, int64_t workspace_bytes) {
  if (!quant_gemv_supports(t))
    throw std::invalid_argument(std::string("no quantized products for ") + ggml_type_info(t).name + " weights");
  if (M <= 0 || N <= 0) return;
  if (ldx == 0) ldx = K;
  if (ldy == 0) ldy = N;
  const auto* w = static_cast<const uint8_t*>(W);
  how = quant_matmul_way(t, M, how, std::is_same_v<T, float>);
  if (workspace && workspace_bytes < quant_matmul_workspace_bytes<T>(t, M, N, K, how))
    throw std::invalid_argument("quant_matmul: a workspace of " + std::to_string(workspace_bytes) + " bytes, " +
                                std::to_string(quant_matmul_workspace_bytes<T>(t, M, N, K, how)) + " needed");
  if (how == QuantMatmul::Int8) {
    QuantizedRows xq;
    if (workspace) {
      xq.external = static_cast<uint8_t*>(workspace);
      xq.external_bytes = static_cast<size_t>(workspace_bytes);
    }
    quantize_rows(t, x, M, K, ldx, xq);
    const cpu::Level isa = quant_gemv_level();
    const int64_t tiles = (N + kInt8TileRows - 1) / kInt8TileRows;
    if (tiles == 1) {  // nothing to split over threads at the tile's granularity: one call, no fork
      quant_gemv_rows(xq, w, y, ldy, 0, N, isa);
      return;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < tiles; ++i)
      quant_gemv_rows(xq, w, y, ldy, i * kInt8TileRows, std::min(N, (i + 1) * kInt8TileRows), isa);
    return;
  }
  // Dequantized ways: x in bf16 (rounded into the workspace's head) for DequantizedBf16 with fp32 x, else as given.
  std::vector<uint8_t> own;
  uint8_t* scratch = static_cast<uint8_t*>(workspace);
  if (!scratch) {
    own.resize(static_cast<size_t>(quant_matmul_workspace_bytes<T>(t, M, N, K, how)));
    scratch = own.data();
  }
  if constexpr (std::is_same_v<T, float>) {
    if (how == QuantMatmul::DequantizedBf16) {
      auto* xb = reinterpret_cast<bf16*>(scratch);
#pragma omp parallel for schedule(static)
      for (int64_t m = 0; m < M; ++m) convert(x + m * ldx, xb + m * K, static_cast<size_t>(K));
      dequantized_products(t, static_cast<const bf16*>(xb), w, y, M, N, K, K, ldy,
                           reinterpret_cast<bf16*>(scratch + align64(M * K * 2)));
      return;
    }
  }
  dequantized_products(t, x, w, y, M, N, K, ldx, ldy, reinterpret_cast<T*>(scratch));
}

template void quant_matmul<float>(GgmlType, const float*, const void*, float*, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, QuantMatmul, void*, int64_t);
template void quant_matmul<bf16>(GgmlType, const bf16*, const void*, float*, int64_t, int64_t, int64_t, int64_t,
                                 int64_t, QuantMatmul, void*, int64_t);
template int64_t quant_matmul_workspace_bytes<float>(GgmlType, int64_t, int64_t, int64_t, QuantMatmul);
template int64_t quant_matmul_workspace_bytes<bf16>(GgmlType, int64_t, int64_t, int64_t, QuantMatmul);

}  // namespace hs::kernels
