// One decoder layer, the unit the step schedule runs and rematerialises: h_out = h_mid + FFN(norm(h_mid)),
// h_mid = h_in + Mixer(norm(h_in)), with Mixer = Gated DeltaNet (linear attention) or gated full attention as the
// layer is told by its LayerKind, and FFN = sparse MoE or dense SwiGLU. Both families run this same code: family
// differences live in the config and the checkpoint mapping.
#pragma once
#include <memory>
#include <vector>

#include "core/collectives.h"
#include "core/memory.h"
#include "distributed/weights.h"
#include "kernels/attention.h"
#include "kernels/delta_rule.h"
#include "kernels/matmul.h"
#include "kernels/mlp.h"
#include "kernels/moe.h"
#include "model/config.h"
#include "model/params.h"

namespace hs::model {

// What incremental decoding (src/infer) keeps per layer between calls. Sequences live in slots: batch row b of a call
// continues the sequence of slot LayerContext::slots[b], at the absolute positions LayerContext::positions.
struct LayerCache {
  Buffer conv;   // Gated DeltaNet: [slots, K-1, conv_dim] in T, the last K-1 pre-conv inputs (zeros at start)
  Buffer state;  // Gated DeltaNet: [slots, Hv, dk, dv] fp32, the delta-rule state (zero at start)
  Buffer k, v;   // attention: [slots, nKV, capacity, hd] in T, after k_norm and RoPE
  int64_t capacity = 0;
};

struct LayerContext {
  const ModelConfig& cfg;
  MemoryAccountant& mem;
  int64_t batch, seq;          // the layer sees batch*seq tokens
  const int32_t* positions;    // [batch*seq] token positions (0..seq-1 per sequence)
  Collectives* comm = nullptr; // gathers sharded weights (needed when the weights are sharded)
  // Expert parallelism: routed experts are split over this many ranks of the FSDP group (`ep_group`, below, the
  // ranks that exchange their tokens' rows: FSDP rank r is rank r % expert_parallel of it), so a sub-layer gathers
  // only the routed-expert weights its rank owns, from the shards every rank of the group holds, and exchanges its
  // tokens' rows (all-to-all) with the owners instead (kernels::MoeWeights::exchange, over ep_group:
  // distributed::TokenExchange).
  int64_t expert_parallel = 1;
  // A forward that saves for backward also keeps what its kernels' backwards would otherwise recompute (the delta
  // rule's per-chunk states): remat none, where nothing is recomputed and memory is traded for speed.
  bool keep_recomputables = false;
  // Decoding: the layer reads and advances these caches (the mixer's state); positions are absolute and given even
  // in planning mode (they choose the attention kernel). Null: every row is a whole sequence from position 0.
  LayerCache* cache = nullptr;
  const int32_t* slots = nullptr;
  // Routed-expert weights are gathered (or cast) in pieces of consecutive experts of at most this many bytes in the
  // compute dtype (gate_up and down together; at least one expert), just before the kernel reaches them, and their
  // gradients are reduce-scattered piece by piece: two pieces live at once (the next one's gather, or the previous
  // one's reduce-scatter, in flight). 0: the whole layer's experts are one piece.
  size_t piece_bytes = 0;
  // Expert parallelism: the expert_parallel ranks that exchange tokens (planning: a virtual group of that size).
  Collectives* ep_group = nullptr;
  // Training: the sub-layer's matrix weights are reordered into oneDNN's packed layout (kernels::PackedWeight) for
  // the products that read them: the forward's (x W^T) for the forward's duration, the backward's (dy W) for the
  // backward's, each accounted as MemCategory::WeightCasts. Decoding leaves it off (its products run on gemv).
  bool pack_weights = false;
  // Training: the delta rule's products take bf16 inputs (kernels::DeltaRuleProducts::Bf16, train
  // --delta-rule-products bf16) when the compute dtype is bf16 and the CPU has AVX-512-BF16; else fp32.
  bool delta_rule_bf16_products = false;
  // Training on packed documents: `positions` restart at 0 at every document start (kernels/common.h) and the
  // mixers restart with them (the conv's window, the delta rule's state, attention's keys); RoPE reads them either
  // way. False: each sequence is one document (and in decoding positions are absolute).
  bool documents = false;
  int64_t tokens() const { return batch * seq; }
  // The positions the mixers restart at: null unless `documents`.
  const int32_t* document_positions() const { return documents ? positions : nullptr; }
};

// A layer's weights as the kernels want them (distributed/weights.h): matrices in the compute dtype T, small vectors
// in fp32, in layer_specs order. Casts and all-gathered shards are temporaries of this sub-layer
// (MemCategory::WeightCasts); when the weights are unsharded and the storage dtype already matches, nothing is copied.
// The routed experts are not among them (null pointers): the MoE kernel takes them piece by piece
// (distributed::PiecedExperts, LayerContext::piece_bytes).
template <typename T>
using ComputeWeights = distributed::ComputeWeights<T>;
// Starts the gathers (or does the casts) and returns with the gathers in flight: the schedule starts the next
// sub-layer's while this one computes. compute_weights also waits.
template <typename T>
ComputeWeights<T> start_compute_weights(const ModelConfig& c, const LayerWeights& w, MemoryAccountant& mem,
                                        Collectives* comm);
template <typename T>
ComputeWeights<T> compute_weights(const ModelConfig& c, const LayerWeights& w, MemoryAccountant& mem,
                                  Collectives* comm);

// Everything a layer keeps between its forward and its backward (all accounted: MemCategory::Activations, and the
// weight casts). Unused members stay empty.
template <typename T> struct LayerSaved {
  ComputeWeights<T> weights;
  Buffer xn, rstd1, h_mid, x2, rstd2;                        // norms and the mid residual
  Buffer qkv, q, k, v, qn, kn, rstdq, rstdk, b, a, beta, g;  // Gated DeltaNet
  Buffer o, z, rstdg, y;
  kernels::DeltaRuleSaved delta;
  Buffer q_raw, k_raw, gate, vv, attn_out;                   // full attention (q/k after norm+rope in qn/kn)
  kernels::AttentionSaved attn;
  kernels::MoeSaved moe;
  kernels::SwigluSaved mlp;
};

// Runs the layer. With `saved` it keeps what backward needs; without, every intermediate is freed on return.
// `weights`, when given, are this layer's compute weights already started by start_compute_weights (taken over);
// otherwise they are made here. Returns the MoE router statistics of this layer (empty for a dense FFN) as a value.
template <typename T>
kernels::RouterStats layer_forward(const LayerContext& ctx, const LayerWeights& w, const T* h_in, T* h_out,
                                   LayerSaved<T>* saved, ComputeWeights<T>* weights = nullptr);
// Backward from dh_out (fp32 [tokens, H]); writes dh_in (fp32, not accumulated) and accumulates the parameter
// gradients into `grads` (fp32 views shaped like w). aux_dprob is the load-balance gradient per expert (or null).
template <typename T>
void layer_backward(const LayerContext& ctx, const LayerWeights& w, const LayerWeights& grads, const T* h_in,
                    const LayerSaved<T>& saved, const float* dh_out, float* dh_in, const float* aux_dprob);

}  // namespace hs::model
