// The kernels of incremental decoding (docs/model.md, "Decoding"): the pieces of the Gated DeltaNet and attention
// layers that carry state from one call to the next. Sequences live in slots of per-layer caches; batch row b of a
// call belongs to the sequence in slot slots[b]. Math in fp32 (storage types as in the other kernels).
//
// Their oracles are the full-sequence references (reference::causal_conv_silu_forward,
// reference::delta_rule_recurrent_forward, reference::gated_attention_forward): a sequence fed to these kernels a
// piece or a token at a time must give what the reference gives on the whole sequence (tests/decode_kernels_test.cpp).
#pragma once
#include <cstdint>

#include "kernels/common.h"
#include "kernels/delta_rule.h"

namespace hs::kernels {

// The causal conv + SiLU of conv.h over x [batch, seq, channels] that continue the sequences of their slots: taps
// before the first token of x read the slot's window (the sequence's last width-1 inputs, oldest first, zeros at
// sequence start), window [slots, width-1, channels] in T. Afterwards each window holds the last width-1 inputs of
// its sequence, x included.
template <typename T>
void causal_conv_silu_cached(const T* x, const float* w, const ColumnBlocks<T>& y, T* window, const int32_t* slots,
                             int64_t batch, int64_t seq, int64_t channels, int64_t width);

// One token of the gated delta rule (seq must be 1): per (batch row, value head), with S = state[slots[b], h]
// ([dk, dv] fp32): S = exp(g) S; delta = beta (v - S^T k); S = S + k delta^T; o = S^T q. Layouts as in
// delta_rule_forward; state [slots, Hv, dk, dv].
template <typename T>
void delta_rule_step(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta, const float* g,
                     T* o, float* state, const int32_t* slots);

// The same for the (row, head) units u in [u0, u1) (u = b * v_heads + h) on the calling thread alone, no OpenMP: for a
// caller that runs its own threads (src/infer/fused_step.h). Each unit has the bits delta_rule_step gives it.
template <typename T>
void delta_rule_step_range(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta,
                           const float* g, T* o, float* state, const int32_t* slots, int64_t u0, int64_t u1);

// A KV cache: per slot and KV head, `capacity` positions of hd values in T ([slots, kv_heads, capacity, hd]).
struct KvCacheShape {
  int64_t kv_heads, head_dim, capacity;
  int64_t slot_stride() const { return kv_heads * capacity * head_dim; }
};

// Writes k, v [batch, seq, kv_heads, hd] (after k_norm and RoPE) at the tokens' positions of their slots.
// Throws std::out_of_range when a position is outside [0, capacity).
template <typename T>
void kv_cache_write(const KvCacheShape& c, const T* k, const T* v, T* kcache, T* vcache, const int32_t* slots,
                    const int32_t* positions, int64_t batch, int64_t seq);

// Gated attention of queries q, gate [batch, seq, q_heads, hd] against their slots' caches: the token at position p
// attends to cached positions 0..p (which must have been written), softmax(q k^T hd^-0.5) v in fp32, then
// out = attn * sigmoid(gate). Query head h reads KV head h / (q_heads / kv_heads). Workspace: one score row of
// `capacity` floats per thread.
template <typename T>
void attention_cached_forward(const KvCacheShape& c, int64_t q_heads, const T* q, const T* gate, const T* kcache,
                              const T* vcache, T* out, const int32_t* slots, const int32_t* positions, int64_t batch,
                              int64_t seq, MemoryAccountant& mem);

// The same for the (row, query head) units u in [u0, u1) (u = n * q_heads + h) on the calling thread alone, no
// OpenMP and no allocation: scores holds `capacity` floats. Each unit has the bits attention_cached_forward gives it.
template <typename T>
void attention_cached_range(const KvCacheShape& c, int64_t q_heads, const T* q, const T* gate, const T* kcache,
                            const T* vcache, T* out, const int32_t* slots, const int32_t* positions, int64_t seq,
                            int64_t u0, int64_t u1, float* scores);

}  // namespace hs::kernels
