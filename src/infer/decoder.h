// Incremental decoding of a hybrid model (docs/model.md, "Decoding"): the decoder layers of src/model run with their
// per-layer caches (LayerCache: the causal-conv window and delta-rule state of each Gated DeltaNet layer, the keys
// and values of each attention layer), so a prompt is prefilled with the chunked kernels, in pieces that carry the
// state when it is long, and each new token then costs one pass over the weights and the caches.
//
// Sequences live in slots. All caches are allocated when the decoder is made, for `slots` sequences of up to
// `capacity` positions each (MemCategory::Activations, tagged "cache.*"): decoding a token allocates nothing that
// outlives the call; its workspace is the same for every token.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/memory.h"
#include "infer/fused_step.h"
#include "kernels/quant_gemv.h"
#include "model/layer.h"
#include "model/params.h"

namespace hs::infer {

class Decoder {
 public:
  // compute: the activation dtype (F32 or BF16); weights stored in another dtype are cast per layer call, so decoding
  // reads only the routed experts' weights when the weights are stored in the compute dtype. piece: prefill tokens per
  // layer pass (longer prompts are fed in pieces).
  //
  // quant: the matrices kept in a GGUF file's blocks (load_gguf_weights; their ParamSet views hold no data). Compute
  // must be fp32; every step runs fused (the layered path cannot read them), and a prefill runs in pieces, layer by
  // layer with the chunked kernels and batched products on the blocks (infer/quant_prefill.h, kernels::quant_matmul).
  //
  // draft: positions past the next one that verify() may feed a slot in one step (speculative decoding, 0: none):
  // each slot gets `draft` more conv windows and delta-rule states, which hold the recurrent part after each of them.
  Decoder(const model::ParamSet& params, DType compute, int64_t slots, int64_t capacity, MemoryAccountant& mem,
          int64_t piece = 512, const QuantWeights* quant = nullptr, int64_t draft = 0);
  // The fused step keeps references into the caches: a Decoder stays where it was made.
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  int64_t slots() const { return slots_; }
  int64_t capacity() const { return capacity_; }
  int64_t length(int64_t slot) const { return length_.at(static_cast<size_t>(slot)); }
  const model::ModelConfig& config() const { return cfg_; }
  // Bytes of the attention layers' key/value caches and of the Gated DeltaNet layers' conv windows + states.
  size_t kv_cache_bytes() const;
  size_t recurrent_state_bytes() const;
  // Empties a slot: zero conv windows and states (cached keys are overwritten before they are read).
  void reset(int64_t slot);
  // Continues the sequence of `slot` with `ids`. logits: fp32 [ids.size(), V] when all_logits, else [V] for the last
  // id. Throws std::out_of_range when the sequence would pass the capacity or an id is outside the vocabulary.
  // hidden: when given, [ids.size(), H] in the compute dtype, the final norm's output at each id (what the MTP layer
  // reads).
  void prefill(int64_t slot, std::span<const int32_t> ids, float* logits, bool all_logits = false,
               void* hidden = nullptr);
  // One token for each of the (distinct) slots, all at once; logits fp32 [slots.size(), V]. Up to kGemvMaxRows
  // slots at a time run as one fused step (infer/fused_step.h) when the weights allow it, more in groups of that size;
  // up to kGemvMaxRows slots the logits are bit-identical to the layered path's either way (past it the layered
  // path's products are oneDNN's, the fused path's groups gemv's: equal within rounding, not to the bit).
  void step(std::span<const int32_t> slots, std::span<const int32_t> ids, float* logits);
  // Speculative verification: n (1 to draft + 1) consecutive ids for each of the (distinct) slots, ids [slots.size()
  // * n] (slot i's at i * n), fed at the slot's next n positions in one fused step per group of kGemvMaxRows rows
  // (whole slots). Each position is computed exactly as step() would compute it had the ids before it been fed one
  // step at a time: the same kernels in the same order (products of a few rows have the bits of one-row products), so
  // logits [slots.size() * n, V] and hidden (optional, [slots.size() * n, H] in the compute dtype, as prefill's) are
  // step()'s, bit for bit. The slot's length does not move: accept(slot, m) follows for every slot, keeping the first
  // m of the n positions (their keys and values stay; the conv window and delta-rule state become those after the
  // m-th id; positions past them are overwritten later). Needs the fused step (fused()); throws
  // std::invalid_argument otherwise and std::out_of_range as step() does (the capacity must hold all n positions).
  void verify(std::span<const int32_t> slots, int64_t n, std::span<const int32_t> ids, float* logits,
              void* hidden = nullptr);
  void accept(int64_t slot, int64_t m);
  int64_t draft() const { return draft_; }
  // Whether step() runs fused (when the weights allow it; default on unless HS_DECODE_FUSED=0). Tests and the
  // bench compare both paths.
  void set_fused(bool on) { use_fused_ = on; }
  bool fused() const { return (use_fused_ || quant_) && (fused32_ || fused16_); }
  bool quantized() const { return quant_ != nullptr; }
  // A quantized model's prefill: in pieces through quant_matmul (Chunked, the default; `how` its products' way, Auto
  // unless a test or benchmark forces one), or a fused step per token (TokenByToken: the reference the chunked
  // prefill is tested against, and what every prefill was before it).
  enum class QuantPrefill { Chunked, TokenByToken };
  void set_quant_prefill(QuantPrefill p, kernels::QuantMatmul how = kernels::QuantMatmul::Auto) {
    quant_prefill_ = p;
    quant_matmul_ = how;
  }

