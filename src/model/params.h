// Parameters in the stacked ("scanned") layout (docs/checkpoints.md): every tensor of the linear-attention
// ("local") layers carries two leading axes [block, local]; every tensor of the full-attention ("global") layer one
// leading axis [block]; when L is not a multiple of the cycle the trailing linear-attention layers form a
// remainder stack [remainder]. Routed-expert tensors keep the expert axis right after the stacking axes:
// local.mlp.experts.gate_up is [block, local, expert, 2I, H]. A model with a multi-token-prediction layer adds, after
// the remainder, the MTP decoder layers (full attention) as the stack [mtp_layers] named "mtp.layers.<per-layer
// name>" and its four tensors of its own, "mtp.fc.weight" [H, 2H] and three norms (docs/model.md).
// A layer sees its weights as a LayerWeights: views into the stacks, in the order of its ParamSpecs.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "core/collectives.h"
#include "core/tensor.h"
#include "model/config.h"

namespace hs::model {

enum class LayerKind { LinearAttention, FullAttention };
enum class StackGroup { Local, Global, Remainder, Mtp };
std::string group_name(StackGroup g);

struct ParamSpec {
  std::string name;   // e.g. "linear_attn.in_proj_qkv.weight", the per-layer name
  Shape shape;        // per-layer shape
  bool keep_fp32;     // stored in fp32 whatever the weight dtype (A_log, dt_bias)
  bool is_matrix;     // multiplied through matmul (cast to the compute dtype per sub-layer)
  bool weight_decay;  // AdamW decays it (matrices and embeddings, not norms/gates/biases)
};

// Indices into a layer's spec list. Both layer kinds start with the norms and end with the feed-forward.
namespace p {
enum Common { kInputNorm = 0, kPostNorm = 1 };
enum Linear { kQkv = 2, kZ, kB, kA, kConv, kALog, kDtBias, kGdnNorm, kOut, kLinearFfn };
enum Full { kQ = 2, kK, kV, kO, kQNorm, kKNorm, kFullFfn };
// Offsets from the layer's first feed-forward spec.
enum Moe { kRouter = 0, kGateUp, kDown, kSharedGate, kSharedUp, kSharedDown, kSharedExpertGate };
enum Dense { kMlpGate = 0, kMlpUp, kMlpDown };
}  // namespace p

std::vector<ParamSpec> layer_specs(const ModelConfig& c, LayerKind kind);
int ffn_offset(LayerKind kind);
// Globals: embed_tokens [V,H], norm [H], lm_head [V,H].
std::vector<ParamSpec> global_specs(const ModelConfig& c);
namespace g {
enum Global { kEmbed = 0, kFinalNorm, kLmHead };
// The MTP layer's tensors other than its decoder layer, in this order after the MTP stack.
enum Mtp { kMtpFc = 0, kMtpNormEmbedding, kMtpNormHidden, kMtpNorm };
}
// fc [H, 2H] (input [norm(embed(x_{t+1})) ; norm(h_t)]), pre_fc_norm_embedding, pre_fc_norm_hidden, norm [H]:
// named "mtp.<name>". Empty without an MTP layer.
std::vector<ParamSpec> mtp_specs(const ModelConfig& c);

// Routed-expert tensors (the ones expert parallelism splits and pieces are cut from), [experts, ...] per layer.
bool is_routed_expert(const ParamSpec& s);
// Sharded tensors are split over the ranks in units, each unit on its own: one expert of a routed-expert tensor,
// the layer's whole tensor otherwise. A run of consecutive experts can then be gathered (and its gradient
// reduce-scattered) without the rest of the layer, its shards being contiguous on every rank. Units per layer:
int64_t shard_units(const ParamSpec& s);
// Elements per layer that one rank holds: shard_units x ceil(unit elements / shards).
int64_t layer_shard_elems(const ParamSpec& s, int64_t shards);

struct LayerWeights {
  LayerKind kind;
  std::vector<TensorView> t;  // in layer_specs order
  int64_t shards = 1;         // > 1: each view points at this rank's shard and carries the per-layer (gathered) shape
  const TensorView& operator[](size_t i) const { return t[i]; }
};

// One stacked tensor.
struct StackedParam {
  std::string name;   // "local.linear_attn.in_proj_qkv.weight", "global.self_attn.q_proj.weight", "embed_tokens.weight"
  ParamSpec spec;
  Shape lead;         // stacking axes
  Tensor tensor;      // shape lead ++ spec.shape (unsharded), or this rank's 1-D shard
  Shape full_shape;   // lead ++ spec.shape
  DType dtype;
  // Non-empty when the stack's layers do not lie in one block of memory (weights used in place from a per-layer
  // checkpoint, e.g. a memory-mapped Hugging Face file): layers[i] is layer i of the stack (row-major over lead), of
  // spec.shape, memory the set does not own; tensor is then empty. layer() and nbytes() see through it.
  std::vector<void*> layers = {};
};

// Where a decoder layer lives in the stacks.
struct LayerSlot {
  StackGroup group;
  int64_t block;  // block index (or remainder index)
  int64_t local;  // position among the local layers (0 for global / remainder)
  LayerKind kind() const {
    return group == StackGroup::Global || group == StackGroup::Mtp ? LayerKind::FullAttention
                                                                   : LayerKind::LinearAttention;
  }
};
// Hugging Face layer index <-> slot: layer i = block*cycle + position, remainder layers follow the blocks.
LayerSlot slot_of_layer(const ModelConfig& c, int64_t layer);
int64_t layer_of_slot(const ModelConfig& c, const LayerSlot& s);

// A full set of model tensors in the stacked layout: parameters or optimizer moments (in the given dtype), or
// gradients (fp32) shaped like them. Tensors the spec keeps in fp32 (keep_fp32) are fp32 in every set.
class ParamSet {
 public:
  ParamSet() = default;
  // shards > 1: fully-sharded data parallelism; each layer's slice of a stacked tensor is split over the ranks on its
  // own (unit by unit, shard_units), so a tensor holds lead ++ [layer_shard_elems] elements on this rank.
  ParamSet(const ModelConfig& c, DType weight_dtype, MemoryAccountant& mem, MemCategory cat, bool zero,
           int64_t shards = 1);
  int64_t shards() const { return shards_; }

