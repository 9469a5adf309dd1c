#include "kernels/norms.h"

#include <omp.h>

#include <algorithm>

#include "kernels/vec_math.h"

namespace hs::kernels {
namespace {

template <typename T> float row_sum_squares(const T* x, int64_t dim) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < dim; ++c) {
    const float v = to_f32(x[c]);
    ss += v * v;
  }
  return ss;
}

// Columns per dw task: an equal share per thread in whole 64-byte lines. Each column is summed over the
// rows in order by its owner, so the result does not depend on the share.
int64_t column_block(int64_t dim) {
  const int64_t share = (dim + omp_get_max_threads() - 1) / omp_get_max_threads();
  return std::max<int64_t>(16, (share + 15) / 16 * 16);
}

// dw[c] += sum over rows, in row order, of term(r, c), with columns partitioned over threads.
template <typename F> void reduce_columns(float* dw, int64_t rows, int64_t dim, F term) {
  const int64_t block = column_block(dim), nblocks = (dim + block - 1) / block;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t c0 = blk * block, c1 = std::min(dim, c0 + block);
    for (int64_t r = 0; r < rows; ++r)
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) dw[c] += term(r, c);
  }
}

}  // namespace

template <typename T>
void rmsnorm_forward(const T* x, const float* w, T* y, float* rstd, int64_t rows, int64_t dim, float eps) {
  const float inv_dim = 1.0f / static_cast<float>(dim);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    T* yr = y + r * dim;
    const float rs = 1.0f / std::sqrt(row_sum_squares(xr, dim) * inv_dim + eps);
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) yr[c] = from_f32<T>(to_f32(xr[c]) * rs * (1.0f + w[c]));
    if (rstd) rstd[r] = rs;
  }
}

// With g = dy * (1 + w): dx = rstd * (g - x * rstd^2 * mean(g * x)); dw = sum_rows dy * x * rstd.
template <typename T>
void rmsnorm_backward(const T* x, const float* w, const float* rstd, const float* dy, float* dx, float* dw,
                      int64_t rows, int64_t dim) {
  const float inv_dim = 1.0f / static_cast<float>(dim);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const float* dyr = dy + r * dim;
    float* dxr = dx + r * dim;
    const float rs = rstd[r];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < dim; ++c) dot += dyr[c] * (1.0f + w[c]) * to_f32(xr[c]);
    const float k = rs * rs * dot * inv_dim;
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) dxr[c] += rs * (dyr[c] * (1.0f + w[c]) - to_f32(xr[c]) * k);
  }
  reduce_columns(dw, rows, dim,
                 [&](int64_t r, int64_t c) { return dy[r * dim + c] * to_f32(x[r * dim + c]) * rstd[r]; });
}

template <typename T>
void gated_rmsnorm_forward(const T* x, const T* z, const float* w, T* y, float* rstd, int64_t rows, int64_t dim,
                           float eps) {
  const float inv_dim = 1.0f / static_cast<float>(dim);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T* zr = z + r * dim;
    T* yr = y + r * dim;
    const float rs = 1.0f / std::sqrt(row_sum_squares(xr, dim) * inv_dim + eps);
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) yr[c] = from_f32<T>(w[c] * (to_f32(xr[c]) * rs) * silu_vec(to_f32(zr[c])));
    if (rstd) rstd[r] = rs;
  }
}

// With g = dy * w * silu(z): dx = rstd * (g - x * rstd^2 * mean(g * x)); dz = dy * w * x * rstd * silu'(z);
// dw = sum_rows dy * x * rstd * silu(z).
template <typename T>
void gated_rmsnorm_backward(const T* x, const T* z, const float* w, const float* rstd, const float* dy, float* dx,
                            float* dz, float* dw, int64_t rows, int64_t dim) {
  const float inv_dim = 1.0f / static_cast<float>(dim);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T* zr = z + r * dim;
    const float* dyr = dy + r * dim;
    float* dxr = dx + r * dim;
    float* dzr = dz + r * dim;
    const float rs = rstd[r];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < dim; ++c) dot += dyr[c] * w[c] * silu_vec(to_f32(zr[c])) * to_f32(xr[c]);
    const float k = rs * rs * dot * inv_dim;
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) {
      const float xv = to_f32(xr[c]), zv = to_f32(zr[c]);
      const float s = sigmoid_vec(zv);
      dxr[c] += rs * (dyr[c] * w[c] * (zv * s) - xv * k);
      dzr[c] += dyr[c] * w[c] * xv * rs * (s * (1.0f + zv * (1.0f - s)));
    }
  }
  reduce_columns(dw, rows, dim, [&](int64_t r, int64_t c) {
    return dy[r * dim + c] * to_f32(x[r * dim + c]) * rstd[r] * silu_vec(to_f32(z[r * dim + c]));
  });
}

template <typename T>
void l2norm_forward(const T* x, T* y, float* rstd, int64_t rows, int64_t dim, float eps, float scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    T* yr = y + r * dim;
    const float rs = 1.0f / std::sqrt(row_sum_squares(xr, dim) + eps);
    const float f = scale * rs;
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) yr[c] = from_f32<T>(to_f32(xr[c]) * f);
    if (rstd) rstd[r] = rs;
  }
}

// dx = scale * rstd * (dy - x * rstd^2 * sum(dy * x)).
template <typename T>
void l2norm_backward(const T* x, const float* rstd, const float* dy, float* dx, int64_t rows, int64_t dim,
                     float scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const float* dyr = dy + r * dim;
    float* dxr = dx + r * dim;
    const float rs = rstd[r];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < dim; ++c) dot += dyr[c] * to_f32(xr[c]);
    const float f = scale * rs, k = rs * rs * dot;
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) dxr[c] += f * (dyr[c] - to_f32(xr[c]) * k);
  }
}

#define HS_NORMS(T)                                                                                              \
  template void rmsnorm_forward<T>(const T*, const float*, T*, float*, int64_t, int64_t, float);                 \
  template void rmsnorm_backward<T>(const T*, const float*, const float*, const float*, float*, float*, int64_t, \
                                    int64_t);                                                                    \
  template void gated_rmsnorm_forward<T>(const T*, const T*, const float*, T*, float*, int64_t, int64_t, float); \
  template void gated_rmsnorm_backward<T>(const T*, const T*, const float*, const float*, const float*, float*,  \
                                          float*, float*, int64_t, int64_t);                                     \
  template void l2norm_forward<T>(const T*, T*, float*, int64_t, int64_t, float, float);                         \
  template void l2norm_backward<T>(const T*, const float*, const float*, float*, int64_t, int64_t, float);
HS_NORMS(float)
HS_NORMS(bf16)
#undef HS_NORMS

}  // namespace hs::kernels
