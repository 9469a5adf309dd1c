// Row normalisations: zero-centred RMSNorm, gated RMSNorm (Gated DeltaNet output) and L2 norm.
//
// Every forward writes rstd[row], the factor that multiplied x (before any weight, gate or scale):
// rsqrt(mean(x^2) + eps) for the RMS norms and rsqrt(sum(x^2) + eps) for the L2 norm, computed in fp32
// from the stored x. rstd may be nullptr when nothing will be differentiated. Backwards take the saved
// rstd and the stored x.
//
// Parameter gradients (dw) are accumulated (+=), summed over fixed row blocks whose partial sums are added in
// block order: bit-identical for any thread count. dx is accumulated too by default (accumulate = true: dx += g);
// accumulate = false writes it (dx = g: the caller needs no clearing pass), and rmsnorm_backward can start from a
// separate residual gradient instead (accumulate = false, residual: dx = residual + g, no copy of the residual
// into dx first; accumulate together with a residual is rejected).
#pragma once
#include <cstdint>

#include "kernels/common.h"

namespace hs::kernels {

// Zero-centred RMSNorm over the last dim: y = x * rstd * (1 + w), fp32 math, cast once at the end.
template <typename T>
void rmsnorm_forward(const T* x, const float* w, T* y, float* rstd, int64_t rows, int64_t dim, float eps);
// The residual add and the norm after it in one pass: sum = a + b rounded to T (the residual stream), y =
// rmsnorm(sum) as rmsnorm_forward computes it from the stored sum: the same bits as the add then rmsnorm_forward,
// the sum read back while its row is in L1 instead of a second pass over memory.
template <typename T>
void add_rmsnorm_forward(const T* a, const T* b, T* sum, const float* w, T* y, float* rstd, int64_t rows, int64_t dim,
                         float eps);
// dx_t (optional): also receives dx rounded to T, for a consumer that multiplies it in T (one pass, no cast later).
template <typename T>
void rmsnorm_backward(const T* x, const float* w, const float* rstd, const float* dy, float* dx, float* dw,
                      int64_t rows, int64_t dim, bool accumulate = true, const float* residual = nullptr,
                      T* dx_t = nullptr);

// The same backward (no residual, dx written) with dx only in T, row r at dx_t + r * dx_stride (>= dim): for a
// consumer that multiplies it in T and takes it interleaved with other columns (the attention's query rows inside the
// q_proj output gradient [.., heads, query | gate]). dx_t has the bits of rmsnorm_backward's dx_t (the fp32 dx rounded
// once) without the fp32 dx being written; dw accumulates as there. Throws std::invalid_argument if dx_stride < dim.
template <typename T>
void rmsnorm_backward_strided(const T* x, const float* w, const float* rstd, const float* dy, T* dx_t,
                              int64_t dx_stride, float* dw, int64_t rows, int64_t dim);

// Gated RMSNorm: y = w * (x * rstd) * silu(z) with a plain weight (not 1 + w); rows = tokens * heads,
// dim = dv, one weight [dim] shared by all rows.
template <typename T>
void gated_rmsnorm_forward(const T* x, const T* z, const float* w, T* y, float* rstd, int64_t rows, int64_t dim,
                           float eps);
// dz is float, or T when it only feeds a product in T (then written: accumulate must be false).
template <typename T, typename DZ>
void gated_rmsnorm_backward(const T* x, const T* z, const float* w, const float* rstd, const float* dy, float* dx,
                            DZ* dz, float* dw, int64_t rows, int64_t dim, bool accumulate = true);

// L2 norm over the last dim: y = scale * x * rsqrt(sum(x^2) + eps) (a sum, not a mean).
template <typename T>
void l2norm_forward(const T* x, T* y, float* rstd, int64_t rows, int64_t dim, float eps, float scale);
template <typename T>
void l2norm_backward(const T* x, const float* rstd, const float* dy, float* dx, int64_t rows, int64_t dim, float scale,
                     bool accumulate = true);

// Two L2 norms of the same shape in one parallel pass (the Gated DeltaNet's queries and keys, each with its own
// scale): the bits of a call for each, one fork/join instead of two. Entry 0 and 1 are the two tensors.
template <typename X, typename Y> struct L2NormPair {
  X* x[2];
  Y* y[2];
  float* rstd[2];
  float scale[2];
};
template <typename T> struct L2NormBackwardPair {
  const T* x[2];
  const float* rstd[2];
  const float* dy[2];
  float* dx[2];
  float scale[2];
};
template <typename T>
void l2norm_forward(const L2NormPair<const T, T>& p, int64_t rows, int64_t dim, float eps);
template <typename T>
void l2norm_backward(const L2NormBackwardPair<T>& p, int64_t rows, int64_t dim, bool accumulate = true);

// Plain references, math in double. T is the activation storage type and P the type of parameters,
// rstd and gradients: instantiated for (float, float), (bf16, float) and (double, double).
// Defined in src/kernels/reference/ (hs_kernel_references: tests and benchmarks link it, the engine does not).
namespace reference {
template <typename T, typename P>
void rmsnorm_forward(const T* x, const P* w, T* y, P* rstd, int64_t rows, int64_t dim, double eps);
template <typename T, typename P>
void rmsnorm_backward(const T* x, const P* w, const P* rstd, const P* dy, P* dx, P* dw, int64_t rows, int64_t dim);
template <typename T, typename P>
void gated_rmsnorm_forward(const T* x, const T* z, const P* w, T* y, P* rstd, int64_t rows, int64_t dim, double eps);
template <typename T, typename P>
void gated_rmsnorm_backward(const T* x, const T* z, const P* w, const P* rstd, const P* dy, P* dx, P* dz, P* dw,
                            int64_t rows, int64_t dim);
template <typename T, typename P>
void l2norm_forward(const T* x, T* y, P* rstd, int64_t rows, int64_t dim, double eps, double scale);
template <typename T, typename P>
void l2norm_backward(const T* x, const P* rstd, const P* dy, P* dx, int64_t rows, int64_t dim, double scale);
}  // namespace reference

}  // namespace hs::kernels
