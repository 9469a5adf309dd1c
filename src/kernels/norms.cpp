#include "kernels/norms.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "core/profile.h"
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

// Row blocks for a backward that also sums dw over the rows: the block bounds depend only on the row count, each
// block sums its rows in order into its own partial dw, and the partials are added in block order, so dw has the
// same bits for any thread count. dw comes out of the same pass over the rows as dx (no second read of dy and x).
constexpr int64_t kMaxRowBlocks = 64;
int64_t row_blocks(int64_t rows) { return std::clamp<int64_t>(rows / 64, 1, kMaxRowBlocks); }

// body(r, partial_dw) for every row, then dw += the partials.
template <typename F> void rows_with_dw(float* dw, int64_t rows, int64_t dim, F body) {
  const int64_t nb = row_blocks(rows);
  std::vector<float> partial(static_cast<size_t>(nb * dim), 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nb; ++blk) {
    float* pw = partial.data() + blk * dim;
    for (int64_t r = rows * blk / nb; r < rows * (blk + 1) / nb; ++r) body(r, pw);
  }
  for (int64_t blk = 0; blk < nb; ++blk)
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) dw[c] += partial[static_cast<size_t>(blk * dim + c)];
}

// What a backward adds its dx to, per row: dx itself (accumulate), a separate residual gradient, or nothing.
void check_dx_init(bool accumulate, const float* residual, const char* who) {
  if (accumulate && residual)
    throw std::invalid_argument(std::string(who) + ": accumulate and residual are exclusive (dx = dx + g or residual + g)");
}
inline const float* dx_base(const float* dxr, bool accumulate, const float* residual, int64_t offset) {
  return accumulate ? dxr : residual ? residual + offset : nullptr;
}

}  // namespace

template <typename T>
void rmsnorm_forward(const T* x, const float* w, T* y, float* rstd, int64_t rows, int64_t dim, float eps) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "rmsnorm_forward");
  const float inv_dim = 1.0f / static_cast<float>(dim);
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelMinWork)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    T* yr = y + r * dim;
    const float rs = 1.0f / std::sqrt(row_sum_squares(xr, dim) * inv_dim + eps);
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) yr[c] = from_f32<T>(to_f32(xr[c]) * rs * (1.0f + w[c]));
    if (rstd) rstd[r] = rs;
  }
}

template <typename T>
void add_rmsnorm_forward(const T* a, const T* b, T* sum, const float* w, T* y, float* rstd, int64_t rows, int64_t dim,
                         float eps) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "add_rmsnorm_forward");
  const float inv_dim = 1.0f / static_cast<float>(dim);
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelMinWork)
  for (int64_t r = 0; r < rows; ++r) {
    const T* ar = a + r * dim;
    const T* br = b + r * dim;
    T* sr = sum + r * dim;
    T* yr = y + r * dim;
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) sr[c] = from_f32<T>(to_f32(ar[c]) + to_f32(br[c]));
    // From here rmsnorm_forward's row on the stored (rounded) sum, read back from L1.
    const float rs = 1.0f / std::sqrt(row_sum_squares(sr, dim) * inv_dim + eps);
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) yr[c] = from_f32<T>(to_f32(sr[c]) * rs * (1.0f + w[c]));
    if (rstd) rstd[r] = rs;
  }
}

// With g = dy * (1 + w): dx = rstd * (g - x * rstd^2 * mean(g * x)); dw = sum_rows dy * x * rstd.
template <typename T>
void rmsnorm_backward(const T* x, const float* w, const float* rstd, const float* dy, float* dx, float* dw,
                      int64_t rows, int64_t dim, bool accumulate, const float* residual, T* dx_t) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "rmsnorm_backward");
  check_dx_init(accumulate, residual, "rmsnorm_backward");
  const float inv_dim = 1.0f / static_cast<float>(dim);
  rows_with_dw(dw, rows, dim, [&](int64_t r, float* pw) {
    const T* xr = x + r * dim;
    const float* dyr = dy + r * dim;
    float* dxr = dx + r * dim;
    const float* base = dx_base(dxr, accumulate, residual, r * dim);
    const float rs = rstd[r];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < dim; ++c) dot += dyr[c] * (1.0f + w[c]) * to_f32(xr[c]);
    const float k = rs * rs * dot * inv_dim;
    if (base) {
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c) {
        const float xv = to_f32(xr[c]);
        dxr[c] = base[c] + rs * (dyr[c] * (1.0f + w[c]) - xv * k);
        pw[c] += dyr[c] * xv * rs;
      }
    } else {
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c) {
        const float xv = to_f32(xr[c]);
        dxr[c] = rs * (dyr[c] * (1.0f + w[c]) - xv * k);
        pw[c] += dyr[c] * xv * rs;
      }
    }
    if (dx_t) {
      T* dtr = dx_t + r * dim;
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c) dtr[c] = from_f32<T>(dxr[c]);
    }
  });
}

template <typename T>
void rmsnorm_backward_strided(const T* x, const float* w, const float* rstd, const float* dy, T* dx_t,
                              int64_t dx_stride, float* dw, int64_t rows, int64_t dim) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "rmsnorm_backward");
  if (dx_stride < dim)
    throw std::invalid_argument("rmsnorm_backward_strided: row stride " + std::to_string(dx_stride) +
                                " is shorter than the row (" + std::to_string(dim) + ")");
  const float inv_dim = 1.0f / static_cast<float>(dim);
  rows_with_dw(dw, rows, dim, [&](int64_t r, float* pw) {
    const T* xr = x + r * dim;
    const float* dyr = dy + r * dim;
    T* dtr = dx_t + r * dx_stride;
    const float rs = rstd[r];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < dim; ++c) dot += dyr[c] * (1.0f + w[c]) * to_f32(xr[c]);
    const float k = rs * rs * dot * inv_dim;
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) {
      const float xv = to_f32(xr[c]);
      const float d = rs * (dyr[c] * (1.0f + w[c]) - xv * k);
      dtr[c] = from_f32<T>(d);
      pw[c] += dyr[c] * xv * rs;
    }
  });
}

