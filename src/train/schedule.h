// The step schedule: the decoder run as a nested block scan (for each block, an inner loop over its local
// linear-attention layers, then its global full-attention layer; then the remainder layers), forward then backward
// in reverse, with a selectable rematerialisation policy. The same code runs real steps and, with a planning-mode
// MemoryAccountant, the memory plan (shapes only).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/collectives.h"
#include "core/memory.h"
#include "kernels/moe.h"
#include "model/params.h"

namespace hs::train {

// none: every intermediate of every layer is kept for backward. block: only each block's input is kept and the
// whole block is recomputed in backward (its layers' intermediates and weight casts live together). sublayer: each
// layer's input is kept and one layer at a time is recomputed.
enum class RematPolicy { None, Block, Sublayer };
std::string remat_name(RematPolicy p);
RematPolicy parse_remat(const std::string& s);  // throws std::invalid_argument
// The default of StepOptions::pack_weights for a run on this machine: HS_PACKED_WEIGHTS=on|off (core/settings.h),
// else off (packing did not measure faster on an AVX-512 machine without AMX: bench/README.md). Throws
// std::invalid_argument for another value.
bool packed_weights_default();

// 256 MiB: the 397B model's routed experts (24 MiB each in bf16) go 10 to a piece, so each collective still moves
// well over a megabyte per rank at 256 ranks.
constexpr size_t kDefaultGatherPieceBytes = size_t{256} << 20;

// Takes each gradient of a step as soon as it is complete on this rank (summed over the FSDP group and
// reduce-scattered into this rank's shard, when sharded): StepOptions::update. The schedule frees the gradient right
// after the call, so no full gradient set lives across the step. Called in the order the backward finishes them:
// the LM head, the final norm, the layers in reverse scan order, the embedding; in planning mode too (null data).
class GradientSink {
 public:
  virtual ~GradientSink() = default;
  // The layer's gradients, fp32, in layer_specs order, shaped like params.layer(s) (sharded: each view's data is
  // this rank's layer_shard_elems elements).
  virtual void layer(const model::LayerSlot& s, const model::LayerWeights& grads) = 0;
  // A global tensor's gradient: as many elements as params.global_param(which).tensor.
  virtual void global(model::g::Global which, float* grad) = 0;
};

// How training windows meet the documents of the data (train --packing; docs/model.md, "Packed documents"):
// Documents: each window's positions restart after every document separator, and the model restarts with them (no
// token sees another document, no loss across a boundary); Stream: a window is one sequence whatever it holds (the
// behaviour before packing, bit for bit); Auto: Documents when the data has documents (a token file of several), else
// Stream.
enum class Packing { Auto, Stream, Documents };
std::string packing_name(Packing p);
Packing parse_packing(const std::string& s);  // throws std::invalid_argument

struct StepOptions {
  RematPolicy remat = RematPolicy::Sublayer;
  DType compute = DType::BF16;
  // The data-parallel group the parameters are sharded over (fully-sharded data parallelism). Null: one process.
  // When params.shards() > 1, each sub-layer's weights are all-gathered into a temporary just before it runs (and
  // again for its recompute) and its gradients are reduce-scattered right after its backward.
  Collectives* comm = nullptr;
  // Expert parallelism: routed experts split over this many ranks of the FSDP group (model::LayerContext), the
  // tokens' rows exchanged within ep_group (its ranks: FSDP ranks r with the same r / expert_parallel; null when
  // planning: a virtual group of that size).
  int64_t expert_parallel = 1;
  // The ranks that share the global batch (every rank of a run; the FSDP group is one of its parts): target counts,
  // loss sums and router statistics are summed over it, so each rank's gradients are its share of the global
  // mean's. Null: comm.
  Collectives* batch_group = nullptr;
  // With sharded parameters, start the next sub-layer's gathers when one starts (they run while it computes) and
  // leave each sub-layer's gradient reduce-scatter in flight while the next backward computes: one more sub-layer's
  // gathered weights and full gradients live at once. No effect unsharded.
  bool prefetch = false;
  // Routed-expert weights are gathered (or cast), and their gradients reduce-scattered, in pieces of consecutive
  // experts of at most this many bytes in the compute dtype (model::LayerContext::piece_bytes; 0: a whole layer).
  size_t gather_piece_bytes = kDefaultGatherPieceBytes;
  // The LM head and the embedding ([vocab, hidden] each) in vocabulary pieces of at most this many bytes in the
  // compute dtype (rows [a, b): the flat range [a hidden, b hidden) of the FSDP layout, gathered and reduce-scattered
  // with the range collectives), when the tensor is larger and there is something to cut: a gather (sharded), or a
  // cast (the LM head stored in another dtype than the compute dtype). 0: whole tensors. The LM head's loss is then
  // a log-sum-exp streamed over the pieces (kernels::lm_head_xent_pieced: the same math, other rounding); the
  // embedding's pieces give the same bits as the whole table. A parameter of its own, not gather_piece_bytes, so
  // that experts in pieces stay bit-identical to whole layers.
  size_t vocab_piece_bytes = kDefaultGatherPieceBytes;
  // Non-null: every gradient goes to this sink as soon as it is complete and is freed after it (train
  // --update-in-backward: AdamW per shard in the backward, train::InBackwardAdamW). forward_backward then neither
  // makes nor fills a gradient set (*grads must be empty: there is nothing to accumulate into).
  GradientSink* update = nullptr;
  Collectives* ep_group = nullptr;
  // Each sub-layer's matrix weights reordered into oneDNN's packed layout for its products (model::LayerContext::
  // pack_weights, train --packed-weights): the same bits, the packed forms accounted as weight casts.
  bool pack_weights = false;
  // The delta rule's products with bf16 inputs and fp32 sums (model::LayerContext::delta_rule_bf16_products, train
  // --delta-rule-products bf16): bf16 compute on a CPU with AVX-512-BF16 only, else fp32.
  bool delta_rule_bf16_products = false;
  // Multi-token prediction (train --mtp-weight; docs/model.md): > 0 adds this weight times the MTP layer's mean
  // cross-entropy of x_{t+2} to the loss (the model must have an MTP layer). 0: the MTP layer is not run.
  double mtp_weight = 0;
  // The batches' packing. Over shapes (the planner) Documents counts the batch's positions; Auto counts them not
  // (a run resolves Auto before it plans: train's command line does).
  Packing packing = Packing::Auto;
};

struct StepResult {
  double loss = 0;  // ce + router_aux_coef * aux
  double ce = 0;    // mean cross-entropy over counted targets (nats)
  double aux = 0;   // load-balance loss (0 for dense models)
  double ce_sum = 0;
  int64_t count = 0;  // counted targets
  double mtp_ce = 0;       // with StepOptions::mtp_weight > 0: the MTP layer's mean cross-entropy (in loss, weighted)
  int64_t mtp_count = 0;   // its counted targets
  std::vector<kernels::RouterStats> router;  // per layer, in scan order
};

// One batch: inputs and targets are [batch, seq] token ids; targets < 0 are ignored.
struct Batch {
  const int32_t* inputs;
  const int32_t* targets;
  int64_t batch, seq;
  // Packed documents (docs/model.md, "Packed documents"): [batch, seq], each token's position within its document,
  // 0 where one starts (always at a sequence's first token; kernels/common.h). The conv, the delta rule and attention
  // restart at every start and RoPE counts from it. The targets must already ignore (-1) the next document's first
  // token (train::sample_batch does). Null: each sequence is one document (stream).
  const int32_t* positions = nullptr;
  // Over shapes (inputs null): whether the run's batches carry positions (their buffer is part of the plan).
  bool documents = false;
  bool has_documents() const { return positions != nullptr || documents; }
};

// Forward and backward. The gradients (fp32, MemCategory::Gradients) are added to *grads when it already holds a
// set of this model's layout (gradient accumulation; AdamWOptimizer::step leaves it zeroed, so a training loop
// keeps one set and never clears it); otherwise a zeroed set is allocated into *grads first. With opt.update the
// gradients go to the sink instead (grads may be null; a set in *grads is refused: accumulating across calls and
// consuming each gradient within the call cannot both hold); the sink may then change `params` as the backward goes
// (each layer's after its last use in the step).
StepResult forward_backward(const model::ParamSet& params, const Batch& b, const StepOptions& opt,
                            MemoryAccountant& mem, std::unique_ptr<model::ParamSet>* grads);
// Forward only: the loss, and when `logits` is given the fp32 logits [batch, seq, vocab].
StepResult forward_only(const model::ParamSet& params, const Batch& b, DType compute, MemoryAccountant& mem,
                        float* logits = nullptr, Collectives* comm = nullptr);

// FSDP groups smaller than the world: every gradient shard summed over the replicas of this rank's shards (rank
// order), one tensor at a time through an accounted scratch (MemCategory::Workspace, "replica_all_reduce") of
// Collectives::all_reduce_scratch_elems floats, so that the plan sees it as the run does.
void sum_over_replicas(model::ParamSet& grads, Collectives& replicas, MemoryAccountant& mem);

// Refuses (std::invalid_argument) routed experts split over `ep` ranks that do not divide the experts or the FSDP
// group of `shards` ranks (forward_backward's own check, which a run also makes before it starts).
void check_expert_parallel(const model::ModelConfig& c, int64_t ep, int64_t shards);

// The layers in scan order (block by block: local layers then the global layer; then the remainder).
std::vector<model::LayerSlot> scan_order(const model::ModelConfig& c);

}  // namespace hs::train
