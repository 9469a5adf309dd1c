// The plain reference of the quantized products: dequantized weights times dequantized activations, in double.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/quant_gemv.h"

namespace hs::kernels::reference {

namespace {

// |offset part| of each weight element of one row (the part the kernels sum apart from the levels' products).
void offset_magnitudes(GgmlType t, const uint8_t* row, int64_t K, std::vector<double>& out) {
  out.assign(static_cast<size_t>(K), 0.0);
  if (t == GgmlType::Q4_0) {
    const auto* b = reinterpret_cast<const BlockQ4_0*>(row);
    for (int64_t k = 0; k < K; ++k) out[k] = 8.0 * std::fabs(fp16_to_fp32(b[k / kQK].d));
  } else if (t == GgmlType::Q4_K || t == GgmlType::Q5_K) {
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t* blk = row + (k / kQKK) * (t == GgmlType::Q4_K ? sizeof(BlockQ4_K) : sizeof(BlockQ5_K));
      uint16_t dmin;
      std::memcpy(&dmin, blk + 2, 2);
      uint8_t sc, m;
      unpack_scale_min_k4(static_cast<int>(k % kQKK / 32), blk + 4, sc, m);
      out[k] = std::fabs(double(fp16_to_fp32(dmin)) * m);
    }
  } else if (t == GgmlType::Q6_K) {
    const auto* b = reinterpret_cast<const BlockQ6_K*>(row);
    for (int64_t k = 0; k < K; ++k) {
      const BlockQ6_K& blk = b[k / kQKK];
      out[k] = 32.0 * std::fabs(double(fp16_to_fp32(blk.d)) * blk.scales[k % kQKK / 16]);
    }
  }
}

}  // namespace

void quant_gemv(const QuantizedRows& xq, const void* W, int64_t N, std::vector<double>& y, std::vector<double>& mag) {
  const int64_t K = xq.K, M = xq.M;
  const int64_t wrow = ggml_row_bytes(xq.weight_type, K);
  y.assign(static_cast<size_t>(M * N), 0.0);
  mag.assign(static_cast<size_t>(M * N), 0.0);
  std::vector<float> x(static_cast<size_t>(M * K)), w(static_cast<size_t>(K));
  std::vector<double> off;
  for (int64_t m = 0; m < M; ++m) dequantize_quantized_row(xq, m, x.data() + m * K);
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = static_cast<const uint8_t*>(W) + n * wrow;
    dequantize_row(xq.weight_type, row, w.data(), K);
    offset_magnitudes(xq.weight_type, row, K, off);
    for (int64_t m = 0; m < M; ++m) {
      double s = 0, a = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double xk = x[m * K + k];
        s += double(w[k]) * xk;
        // the level part is w - offset (offset negative: w = level part - |offset|), so |level part| <= |w| + |offset|
        a += (std::fabs(double(w[k])) + 2 * off[k]) * std::fabs(xk);
      }
      y[m * N + n] = s;
      mag[m * N + n] = a;
    }
  }
}

}  // namespace hs::kernels::reference
