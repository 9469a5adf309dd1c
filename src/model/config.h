// Model configuration: the architecture of a Qwen3-Next / Qwen3.5 hybrid decoder, from a named preset or a
// Hugging Face config.json of either family.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace hs::model {

enum class Family { Qwen3Next, Qwen3_5 };
std::string family_name(Family f);

struct ModelConfig {
  std::string name = "custom";
  Family family = Family::Qwen3Next;
  int64_t hidden = 0;              // H
  int64_t layers = 0;              // L
  int64_t cycle = 4;               // full_attention_interval: layer i is full attention iff (i+1) % cycle == 0
  // Full attention.
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  double partial_rotary = 0.25;
  double rope_theta = 1e7;
  // Gated DeltaNet.
  int64_t k_heads = 0, v_heads = 0, dk = 0, dv = 0, conv_width = 4;
  // Feed-forward: sparse MoE (experts > 0) or a dense SwiGLU MLP of width `intermediate`.
  int64_t experts = 0, top_k = 0, expert_inter = 0, shared_inter = 0, intermediate = 0;
  bool norm_topk_prob = true;
  double router_aux_coef = 0.001;
  double rms_eps = 1e-6;
  int64_t vocab = 0;
  // Multi-token-prediction layers (docs/model.md, "Multi-token prediction"): Qwen3-Next's num_nextn_predict_layers,
  // Qwen3.5's mtp_num_hidden_layers. 0 (the presets' default) or 1.
  int64_t mtp_layers = 0;

  bool moe() const { return experts > 0; }
  int64_t key_dim() const { return k_heads * dk; }
  int64_t value_dim() const { return v_heads * dv; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  int64_t rotary_dim() const;
  bool is_full_attention(int64_t layer) const { return (layer + 1) % cycle == 0; }
  // The scanned structure: `blocks` periods of (cycle-1) linear-attention layers then one full-attention layer,
  // followed by `remainder` linear-attention layers when L is not a multiple of the cycle.
  int64_t blocks() const { return layers / cycle; }
  int64_t local_per_block() const { return cycle - 1; }
  int64_t remainder() const { return layers % cycle; }
  // Total parameter count (embedding and LM head included, the MTP layer too when there is one).
  int64_t parameter_count() const;
  // Parameters of the MTP layers alone (fc, its three norms, the full-attention decoder layer): 0 without one.
  int64_t mtp_parameter_count() const;
  // Throws std::invalid_argument naming the field and the fix when the configuration is unusable.
  void validate() const;
};

std::vector<std::string> preset_names();
// Throws std::invalid_argument listing the known presets when `name` is unknown. Any preset name followed by
// "+mtp" ("tiny+mtp", "small+mtp", "qwen3.5-tiny+mtp") is that preset with one multi-token-prediction layer.
ModelConfig preset(const std::string& name);
// Reads a Hugging Face config.json (Qwen3-Next, Qwen3.5 MoE or dense; Qwen3.5 nests the text model under
// text_config). Throws std::invalid_argument naming the file and the problem.
ModelConfig config_from_hf_json(const nlohmann::json& j, const std::string& source = "config.json");
ModelConfig load_config(const std::string& preset_or_path);
// The Hugging Face config.json for this architecture (the family's model_type and field names).
nlohmann::json config_to_hf_json(const ModelConfig& c);
std::string describe(const ModelConfig& c);

}  // namespace hs::model