  const ModelConfig& config() const { return cfg_; }
  std::vector<StackedParam>& all() { return params_; }
  const std::vector<StackedParam>& all() const { return params_; }
  const StackedParam* find(const std::string& name) const;
  LayerWeights layer(const LayerSlot& s) const;
  const TensorView& global(g::Global which) const { return params_[static_cast<size_t>(which)].tensor.view(); }
  const StackedParam& global_param(g::Global which) const { return params_[static_cast<size_t>(which)]; }
  // The MTP layer's own tensors (config().mtp_layers > 0 only); its decoder layer is layer({StackGroup::Mtp, i, 0}).
  const StackedParam& mtp_param(g::Mtp which) const { return params_.at(mtp_index(which)); }
  size_t mtp_index(g::Mtp which) const { return mtp_first_ + static_cast<size_t>(which); }  // into all()
  int64_t numel() const;
  size_t nbytes() const;
  void zero();

 private:
  ModelConfig cfg_;
  int64_t shards_ = 1;
  std::vector<StackedParam> params_;  // globals first, then local, global, remainder, mtp stacks in spec order, then
                                      // the MTP layer's own tensors
  size_t first_[4] = {0, 0, 0, 0};    // index of each group's first tensor
  size_t mtp_first_ = 0;              // index of mtp.fc.weight
};

// Deterministic initialisation from a seed: each tensor's values depend only on (seed, tensor name, index), so
// the result is independent of thread count and allocation order. Matrices N(0, 0.02); zero-centred norm weights
// 0 (scale 1); the gated norm weight 1; A_log = log(U(1,16)); dt_bias = log(expm1(U(0.001, 0.1))) (softplus^-1 of
// a step in [0.001, 0.1], as Mamba-2 does); conv weights U(-1/sqrt(K), 1/sqrt(K)).
void init_params(ParamSet& params, uint64_t seed);

// Between a full set and a sharded set of the same model and dtypes: this rank's shards cut out of the full set (the
// padding zeroed), and the full set put together from every rank's shards (a collective: every rank of `group`
// calls it, and every rank receives the full set).
void copy_shard(const ParamSet& full, ParamSet& shard, int64_t rank);
void gather_full(const ParamSet& shard, ParamSet& full, Collectives& group);

}  // namespace hs::model
