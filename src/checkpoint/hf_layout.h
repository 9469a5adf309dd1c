// The Hugging Face layout of a Qwen3-Next / Qwen3.5 checkpoint expressed against the stacked layout: every HF tensor
// is a list of element runs, each run a contiguous span of the HF tensor that is a contiguous span of one stacked
// tensor. Import copies runs HF -> stacked, export copies them back, so the two directions are the exact inverse of
// each other by construction (pure index arithmetic: HF layer i = block * cycle + position).
//
// What the runs encode (docs/checkpoints.md, "Conversion traps"):
// * Qwen3-Next in_proj_qkvz [2*key_dim + 2*value_dim, H] interleaves per key head q(dk) k(dk) v(r*dv) z(r*dv): its
//   rows land in the plain in_proj_qkv [q all | k all | v all] and in_proj_z; in_proj_ba interleaves b(r) a(r) per
//   key head and lands in in_proj_b and in_proj_a.
// * Qwen3-Next per-expert gate_proj/up_proj [I, H] land in the fused gate_up_proj [E, 2I, H] (gate rows 0..I-1, up
//   rows I..2I-1 of expert e) and down_proj [H, I] in down_proj [E, H, I]; Qwen3.5 stores the fused tensors already.
// * conv1d [C, 1, K] and shared_expert_gate [1, H] are the stacked [C, K] and [H] with a unit axis.
#pragma once
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace hs::checkpoint {

enum class ExpertLayout { PerExpert, Fused };

struct ElementRun {
  size_t stacked;      // index into the stacked tensor list (ParamSet order)
  int64_t stacked_at;  // element offset in the stacked tensor
  int64_t hf_at;       // element offset in the HF tensor
  int64_t count;       // elements
};

struct HfTensor {
  std::string name;
  Shape shape;
  std::vector<ElementRun> runs;  // cover the HF tensor exactly once, in HF offset order
};

struct StackedTensor {
  std::string name;  // as in model::ParamSet: "local.linear_attn.in_proj_qkv.weight", "embed_tokens.weight", ...
  Shape shape;
};

struct HfLayout {
  std::vector<StackedTensor> stacked;
  std::vector<HfTensor> hf;
  std::string prefix;  // "model." or "model.language_model."
};

std::string hf_prefix(model::Family f);
ExpertLayout default_expert_layout(model::Family f);
// `prefix` empty: the family's usual one (Qwen3_5MoeForCausalLM writes "model." for Qwen3.5 too).
HfLayout hf_layout(const model::ModelConfig& c, ExpertLayout experts, const std::string& prefix = "");

// What a set of HF tensor names says about their layout: the prefix of the decoder tensors and how the routed
// experts are stored. Throws std::invalid_argument when the names hold no decoder layers.
struct DetectedHfLayout {
  std::string prefix;
  ExpertLayout experts;
};
DetectedHfLayout detect_hf_layout(const std::vector<std::string>& names, const model::ModelConfig& c);
// Tensors of a real checkpoint that are not part of the text decoder and are skipped with a note: the vision tower
// (model.visual.*), and the multi-token-prediction layer (mtp.*) when the config has none (num_nextn_predict_layers /
// mtp_num_hidden_layers 0); with one, hf_layout names the mtp.* tensors and they are read like the rest.
bool is_skipped_hf_tensor(const std::string& name);

// Per-layer ("unscanned") native names: "layers.{i}.<per-layer name>" with per-layer shapes, plus the globals,
// against the same stacked tensors.
HfLayout unscanned_layout(const model::ModelConfig& c);

}  // namespace hs::checkpoint
