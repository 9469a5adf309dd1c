#include "model/layer_recipe.h"

#include <cmath>

#include "core/profile.h"
#include "kernels/gdn_gates.h"
#include "kernels/norms.h"
#include "kernels/rope.h"

namespace hs::model::recipe {

template <typename T>
void gdn_norms_gates(const ModelConfig& c, const float* a_log, const float* dt_bias, const T* q, const T* k, const T* b,
                     const T* a, T* qn, T* kn, float* rstd_q, float* rstd_k, float* beta, float* g, int64_t rows) {
  const float qscale = 1.0f / std::sqrt(static_cast<float>(c.dk));
  kernels::l2norm_forward(kernels::L2NormPair<const T, T>{{q, k}, {qn, kn}, {rstd_q, rstd_k}, {qscale, 1.0f}},
                          rows * c.k_heads, c.dk, 1e-6f);
  kernels::gdn_gates_forward(b, a, a_log, dt_bias, beta, g, rows, c.v_heads);
}

template <typename T> void split_query_gate(const ModelConfig& c, const T* qg, T* q_raw, T* gate, int64_t rows) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "split_query_gate");
  const int64_t units = rows * c.q_heads, hd = c.head_dim;
#pragma omp parallel for schedule(static)
  for (int64_t u = 0; u < units; ++u)
    for (int64_t j = 0; j < hd; ++j) {
      q_raw[u * hd + j] = qg[u * 2 * hd + j];
      gate[u * hd + j] = qg[u * 2 * hd + hd + j];
    }
}

template <typename T>
void attention_norms_rope(const ModelConfig& c, const float* q_norm, const float* k_norm, const T* q_raw,
                          const T* k_raw, T* qn, T* kn, float* rstd_q, float* rstd_k, const int32_t* positions,
                          int64_t rows) {
  const int64_t nH = c.q_heads, nKV = c.kv_heads, hd = c.head_dim;
  kernels::rmsnorm_forward(q_raw, q_norm, qn, rstd_q, rows * nH, hd, float(c.rms_eps));
  kernels::rmsnorm_forward(k_raw, k_norm, kn, rstd_k, rows * nKV, hd, float(c.rms_eps));
  kernels::rope_forward(qn, nH, kn, nKV, positions, rows, hd, c.rotary_dim(), float(c.rope_theta));
}

template <typename T>
void residual_post_norm(const ModelConfig& c, const float* post_norm, const T* h, const T* mix, T* h_mid, T* xn,
                        float* rstd, int64_t rows) {
  kernels::add_rmsnorm_forward(h, mix, h_mid, post_norm, xn, rstd, rows, c.hidden, float(c.rms_eps));
}

#define HS_INSTANTIATE(T)                                                                                         \
  template void gdn_norms_gates<T>(const ModelConfig&, const float*, const float*, const T*, const T*, const T*,  \
                                   const T*, T*, T*, float*, float*, float*, float*, int64_t);                     \
  template void split_query_gate<T>(const ModelConfig&, const T*, T*, T*, int64_t);                               \
  template void attention_norms_rope<T>(const ModelConfig&, const float*, const float*, const T*, const T*, T*, T*, \
                                        float*, float*, const int32_t*, int64_t);                                 \
  template void residual_post_norm<T>(const ModelConfig&, const float*, const T*, const T*, T*, T*, float*, int64_t);
HS_INSTANTIATE(float)
HS_INSTANTIATE(bf16)
#undef HS_INSTANTIATE

}  // namespace hs::model::recipe
