// Gated causal grouped-query attention (the "full attention" layers of Qwen3-Next / Qwen3.5):
//   attn = softmax(q k^T * hd^-0.5, causal) v   (softmax in fp32),   out = attn * sigmoid(gate).
// The fast path is tiled flash-style: an online softmax over key tiles, so no [T, T] score matrix is
// ever materialised; backward recomputes the probabilities from the saved log-sum-exp.
// Workspace (MemCategory::Workspace, freed on return), all linear in T: the forward converts k and v to
// fp32 (2 * B * kv_heads * T * hd floats, with T rounded up to 64 and hd to 16); the backward also q and
// dL/d(attn) (2 * B * q_heads * T * hd floats more) and one float per query; both add per-thread tiles
// of ~(4 * 64 * hd + 8192) floats.
#pragma once
#include <cstdint>

#include "kernels/common.h"

namespace hs::kernels {

struct AttentionShape {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
  // Packed documents (kernels/common.h; null: one document a sequence): query t attends to the keys of its own
  // document only, [t - positions[t], t].
  const int32_t* positions = nullptr;
};

// What the forward keeps for backward (MemCategory::Activations).
struct AttentionSaved {
  Buffer lse;   // [B, q_heads, T] fp32: log-sum-exp of the scaled, masked scores of each query
  Buffer attn;  // [B, T, q_heads, hd] in the storage type T: the attention output before the gate
};

// q, gate, out: [B, T, q_heads, hd]; k, v: [B, T, kv_heads, hd]. Query head h reads KV head
// h / (q_heads / kv_heads). saved == nullptr: inference (nothing is kept).
template <typename T>
void gated_attention_forward(const AttentionShape& shape, const T* q, const T* k, const T* v, const T* gate,
                             T* out, AttentionSaved* saved, MemoryAccountant& mem);

// Accumulates (+=) into dq, dgate [B, T, q_heads, hd] and dk, dv [B, T, kv_heads, hd] (fp32), given
// dout (fp32) and what the forward saved.
template <typename T>
void gated_attention_backward(const AttentionShape& shape, const T* q, const T* k, const T* v, const T* gate,
                              const AttentionSaved& saved, const float* dout, float* dq, float* dk, float* dv,
                              float* dgate, MemoryAccountant& mem);

// Defined in src/kernels/reference/ (hs_kernel_references: tests and benchmarks link it, the engine does not).
namespace reference {

// The whole score matrix of each (batch, head), softmax in R. attn ([B, T, q_heads, hd]) and lse
// ([B, q_heads, T]) are optional outputs (nullptr to skip).
template <typename R>
void gated_attention_forward(const AttentionShape& shape, const R* q, const R* k, const R* v, const R* gate,
                             R* out, R* attn = nullptr, R* lse = nullptr);

// Recomputes the forward and accumulates (+=) the gradients of sum(out * dout).
template <typename R>
void gated_attention_backward(const AttentionShape& shape, const R* q, const R* k, const R* v, const R* gate,
                              const R* dout, R* dq, R* dk, R* dv, R* dgate);

}  // namespace reference
}  // namespace hs::kernels
