#include "kernels/adamw.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace hs::kernels {
namespace {

// sum_squares cuts x into at most kMaxBlocks blocks of at least kMinBlock elements: enough blocks to
// spread over the threads, few enough that their sums fit on the stack.
constexpr int64_t kMaxBlocks = 1024;
constexpr int64_t kMinBlock = 1 << 15;

template <bool kClear, typename TW, typename TG>
void update(TW* w, TG* grad, float* m, float* v, int64_t n, const AdamWParams& p, int64_t step) {
  if (step < 1) throw std::invalid_argument("adamw_update: step is 1-based, got " + std::to_string(step));
  // PyTorch computes the bias corrections and the step size in double (Python floats), then uses them
  // as fp32 scalars.
  const double bc1 = 1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(step));
  const float step_size = static_cast<float>(static_cast<double>(p.lr) / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay = 1.0f - p.lr * p.weight_decay;
  const float one_minus_b1 = 1.0f - p.beta1, one_minus_b2 = 1.0f - p.beta2;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * p.grad_scale;
    const float mi = m[i] + one_minus_b1 * (g - m[i]);  // lerp, as torch's exp_avg.lerp_
    const float vi = p.beta2 * v[i] + one_minus_b2 * g * g;
    const float denom = std::sqrt(vi) / bc2_sqrt + p.eps;
    w[i] = from_f32<TW>(to_f32(w[i]) * decay - step_size * (mi / denom));
    m[i] = mi;
    v[i] = vi;
    if constexpr (kClear) grad[i] = 0.0f;
  }
}

}  // namespace

template <typename TW>
void adamw_update(TW* w, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p, int64_t step) {
  update<false>(w, grad, m, v, n, p, step);
}

template <typename TW>
void adamw_update_clear(TW* w, float* grad, float* m, float* v, int64_t n, const AdamWParams& p, int64_t step) {
  update<true>(w, grad, m, v, n, p, step);
}

double sum_squares(const float* x, int64_t n) {
  if (n <= 0) return 0.0;
  const int64_t block = std::max(kMinBlock, (n + kMaxBlocks - 1) / kMaxBlocks);
  const int64_t nblocks = (n + block - 1) / block;
  double partial[kMaxBlocks];
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t i0 = blk * block, i1 = std::min(n, i0 + block);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = i0; i < i1; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    partial[blk] = s;
  }
  double total = 0.0;
  for (int64_t blk = 0; blk < nblocks; ++blk) total += partial[blk];
  return total;
}

template void adamw_update<float>(float*, const float*, float*, float*, int64_t, const AdamWParams&, int64_t);
template void adamw_update<bf16>(bf16*, const float*, float*, float*, int64_t, const AdamWParams&, int64_t);
template void adamw_update_clear<float>(float*, float*, float*, float*, int64_t, const AdamWParams&, int64_t);
template void adamw_update_clear<bf16>(bf16*, float*, float*, float*, int64_t, const AdamWParams&, int64_t);

}  // namespace hs::kernels
