// Rotary position embedding, NeoX half split, on the first rotary_dim dims of each head (partial
// RoPE); dims rotary_dim..head_dim pass through. With i < rotary_dim/2 and r = rotary_dim/2:
//   inv_freq_i = theta^(-2i/rotary_dim),  angle_i = position * inv_freq_i,
//   x'_i   = x_i cos - x_{i+r} sin,   x'_{i+r} = x_{i+r} cos + x_i sin
// i.e. x' = x*cos + rotate_half(x)*sin with rotate_half(x) = (-x[r:2r], x[:r]).
//
// Precision: the fast kernels reproduce the float32 computation of Hugging Face transformers
// (inv_freq = 1 / theta**(arange(0, rd, 2).float() / rd), freqs = position.float() * inv_freq, cos/sin
// in fp32) rather than computing the angle more exactly. At theta 1e7 and positions ~1e5 the fp32
// angle is off by up to ~1e-2 rad from the exact one; a checkpoint was trained with the fp32 angle, so
// matching it is what keeps logits equal to the reference implementation (cos/sin then agree with
// PyTorch's to 1 ulp). The rotation itself is applied in fp32 and rounded once to the storage type.
#pragma once
#include <cstdint>

#include "kernels/common.h"

namespace hs::kernels {

// In place on x [tokens, heads, head_dim]; positions [tokens]. For a batch of sequences the caller
// passes 0..T-1 repeated. rotary_dim must be even and <= head_dim.
template <typename T>
void rope_forward(T* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                  int64_t rotary_dim, float theta);

// In place: dx <- R^T dx (the rotation by the negated angle), the gradient of rope_forward.
void rope_backward(float* dx, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                   int64_t rotary_dim, float theta);

// The queries q [tokens, q_heads, head_dim] and keys k [tokens, k_heads, head_dim] of one attention in one pass, each
// token's cos/sin computed once for both: the same bits as a call for each.
template <typename T>
void rope_forward(T* q, int64_t q_heads, T* k, int64_t k_heads, const int32_t* positions, int64_t tokens,
                  int64_t head_dim, int64_t rotary_dim, float theta);
void rope_backward(float* dq, int64_t q_heads, float* dk, int64_t k_heads, const int32_t* positions, int64_t tokens,
                   int64_t head_dim, int64_t rotary_dim, float theta);

// Defined in src/kernels/reference/ (hs_kernel_references: tests and benchmarks link it, the engine does not).
namespace reference {

// The same maps with inv_freq and the angle computed in R (the exact definition when R = double).
template <typename R>
void rope_forward(R* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                  int64_t rotary_dim, double theta);
template <typename R>
void rope_backward(R* dx, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                   int64_t rotary_dim, double theta);

}  // namespace reference
}  // namespace hs::kernels
