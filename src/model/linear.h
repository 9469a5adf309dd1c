// The plumbing between kernels inside a layer: linear layers in the compute dtype (weights [out, in], the Hugging
// Face layout) and the small elementwise steps (residual adds).
#pragma once
#include <cstdint>

#include "core/memory.h"
#include "core/tensor.h"
#include "distributed/weights.h"

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
// Casts between storage types and weights as const T* (distributed/weights.h, with the rest of how weights arrive).
using distributed::as_type;
using distributed::cast;
using distributed::Converted;

}  // namespace hs::model
