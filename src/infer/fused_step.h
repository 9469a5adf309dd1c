// One decode step (one token for each of B <= kGemvMaxRows sequences) through every layer and the head inside a
// single OpenMP parallel region. The layer-by-layer path (model::layer_forward) forks and joins ~20 times per layer
// on a token's rows, and at decode shapes those fork/joins (a futex wake-up each under OMP_WAIT_POLICY=passive) and
// the small loops between them cost more than streaming the weights. Here the threads enter once per step and split
// the work themselves, with a spinning barrier between dependent phases:
//  * products (projections, router, shared expert, the routed experts' rows, the LM head): the weight rows of all the
//    products of a phase are cut into chunks of ~kFusedChunkBytes that threads take as they come free (kernels::
//    gemv_rows), so a thread descheduled on a shared machine leaves its part to the others;
//  * per-row work (norms, conv window, gates, RoPE, the cache write, the residual adds) by the thread owning the row;
//  * per-head work (delta-rule step + gated norm, cached attention) split over (row, head) units;
//  * the MoE's routing and combine on one thread while the others wait.
// Every element is computed by the same kernel code as the layered path, in the same order, whatever the thread that
// computes it, so a step's logits are bit-identical to the layered path's and to themselves at any thread count
// (tests/decode_test.cpp: Decode.FusedStepIsBitIdenticalToTheLayeredPath).
//
// Eligible (FusedStep::supported): unsharded weights whose matrices (routed experts included) and LM head are stored
// in the compute dtype, so every product reads the weights where they lie. The decoder takes the layered path
// otherwise.
//
// Quantized weights (a GGUF model read by load_gguf_weights, fp32 compute): the matrices that QuantWeights holds run
// on their blocks (kernels::quant_gemv_rows; each product's activation rows are quantized first by one thread, a
// phase of its own), the routed experts' rows of the routed experts only, the embedding's rows dequantized on
// lookup; the other matrices (converted to fp32) on gemv as before.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/memory.h"
#include "model/layer.h"
#include "infer/weights.h"
#include "model/params.h"

namespace hs::infer {

inline constexpr int64_t kFusedChunkBytes = int64_t{1} << 15;

// The wall time of the fused step's phases as thread 0 sees them (each from the end of the phase before; the first
// from before the parallel region, so it holds the fork), summed by phase name ("gdn.in_proj", "moe.gate_up",
// "lm_head", ...) over the steps run while timing is on: a measuring aid for bench/decode_step_bench, meaningful on
// a quiet machine (a descheduled thread 0 charges the delay to the phase it was in and ~0 to the phases the others
// finished meanwhile). Off by default; on, it costs a clock read per phase. Turning it on or off clears them; do not
// toggle it while a step runs.
struct FusedPhaseTime {
  std::string name;
  double seconds = 0;
  int64_t count = 0;  // phases of that name timed
};
void fused_step_timing(bool on);
std::vector<FusedPhaseTime> fused_step_phase_times();  // in the order first seen

// Test aid: the quantized weights' products computed instead of quant_gemv from each weight row dequantized to fp32
// (dequantize_row) times the activations, in double: Exact, the activations as they are (isolates the storage and
// its plumbing from the activations' Q8 rounding); RoundedActivations, their Q8 values (dequantize_quantized_row:
// what quant_gemv multiplies, so only its fp32 sums differ). Off by default; slow; not while a step runs.
enum class QuantReference { Off, Exact, RoundedActivations };
void fused_step_quant_reference(QuantReference r);

// What a step may do beyond one token per sequence (speculative decoding, src/infer/speculative.h).
struct StepExtras {
  // Chained rows: several consecutive positions of one sequence in one step. The Gated DeltaNet layers' conv window
  // and delta-rule state of row r are those of slot state_slots[r] (null: slots[r]); when state_from[r] >= 0 they are
  // first copied from slot state_from[r], as the row before it in its group left them. Rows come in groups of `chain`
  // consecutive rows, run in order within a group (state_from[r] is the state slot of a row earlier in the group), so
  // each row sees exactly the state a one-row step at its position would see. The attention layers' rows read and
  // write their slots' caches at their positions (a group's rows share a slot: row r attends to positions up to its
  // own, written by the rows before it in the same step).
  const int32_t* state_slots = nullptr;
  const int32_t* state_from = nullptr;
  int64_t chain = 1;
  const void* input = nullptr;  // [B, H] in T: the first layer's input instead of the ids' embedding
  void* hidden = nullptr;       // [B, H] in T: the final norm's output (what the MTP layer reads, docs/model.md)
};

template <typename T>
class FusedStep {
 public:
  static bool supported(const model::ParamSet& params, DType compute);
  // The small vectors (norm weights, conv taps, gates) are cast to fp32 once here when they are stored in bf16
  // (MemCategory::WeightCasts, live as long as this object).
  // final_norm: the norm before the LM head (null: the model's; the MTP layer runs with mtp.norm).
  FusedStep(const model::ParamSet& params, const std::vector<model::LayerSlot>& order,
            std::vector<model::LayerCache>& caches, MemoryAccountant& mem, const QuantWeights* quant = nullptr,
            const TensorView* final_norm = nullptr);
  ~FusedStep();
  // rows: B sequences in slots[b] at positions[b] with input ids[b]; logits fp32 [B, V] (null: none). In planning
  // mode only the per-step workspace is allocated.
  void run(int64_t B, const int32_t* slots, const int32_t* positions, const int32_t* ids, float* logits,
           const StepExtras* extras = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hs::infer