template <typename T>
void gated_rmsnorm_forward(const T* x, const T* z, const float* w, T* y, float* rstd, int64_t rows, int64_t dim,
                           float eps) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "gated_rmsnorm_forward");
  const float inv_dim = 1.0f / static_cast<float>(dim);
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelMinWork)
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
template <typename T, typename DZ>
void gated_rmsnorm_backward(const T* x, const T* z, const float* w, const float* rstd, const float* dy, float* dx,
                            DZ* dz, float* dw, int64_t rows, int64_t dim, bool accumulate) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "gated_rmsnorm_backward");
  if (!std::is_same_v<DZ, float> && accumulate)
    throw std::invalid_argument("gated_rmsnorm_backward: a dz in the storage type is written, not accumulated");
  const float inv_dim = 1.0f / static_cast<float>(dim);
  rows_with_dw(dw, rows, dim, [&](int64_t r, float* pw) {
    const T* xr = x + r * dim;
    const T* zr = z + r * dim;
    const float* dyr = dy + r * dim;
    float* dxr = dx + r * dim;
    DZ* dzr = dz + r * dim;
    const float rs = rstd[r];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < dim; ++c) dot += dyr[c] * w[c] * silu_vec(to_f32(zr[c])) * to_f32(xr[c]);
    const float k = rs * rs * dot * inv_dim;
    if constexpr (std::is_same_v<DZ, float>) {
      if (accumulate) {
#pragma omp simd
        for (int64_t c = 0; c < dim; ++c) {
          const float xv = to_f32(xr[c]), zv = to_f32(zr[c]);
          const float s = sigmoid_vec(zv);
          const float silu = zv * s;
          dxr[c] += rs * (dyr[c] * w[c] * silu - xv * k);
          dzr[c] += dyr[c] * w[c] * xv * rs * (s * (1.0f + zv * (1.0f - s)));
          pw[c] += dyr[c] * xv * rs * silu;
        }
        return;
      }
    }
    // Written: dz in DZ (for bf16, the fp32 value rounded once).
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) {
      const float xv = to_f32(xr[c]), zv = to_f32(zr[c]);
      const float s = sigmoid_vec(zv);
      const float silu = zv * s;
      dxr[c] = rs * (dyr[c] * w[c] * silu - xv * k);
      dzr[c] = from_f32<DZ>(dyr[c] * w[c] * xv * rs * (s * (1.0f + zv * (1.0f - s))));
      pw[c] += dyr[c] * xv * rs * silu;
    }
  });
}

namespace {
template <typename T> inline void l2norm_forward_row(const T* xr, T* yr, float* rstd, float eps, float scale, int64_t dim) {
  const float rs = 1.0f / std::sqrt(row_sum_squares(xr, dim) + eps);
  const float f = scale * rs;
#pragma omp simd
  for (int64_t c = 0; c < dim; ++c) yr[c] = from_f32<T>(to_f32(xr[c]) * f);
  if (rstd) *rstd = rs;
}
template <typename T>
inline void l2norm_backward_row(const T* xr, float rs, const float* dyr, float* dxr, float scale, bool accumulate,
                                int64_t dim) {
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t c = 0; c < dim; ++c) dot += dyr[c] * to_f32(xr[c]);
  const float f = scale * rs, k = rs * rs * dot;
  if (accumulate) {
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) dxr[c] += f * (dyr[c] - to_f32(xr[c]) * k);
  } else {
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) dxr[c] = f * (dyr[c] - to_f32(xr[c]) * k);
  }
}
}  // namespace

template <typename T>
void l2norm_forward(const T* x, T* y, float* rstd, int64_t rows, int64_t dim, float eps, float scale) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "l2norm_forward");
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelMinWork)
  for (int64_t r = 0; r < rows; ++r)
    l2norm_forward_row(x + r * dim, y + r * dim, rstd ? rstd + r : nullptr, eps, scale, dim);
}

template <typename T>
void l2norm_forward(const L2NormPair<const T, T>& p, int64_t rows, int64_t dim, float eps) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "l2norm_forward");
#pragma omp parallel for schedule(static) if (2 * rows * dim >= kParallelMinWork)
  for (int64_t r = 0; r < 2 * rows; ++r) {
    const int i = r < rows ? 0 : 1;
    const int64_t rr = r - i * rows;
    l2norm_forward_row(p.x[i] + rr * dim, p.y[i] + rr * dim, p.rstd[i] ? p.rstd[i] + rr : nullptr, eps, p.scale[i],
                       dim);
  }
}

// dx = scale * rstd * (dy - x * rstd^2 * sum(dy * x)).
template <typename T>
void l2norm_backward(const T* x, const float* rstd, const float* dy, float* dx, int64_t rows, int64_t dim,
                     float scale, bool accumulate) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "l2norm_backward");
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    l2norm_backward_row(x + r * dim, rstd[r], dy + r * dim, dx + r * dim, scale, accumulate, dim);
}

template <typename T>
void l2norm_backward(const L2NormBackwardPair<T>& p, int64_t rows, int64_t dim, bool accumulate) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "l2norm_backward");
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < 2 * rows; ++r) {
    const int i = r < rows ? 0 : 1;
    const int64_t rr = r - i * rows;
    l2norm_backward_row(p.x[i] + rr * dim, p.rstd[i][rr], p.dy[i] + rr * dim, p.dx[i] + rr * dim, p.scale[i], accumulate,
                        dim);
  }
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
