// The AdamW loop as it was before the vectorised kernels (kernels/adamw.cpp): a plain `#pragma omp simd` loop over
// the element formula, which GCC compiled to scalar code (std::sqrt's errno path kept it from vectorising) at about
// half the copy bandwidth. Kept verbatim as the bit-exact reference the fast kernels are tested against
// (tests/adamw_test.cpp, AdamW.VectorPathsMatchThePreviousLoopBitForBit). Built with FMA available (the default
// x86-64-v3 build has it, as -march=native on an FMA machine), GCC contracts it to exactly the fused operations the fast kernels spell out.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/adamw.h"

namespace hs::kernels::reference {
namespace {

template <typename TW, typename TG, typename TM = float>
inline void update_range(TW* w, TG* grad, TM* m, TM* v, int64_t i0, int64_t i1, const AdamWParams& p,
                         const AdamWScalars& k, float decay) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) {
    const float g = grad[i] * p.grad_scale;
    const float m0 = to_f32(m[i]), v0 = to_f32(v[i]);
    const float mi = m0 + k.one_minus_b1 * (g - m0);  // lerp, as torch's exp_avg.lerp_
    const float vi = p.beta2 * v0 + k.one_minus_b2 * g * g;
    const float denom = std::sqrt(vi) / k.bc2_sqrt + p.eps;
    w[i] = from_f32<TW>(to_f32(w[i]) * decay - k.step_size * (mi / denom));
    m[i] = from_f32<TM>(mi);
    v[i] = from_f32<TM>(vi);
    grad[i] = 0.0f;
  }
}

}  // namespace

void adamw_update_clear_all_loop(const std::vector<AdamWTensor>& tensors, const AdamWParams& p, int64_t step) {
  const AdamWScalars k = adamw_scalars(p, step);
  for (const AdamWTensor& a : tensors) {
    const float decay = 1.0f - p.lr * a.weight_decay;
    if (a.m) {
      if (a.w) update_range(a.w, a.grad, a.m, a.v, 0, a.n, p, k, decay);
      else update_range(a.w_bf16, a.grad, a.m, a.v, 0, a.n, p, k, decay);
    } else {
      if (a.w) update_range(a.w, a.grad, a.m_bf16, a.v_bf16, 0, a.n, p, k, decay);
      else update_range(a.w_bf16, a.grad, a.m_bf16, a.v_bf16, 0, a.n, p, k, decay);
    }
  }
}

}  // namespace hs::kernels::reference
