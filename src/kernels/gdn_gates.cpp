#include "kernels/gdn_gates.h"

#include <cmath>
#include <vector>

#include "core/profile.h"

namespace hs::kernels {
namespace {
// -exp(A_log[h]) per head, computed once (not once per token): the same values, so the same bits.
std::vector<float> neg_exp(const float* A_log, int64_t heads) {
  std::vector<float> e(static_cast<size_t>(heads));
  for (int64_t h = 0; h < heads; ++h) e[static_cast<size_t>(h)] = -std::exp(A_log[h]);
  return e;
}
}  // namespace

template <typename T>
void gdn_gates_forward(const T* b, const T* a, const float* A_log, const float* dt_bias, float* beta, float* g,
                       int64_t rows, int64_t heads) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "gdn_gates_forward");
  const std::vector<float> neg_e = neg_exp(A_log, heads);
#pragma omp parallel for schedule(static) if (rows * heads >= kParallelMinWork)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = r * heads;
    for (int64_t h = 0; h < heads; ++h) {
      beta[o + h] = sigmoidf(to_f32(b[o + h]));
      g[o + h] = neg_e[static_cast<size_t>(h)] * softplusf(to_f32(a[o + h]) + dt_bias[h]);
    }
  }
}

// dbeta/db = beta (1 - beta); dg/da = dg/ddt_bias = -exp(A_log) sigmoid(a + dt_bias); dg/dA_log = g.
// Elementwise gradients in a row-parallel pass, then the per-head sums over rows in a head-parallel one.
template <typename T>
void gdn_gates_backward(const T* b, const T* a, const float* A_log, const float* dt_bias, const float* dbeta,
                        const float* dg, float* db, float* da, float* dA_log, float* ddt_bias, int64_t rows,
                        int64_t heads) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "gdn_gates_backward");
  const std::vector<float> neg_e = neg_exp(A_log, heads);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = r * heads;
    for (int64_t h = 0; h < heads; ++h) {
      const float s = sigmoidf(to_f32(b[o + h]));
      db[o + h] += dbeta[o + h] * (s * (1.0f - s));
      da[o + h] += dg[o + h] * neg_e[static_cast<size_t>(h)] * sigmoidf(to_f32(a[o + h]) + dt_bias[h]);
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < heads; ++h) {
    const float e = std::exp(A_log[h]);
    float sum_du = 0.0f, sum_dA = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const float u = to_f32(a[r * heads + h]) + dt_bias[h];
      sum_du += dg[r * heads + h] * -e * sigmoidf(u);
      sum_dA += dg[r * heads + h] * -e * softplusf(u);
    }
    ddt_bias[h] += sum_du;
    dA_log[h] += sum_dA;
  }
}

#define HS_GATES(T)                                                                                               \
  template void gdn_gates_forward<T>(const T*, const T*, const float*, const float*, float*, float*, int64_t,     \
                                     int64_t);                                                                    \
  template void gdn_gates_backward<T>(const T*, const T*, const float*, const float*, const float*, const float*, \
                                      float*, float*, float*, float*, int64_t, int64_t);
HS_GATES(float)
HS_GATES(bf16)
#undef HS_GATES

}  // namespace hs::kernels
