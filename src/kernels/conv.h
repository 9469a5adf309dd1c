// Depthwise causal 1-D convolution followed by SiLU (the Gated DeltaNet short conv).
#pragma once
#include <cstdint>

#include "kernels/common.h"

namespace hs::kernels {

// Widest kernel supported (each task keeps its weights and a window of gradients on the stack); the
// models use 4.
inline constexpr int64_t kMaxConvWidth = 8;

// x and y are [batch, seq, channels] (channels fastest), w is [channels, width] with w[c, width-1]
// multiplying the current token, zeros before t = 0, no bias:
//   y[b,t,c] = silu(sum_j w[c,j] * x[b, t-width+1+j, c]).
// Throws std::invalid_argument if width is outside [1, kMaxConvWidth].
// positions (kernels/common.h, packed documents; null: one document a sequence): taps before the first token of
// token t's document read zeros, as before t = 0.
template <typename T>
void causal_conv_silu_forward(const T* x, const float* w, T* y, int64_t batch, int64_t seq, int64_t channels,
                              int64_t width, const int32_t* positions = nullptr);
// The same with y written straight into column blocks (the GDN's q, k and v tensors), no copy out of a [.., channels]
// output. Throws std::invalid_argument if the blocks do not hold `channels` columns.
template <typename T>
void causal_conv_silu_forward(const T* x, const float* w, const ColumnBlocks<T>& y, int64_t batch, int64_t seq,
                              int64_t channels, int64_t width, const int32_t* positions = nullptr);

// Recomputes the pre-activation from x and accumulates dx and dw (with accumulate_dx false dx is overwritten
// instead, so the caller need not zero it). Channels are partitioned over threads and each thread sums its dw over
// (batch, time) in order: bit-identical for any thread count.
template <typename T>
void causal_conv_silu_backward(const T* x, const float* w, const float* dy, float* dx, float* dw, int64_t batch,
                               int64_t seq, int64_t channels, int64_t width, bool accumulate_dx = true,
                               const int32_t* positions = nullptr);
// The same with dy read from column blocks (the gradients of q, k and v, no gather into one array first) and dx
// of type D: float, or the storage type T when dx only feeds a product in T (then it is written, never
// accumulated: accumulate_dx must be false).
template <typename T, typename D>
void causal_conv_silu_backward(const T* x, const float* w, const ColumnBlocks<const float>& dy, D* dx, float* dw,
                               int64_t batch, int64_t seq, int64_t channels, int64_t width, bool accumulate_dx,
                               const int32_t* positions = nullptr);

// Plain references, math in double: (T, P) in {(float, float), (bf16, float), (double, double)}.
// Defined in src/kernels/reference/ (hs_kernel_references: tests and benchmarks link it, the engine does not).
namespace reference {
template <typename T, typename P>
void causal_conv_silu_forward(const T* x, const P* w, T* y, int64_t batch, int64_t seq, int64_t channels,
                              int64_t width, const int32_t* positions = nullptr);
template <typename T, typename P>
void causal_conv_silu_backward(const T* x, const P* w, const P* dy, P* dx, P* dw, int64_t batch, int64_t seq,
                               int64_t channels, int64_t width, const int32_t* positions = nullptr);
}  // namespace reference

}  // namespace hs::kernels
