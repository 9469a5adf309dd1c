#include "core/dtype.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace hs {

DType parse_dtype(std::string_view s) {
  if (s == "fp32" || s == "f32" || s == "float32") return DType::F32;
  if (s == "bf16" || s == "bfloat16") return DType::BF16;
  throw std::invalid_argument("unknown dtype '" + std::string(s) + "' (use fp32 or bf16)");
}

namespace {
// Conversions of up to kRun elements run on the calling thread: an OpenMP region costs microseconds even with its
// `if` false (a team of one is still made, and more so inside another region), and callers convert row by row
// (kernels/matmul.cpp's widened products, quant_matmul's activations), often from inside their own parallel loop.
constexpr size_t kRun = size_t{1} << 16;
void round_run(const float* src, bf16* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i].bits = bf16::from_float(src[i]);
}
void widen_run(const bf16* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = bf16::to_float(src[i].bits);
}
// f over [0, n) in runs of kRun, the runs shared among the threads when there are several.
template <typename F> void in_runs(size_t n, F f) {
  if (n <= kRun) return f(size_t{0}, n);
  const size_t runs = (n + kRun - 1) / kRun;
#pragma omp parallel for schedule(static)
  for (size_t r = 0; r < runs; ++r) f(r * kRun, std::min(kRun, n - r * kRun));
}
}  // namespace

void convert(const float* src, bf16* dst, size_t n) {
  in_runs(n, [&](size_t i, size_t len) { round_run(src + i, dst + i, len); });
}

void convert(const bf16* src, float* dst, size_t n) {
  in_runs(n, [&](size_t i, size_t len) { widen_run(src + i, dst + i, len); });
}

}  // namespace hs
