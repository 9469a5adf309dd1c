#include "kernels/norms.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "core/profile.h"
#include "kernels/cpu.h"
#include "kernels/vec_math.h"

namespace hs::kernels {

// Every norm once for AVX2 (the build's baseline) and once for AVX-512, whose 512-bit vectors and masks halve the row
// loops' instructions; each public function below runs the widest copy this CPU allows under HS_MAX_ISA. Each row is
// summed in the same order in both (the per-row reductions are vectorised the same way: lanes, then a fixed tree).
namespace norms_avx2 {
#include "kernels/norms_paths.inc"
}  // namespace norms_avx2
HS_BEGIN_AVX512_PATHS
namespace norms_avx512 {
#include "kernels/norms_paths.inc"
}  // namespace norms_avx512
HS_END_ISA_PATHS


template <typename T>
void rmsnorm_forward(const T* x, const float* w, T* y, float* rstd, int64_t rows, int64_t dim, float eps) {
  HS_RETURN_WIDEST(norms, rmsnorm_forward(x, w, y, rstd, rows, dim, eps));
}
template <typename T>
void add_rmsnorm_forward(const T* a, const T* b, T* sum, const float* w, T* y, float* rstd, int64_t rows, int64_t dim,
                         float eps) {
  HS_RETURN_WIDEST(norms, add_rmsnorm_forward(a, b, sum, w, y, rstd, rows, dim, eps));
}
template <typename T>
void rmsnorm_backward(const T* x, const float* w, const float* rstd, const float* dy, float* dx, float* dw,
                      int64_t rows, int64_t dim, bool accumulate, const float* residual, T* dx_t) {
  HS_RETURN_WIDEST(norms, rmsnorm_backward(x, w, rstd, dy, dx, dw, rows, dim, accumulate, residual, dx_t));
}
template <typename T>
void rmsnorm_backward_strided(const T* x, const float* w, const float* rstd, const float* dy, T* dx_t, int64_t ld,
                              float* dw, int64_t rows, int64_t dim) {
  HS_RETURN_WIDEST(norms, rmsnorm_backward_strided(x, w, rstd, dy, dx_t, ld, dw, rows, dim));
}
template <typename T>
void gated_rmsnorm_forward(const T* x, const T* z, const float* w, T* y, float* rstd, int64_t rows, int64_t dim,
                           float eps) {
  HS_RETURN_WIDEST(norms, gated_rmsnorm_forward(x, z, w, y, rstd, rows, dim, eps));
}
template <typename T, typename DZ>
void gated_rmsnorm_backward(const T* x, const T* z, const float* w, const float* rstd, const float* dy, float* dx,
                            DZ* dz, float* dw, int64_t rows, int64_t dim, bool accumulate) {
  HS_RETURN_WIDEST(norms, gated_rmsnorm_backward(x, z, w, rstd, dy, dx, dz, dw, rows, dim, accumulate));
}
template <typename T>
void l2norm_forward(const T* x, T* y, float* rstd, int64_t rows, int64_t dim, float eps, float scale) {
  HS_RETURN_WIDEST(norms, l2norm_forward(x, y, rstd, rows, dim, eps, scale));
}
template <typename T>
void l2norm_backward(const T* x, const float* rstd, const float* dy, float* dx, int64_t rows, int64_t dim, float scale,
                     bool accumulate) {
  HS_RETURN_WIDEST(norms, l2norm_backward(x, rstd, dy, dx, rows, dim, scale, accumulate));
}
template <typename T>
void l2norm_forward(const L2NormPair<const T, T>& p, int64_t rows, int64_t dim, float eps) {
  HS_RETURN_WIDEST(norms, l2norm_forward(p, rows, dim, eps));
}
template <typename T>
void l2norm_backward(const L2NormBackwardPair<T>& p, int64_t rows, int64_t dim, bool accumulate) {
  HS_RETURN_WIDEST(norms, l2norm_backward(p, rows, dim, accumulate));
}

#define HS_NORMS(T)                                                                                              \
  template void rmsnorm_forward<T>(const T*, const float*, T*, float*, int64_t, int64_t, float);                 \
  template void rmsnorm_backward<T>(const T*, const float*, const float*, const float*, float*, float*, int64_t, \
                                    int64_t, bool, const float*, T*);                                            \
  template void add_rmsnorm_forward<T>(const T*, const T*, T*, const float*, T*, float*, int64_t, int64_t, float); \
  template void rmsnorm_backward_strided<T>(const T*, const float*, const float*, const float*, T*, int64_t,      \
                                            float*, int64_t, int64_t);                                           \
  template void gated_rmsnorm_forward<T>(const T*, const T*, const float*, T*, float*, int64_t, int64_t, float); \
  template void gated_rmsnorm_backward<T, float>(const T*, const T*, const float*, const float*, const float*,  \
                                                 float*, float*, float*, int64_t, int64_t, bool);                \
  template void l2norm_forward<T>(const T*, T*, float*, int64_t, int64_t, float, float);                         \
  template void l2norm_backward<T>(const T*, const float*, const float*, float*, int64_t, int64_t, float, bool);   \
  template void l2norm_forward<T>(const L2NormPair<const T, T>&, int64_t, int64_t, float);                         \
  template void l2norm_backward<T>(const L2NormBackwardPair<T>&, int64_t, int64_t, bool);
HS_NORMS(float)
HS_NORMS(bf16)
#undef HS_NORMS
template void gated_rmsnorm_backward<bf16, bf16>(const bf16*, const bf16*, const float*, const float*, const float*,
                                                 float*, bf16*, float*, int64_t, int64_t, bool);

}  // namespace hs::kernels