  // Snapshots of a slot's caches, for a prefix cache (src/serve/prefix_cache.h): the recurrent part (every Gated
  // DeltaNet layer's conv window and delta-rule state, which sum up the whole sequence) and the attention layers'
  // keys and values of a range of positions. A sequence prefilled to position p, saved, and restored into any slot
  // (its keys and values of [0, p) and its recurrent part at p) continues exactly as the original would: the same
  // bits, provided later prefills run in the same pieces.
  size_t recurrent_bytes_per_slot() const;
  size_t kv_bytes_per_position() const;
  // Writes the slot's recurrent part (recurrent_bytes_per_slot() bytes) to out.
  void save_recurrent(int64_t slot, void* out) const;
  // Writes the keys and values of positions [from, to) (kv_bytes_per_position() per position) to out.
  void save_kv(int64_t slot, int64_t from, int64_t to, void* out) const;
  // Reads keys and values of positions [from, to) written by save_kv.
  void load_kv(int64_t slot, int64_t from, int64_t to, const void* in);
  // Reads a recurrent part written by save_recurrent and sets the slot's length to `length`, the position it was
  // saved at (the slot's keys and values of [0, length) must have been loaded).
  void load_recurrent(int64_t slot, const void* in, int64_t length);

 private:
  template <typename T>
  void run(int64_t batch, int64_t seq, const int32_t* slots, const int32_t* ids, float* logits, bool all_logits,
           void* hidden = nullptr);
  void run_quant(int64_t seq, const int32_t* ids, float* logits, bool all_logits);
  void check_step(std::span<const int32_t> slots, int64_t n, std::span<const int32_t> ids);
  int32_t state_slot(int64_t slot, int64_t j) const {  // the recurrent part after position j of a verification
    return static_cast<int32_t>(j == 0 ? slot : slots_ + slot * draft_ + j - 1);
  }

  const model::ParamSet& params_;
  const model::ModelConfig& cfg_;
  DType compute_;
  int64_t slots_, capacity_, piece_, draft_ = 0, state_slots_ = 0;
  MemoryAccountant& mem_;
  std::vector<model::LayerSlot> order_;
  std::vector<model::LayerCache> caches_;  // per layer, in scan order
  std::vector<int64_t> length_;            // positions filled per slot
  std::vector<int64_t> pending_;           // per slot: positions verified and not yet accepted
  std::vector<int32_t> positions_, row_slots_;  // per-call scratch, sized once
  std::unique_ptr<FusedStep<float>> fused32_;
  std::unique_ptr<FusedStep<bf16>> fused16_;
  bool use_fused_ = true;
  const QuantWeights* quant_ = nullptr;
  QuantPrefill quant_prefill_ = QuantPrefill::Chunked;
  kernels::QuantMatmul quant_matmul_ = kernels::QuantMatmul::Auto;
};

}  // namespace hs::infer
