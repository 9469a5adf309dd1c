// The decoder layer's forward recipe, stated once (docs/architecture.md, "The layer recipe"). Two executors run it:
// model/layer.cpp over whole sequences (training, prefill, the layered decode path) and infer/fused_step.cpp over
// the few rows of a decode step inside one OpenMP team. What is the same in both lives here: which weight multiplies
// which activation into which, with what shape (the product tables), and the pointwise stages between the products.
// What differs stays with each executor: how a product runs (oneDNN's matmul vs the team's gemv jobs, quantized
// blocks), the conv and the delta rule over a sequence (chunked, kept for backward) against one step per row (with
// speculative chaining), the attention kernel, the feed-forward's execution (expert pieces and exchange vs routed
// gemv jobs), and what is kept for the backward.
#pragma once
#include <array>
#include <cstdint>

#include "model/config.h"
#include "model/params.h"

namespace hs::model::recipe {

// The activations a product reads or writes; each executor maps them to its own buffers.
enum class Act : uint8_t {
  kXn,     // the input norm's output [rows, H]
  kQkv,    // GDN: the conv's input [rows, conv_dim] (channels q | k | v)
  kZ,      // GDN: the output gate [rows, value_dim]
  kB,      // GDN: beta's logits [rows, v_heads]
  kA,      // GDN: the decay's input [rows, v_heads]
  kY,      // GDN: the gated norm's output [rows, value_dim]
  kQGate,  // attention: [rows, q_heads, 2 head_dim] (per head: head_dim query values, then head_dim gate values)
  kKRaw,   // attention: keys before their norm [rows, kv_heads * head_dim]
  kV,      // attention: values [rows, kv_heads * head_dim]
  kAttn,   // attention: the gated attention's output [rows, q_heads * head_dim]
  kMix,    // the mixer's output [rows, H], added to the residual
};

// out [rows, cols] = in [rows, depth] W^T, W the layer's weight number `weight` (layer_specs order) of shape
// [cols, depth].
struct Product {
  int weight;
  Act in, out;
  int64_t cols, depth;
};

// Gated DeltaNet: in_proj, four products of the normed input; out_proj of the gated norm's output.
inline std::array<Product, 4> gdn_in(const ModelConfig& c) {
  return {{{p::kQkv, Act::kXn, Act::kQkv, c.conv_dim(), c.hidden},
           {p::kZ, Act::kXn, Act::kZ, c.value_dim(), c.hidden},
           {p::kB, Act::kXn, Act::kB, c.v_heads, c.hidden},
           {p::kA, Act::kXn, Act::kA, c.v_heads, c.hidden}}};
}
inline Product gdn_out(const ModelConfig& c) { return {p::kOut, Act::kY, Act::kMix, c.hidden, c.value_dim()}; }

// Gated attention: the query-and-gate, key and value products of the normed input; o_proj of the attention's output.
inline std::array<Product, 3> attention_in(const ModelConfig& c) {
  return {{{p::kQ, Act::kXn, Act::kQGate, c.q_heads * 2 * c.head_dim, c.hidden},
           {p::kK, Act::kXn, Act::kKRaw, c.kv_heads * c.head_dim, c.hidden},
           {p::kV, Act::kXn, Act::kV, c.kv_heads * c.head_dim, c.hidden}}};
}
inline Product attention_out(const ModelConfig& c) {
  return {p::kO, Act::kAttn, Act::kMix, c.hidden, c.q_heads * c.head_dim};
}

// GDN after the conv (q, k, v its SiLU output, b and a in_proj's): qn = l2norm(q) / sqrt(dk), kn = l2norm(k) (rstd of
// each [rows * k_heads]), and the gates beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) [rows * v_heads].
// conv and a_log, dt_bias: the layer's weights as fp32 vectors.
template <typename T>
void gdn_norms_gates(const ModelConfig& c, const float* a_log, const float* dt_bias, const T* q, const T* k, const T* b,
                     const T* a, T* qn, T* kn, float* rstd_q, float* rstd_k, float* beta, float* g, int64_t rows);

// Attention after its products: the query and the gate split out of qg (Act::kQGate) into q_raw and gate
// [rows, q_heads, head_dim]; then the q and k norms (per head, fp32 weights q_norm, k_norm [head_dim]) into qn, kn
// with their rstd, and RoPE on both at `positions` [rows]. Two calls, so that qg can be freed in between.
template <typename T>
void split_query_gate(const ModelConfig& c, const T* qg, T* q_raw, T* gate, int64_t rows);
template <typename T>
void attention_norms_rope(const ModelConfig& c, const float* q_norm, const float* k_norm, const T* q_raw,
                          const T* k_raw, T* qn, T* kn, float* rstd_q, float* rstd_k, const int32_t* positions,
                          int64_t rows);

// The residual after the mixer and the post-attention norm in one pass: h_mid = h + mix, xn = norm(h_mid) (rstd).
template <typename T>
void residual_post_norm(const ModelConfig& c, const float* post_norm, const T* h, const T* mix, T* h_mid, T* xn,
                        float* rstd, int64_t rows);

}  // namespace hs::model::recipe
