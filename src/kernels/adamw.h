// AdamW (decoupled weight decay, bias-corrected, PyTorch torch.optim.AdamW semantics) and the reduction
// global grad-norm clipping needs.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/common.h"
#include "kernels/cpu.h"

namespace hs::kernels {

struct AdamWParams {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.0f;
  // g = grad * grad_scale (in fp32) is the gradient used: global-norm clipping folded into the update, the same
  // bits as scaling the gradients first and one pass over them fewer.
  float grad_scale = 1.0f;
};

// The step's scalars, as PyTorch computes them: the bias corrections and the step size in double (Python floats),
// then used as fp32. Throws std::invalid_argument if step < 1 (steps are 1-based).
struct AdamWScalars {
  float step_size, bc2_sqrt, one_minus_b1, one_minus_b2;
};
AdamWScalars adamw_scalars(const AdamWParams& p, int64_t step);

// One step (step is 1-based) in fp32, in PyTorch's operation order:
//   w *= 1 - lr*wd;  m = lerp(m, g, 1-beta1);  v = beta2*v + (1-beta2)*g^2;
//   w -= (lr / (1-beta1^step)) * m / (sqrt(v) / sqrt(1-beta2^step) + eps),
// i.e. w <- w - lr * (mhat / (sqrt(vhat) + eps) + wd * w). With TW = bf16 the result is rounded to
// nearest even once per step. Throws std::invalid_argument if step < 1.
template <typename TW>
void adamw_update(TW* w, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p, int64_t step);

// The optimizer's step: adamw_update over many tensors in one parallel pass (one fork/join and an even split of all
// their elements between the threads, instead of one region per tensor, where small tensors leave threads idle),
// leaving every grad zeroed for the next step to accumulate into (its cache lines are written back within this pass
// instead of being cleared by a separate pass over memory). Each tensor has its own weight decay
// (AdamWParams::weight_decay is ignored), weights in fp32 (w) or bf16 (w_bf16, w null) and moments in fp32 (m, v)
// or bf16 (m_bf16, v_bf16, m and v null). Every element gets exactly the update adamw_update gives it; with bf16
// moments, the one adamw_update gives it from the moments widened to fp32, and the new moments are stored rounded
// to nearest even (the weight update uses them unrounded).
struct AdamWTensor {
  float* w = nullptr;
  bf16* w_bf16 = nullptr;
  float* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  bf16* m_bf16 = nullptr;
  bf16* v_bf16 = nullptr;
  int64_t n = 0;
  float weight_decay = 0.0f;
};
void adamw_update_clear_all(const std::vector<AdamWTensor>& tensors, const AdamWParams& p, int64_t step);

// The instruction set the update runs in: the widest within cpu::level() (AVX-512 F/BW/VL, else AVX2 + FMA; Scalar
// under a cpu::ScopedLevel), chosen at each call. Every path gives the same bits (the same correctly rounded
// operations, element by element).
cpu::Level adamw_level();

// sum(x^2) in double. The array is cut into blocks whose bounds depend only on n, each block is summed
// by one thread, and the block sums are added in order: the same bits for any thread count.
double sum_squares(const float* x, int64_t n);
// sum_i sum_squares(x_i, n_i) over many arrays in one parallel pass, with the same blocks and the same order of
// additions: the same bits as the loop of calls, for any thread count.
double sum_squares_all(const std::vector<std::pair<const float*, int64_t>>& arrays);

// Plain references, math in double: (TW, P) in {(float, float), (bf16, float), (double, double)}.
// Defined in src/kernels/reference/ (hs_kernel_references: tests and benchmarks link it, the engine does not).
namespace reference {
template <typename TW, typename P>
void adamw_update(TW* w, const P* grad, P* m, P* v, int64_t n, const AdamWParams& p, int64_t step);
template <typename P> double sum_squares(const P* x, int64_t n);
// The scalar loop adamw_update_clear_all was before its vectorised paths, one tensor after another on the calling
// thread: the bit-exact reference for the fast kernel where the build has FMA (the compiler then contracts it to the
// fused operations the fast kernel spells out).
void adamw_update_clear_all_loop(const std::vector<AdamWTensor>& tensors, const AdamWParams& p, int64_t step);
}  // namespace reference

}  // namespace hs::kernels
