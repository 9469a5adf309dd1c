// The plumbing between kernels inside a layer: linear layers in the compute dtype (weights [out, in], the Hugging
// Face layout), casts of weights to the compute dtype, and the small elementwise steps (residual adds).
#pragma once
#include <cstdint>

#include "core/memory.h"
#include "core/tensor.h"

namespace hs::model {

// y[N,out] = x[N,in] W^T.
template <typename T> void linear_forward(const T* x, const T* W, T* y, int64_t N, int64_t out, int64_t in);
// dx[N,in] += dy W (dx = dy W with accumulate_dx false, so dx needs no zeroing; skipped when dx is null);
// dW[out,in] += dy^T x. dy is fp32; with bf16 compute it is cast to bf16 (a workspace of N*out) so both products run
// on the bf16 matmul path.
template <typename T>
void linear_backward(const T* x, const T* W, const float* dy, float* dx, float* dW, int64_t N, int64_t out, int64_t in,
                     MemoryAccountant& mem, bool accumulate_dx = true);
// The same with dy already in T (its producer wrote the rounding the products need: no cast pass here).
template <typename T>
void linear_backward_from(const T* x, const T* W, const T* dy, float* dx, float* dW, int64_t N, int64_t out, int64_t in,
                          bool accumulate_dx = true);

// y = a + b, elementwise over n values.
template <typename T> void add(const T* a, const T* b, T* y, int64_t n);
// dst = convert(src): between storage types.
template <typename S, typename D> void cast(const S* src, D* dst, int64_t n);

// A view of `t` as const T*, casting into a new buffer of category `cat` when the storage type differs.
template <typename T> struct Converted {
  Buffer owned;
  const T* ptr = nullptr;
};
template <typename T> Converted<T> as_type(const TensorView& t, MemoryAccountant& mem, MemCategory cat, const char* tag);

}  // namespace hs::model
