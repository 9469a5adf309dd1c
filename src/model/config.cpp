#include "model/config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace hs::model {

using nlohmann::json;

std::string family_name(Family f) { return f == Family::Qwen3Next ? "qwen3-next" : "qwen3.5"; }

int64_t ModelConfig::rotary_dim() const {
  return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary);
}

int64_t ModelConfig::parameter_count() const {
  const int64_t H = hidden;
  int64_t ffn = moe() ? experts * H + experts * 3 * expert_inter * H + 3 * shared_inter * H + H
                      : 3 * intermediate * H;
  int64_t gdn = H * conv_dim() + H * value_dim() + 2 * H * v_heads + conv_dim() * conv_width + 2 * v_heads + dv +
                value_dim() * H;
  int64_t attn = H * q_heads * 2 * head_dim + 2 * H * kv_heads * head_dim + q_heads * head_dim * H + 2 * head_dim;
  int64_t n_full = 0;
  for (int64_t i = 0; i < layers; ++i) n_full += is_full_attention(i);
  int64_t per_layer_common = 2 * H + ffn;
  return n_full * (attn + per_layer_common) + (layers - n_full) * (gdn + per_layer_common) + 2 * vocab * H + H +
         mtp_parameter_count();
}

int64_t ModelConfig::mtp_parameter_count() const {
  if (mtp_layers == 0) return 0;
  const int64_t H = hidden;
  int64_t ffn = moe() ? experts * H + experts * 3 * expert_inter * H + 3 * shared_inter * H + H
                      : 3 * intermediate * H;
  int64_t attn = H * q_heads * 2 * head_dim + 2 * H * kv_heads * head_dim + q_heads * head_dim * H + 2 * head_dim;
  // fc [H, 2H], pre_fc_norm_embedding, pre_fc_norm_hidden and norm [H]; per layer the full-attention layer.
  return 2 * H * H + 3 * H + mtp_layers * (attn + 2 * H + ffn);
}

void ModelConfig::validate() const {
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("invalid model config '" + name + "': " + what);
  };
  need(hidden > 0, "hidden_size must be positive");
  need(layers > 0, "num_hidden_layers must be positive");
  need(cycle >= 1, "full_attention_interval must be >= 1");
  need(vocab > 0, "vocab_size must be positive");
  need(q_heads > 0 && kv_heads > 0 && head_dim > 0, "num_attention_heads, num_key_value_heads, head_dim must be positive");
  need(q_heads % kv_heads == 0, "num_attention_heads (" + std::to_string(q_heads) +
                                    ") must be a multiple of num_key_value_heads (" + std::to_string(kv_heads) + ")");
  int64_t rd = rotary_dim();
  need(rd >= 0 && rd <= head_dim && rd % 2 == 0,
       "partial_rotary_factor * head_dim must be an even number of dims <= head_dim (got " + std::to_string(rd) + ")");
  need(rope_theta > 0, "rope_theta must be positive");
  if (cycle > 1) {
    need(k_heads > 0 && v_heads > 0 && dk > 0 && dv > 0,
         "linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim must be positive");
    need(v_heads % k_heads == 0, "linear_num_value_heads (" + std::to_string(v_heads) +
                                     ") must be a multiple of linear_num_key_heads (" + std::to_string(k_heads) + ")");
    need(conv_width >= 1, "linear_conv_kernel_dim must be >= 1");
  }
  if (moe()) {
    need(top_k >= 1 && top_k <= experts, "num_experts_per_tok must be in [1, num_experts]");
    need(expert_inter > 0, "moe_intermediate_size must be positive");
    need(shared_inter >= 0, "shared_expert_intermediate_size must be >= 0");
  } else {
    need(intermediate > 0, "a dense model needs intermediate_size > 0 (or set num_experts for MoE)");
  }
  need(rms_eps > 0, "rms_norm_eps must be positive");
  need(mtp_layers == 0 || mtp_layers == 1,
       "num_nextn_predict_layers / mtp_num_hidden_layers must be 0 or 1 (got " + std::to_string(mtp_layers) +
           "; the released Qwen3-Next and Qwen3.5 checkpoints carry one multi-token-prediction layer)");
}

namespace {

ModelConfig make_tiny() {
  ModelConfig c;
  c.name = "tiny";
  c.family = Family::Qwen3Next;
  c.hidden = 64;
  c.layers = 4;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.partial_rotary = 0.25;
  c.rope_theta = 10000;
  c.k_heads = 2;
  c.v_heads = 4;
  c.dk = c.dv = 16;
  c.experts = 4;
  c.top_k = 2;
  c.expert_inter = 32;
  c.shared_inter = 32;
  c.vocab = 256;
  return c;
}

ModelConfig make_small() {
  ModelConfig c;
  c.name = "small";
  c.family = Family::Qwen3Next;
  c.hidden = 256;
  c.layers = 8;
  c.q_heads = 4;
  c.kv_heads = 1;
  c.head_dim = 64;
  c.partial_rotary = 0.25;
  c.rope_theta = 1e7;
  c.k_heads = 2;
  c.v_heads = 4;
  c.dk = c.dv = 64;
  c.conv_width = 4;
  c.experts = 8;
  c.top_k = 2;
  c.expert_inter = 256;
  c.shared_inter = 256;
  c.vocab = 256;
  return c;
}

// A tiny Qwen3.5 body under the real Qwen3.5 vocabulary (248,044 ranks + specials, padded to 248,320 as the
// released configs are): to train on text encoded by data/tokenizers/qwen3_5/tokenizer.json in minutes on a laptop.
// The embedding and LM head are 2 x 248,320 x 64 of its 32M parameters, so the hidden size stays small.
ModelConfig make_qwen35_tiny() {
  ModelConfig c = make_tiny();
  c.name = "qwen3.5-tiny";
  c.family = Family::Qwen3_5;
  c.vocab = 248320;
  return c;
}

ModelConfig make_released(const std::string& name, Family fam, int64_t H, int64_t L, int64_t nH, int64_t Hv,
                          int64_t E, int64_t k, int64_t I, int64_t V) {
  ModelConfig c;
  c.name = name;
  c.family = fam;
  c.hidden = H;
  c.layers = L;
  c.q_heads = nH;
  c.kv_heads = 2;
  c.head_dim = 256;
  c.partial_rotary = 0.25;
  c.rope_theta = 1e7;
  c.k_heads = 16;
  c.v_heads = Hv;
  c.dk = c.dv = 128;
  c.conv_width = 4;
  c.experts = E;
  c.top_k = k;
  c.expert_inter = I;
  c.shared_inter = I;
  c.vocab = V;
  return c;
}

}  // namespace

std::vector<std::string> preset_names() {
  return {"tiny", "small", "qwen3.5-tiny", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b", "qwen3.5-397b-a17b"};
}

ModelConfig preset(const std::string& name) {
  const std::string suffix = "+mtp";
  if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    const std::string base = name.substr(0, name.size() - suffix.size());
    if (base.find(suffix) != std::string::npos)
      throw std::invalid_argument("preset '" + name + "': '+mtp' adds the one MTP layer a model can have; give it once");
    ModelConfig c = preset(base);
    c.name = name;
    c.mtp_layers = 1;
    c.validate();
    return c;
  }
  ModelConfig c;
  if (name == "tiny") c = make_tiny();
  else if (name == "small") c = make_small();
  else if (name == "qwen3.5-tiny") c = make_qwen35_tiny();
  else if (name == "qwen3-next-80b-a3b") c = make_released(name, Family::Qwen3Next, 2048, 48, 16, 32, 512, 10, 512, 151936);
  else if (name == "qwen3.5-35b-a3b") c = make_released(name, Family::Qwen3_5, 2048, 40, 16, 32, 256, 8, 512, 248320);
  else if (name == "qwen3.5-397b-a17b") c = make_released(name, Family::Qwen3_5, 4096, 60, 32, 64, 512, 10, 1024, 248320);
  else {
    std::string known;
    for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown preset '" + name + "' (known: " + known +
                                ", each also with '+mtp' for a multi-token-prediction layer; or pass a config.json path)");
  }
  c.validate();
  return c;
}

namespace {

template <typename V>
V get(const json& j, const char* key, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) throw std::invalid_argument(src + ": missing field '" + key + "'");
  try {
    return it->get<V>();
  } catch (const json::exception&) {
    throw std::invalid_argument(src + ": field '" + key + "' has the wrong type");
  }
}

template <typename V>
V get_or(const json& j, const char* key, V fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return it->get<V>();
}

}  // namespace

ModelConfig config_from_hf_json(const json& root, const std::string& src) {
  if (!root.is_object()) throw std::invalid_argument(src + ": not a JSON object");
  const json& j = root.contains("text_config") ? root.at("text_config") : root;
  std::string mt = get_or<std::string>(root, "model_type", get_or<std::string>(j, "model_type", ""));
  ModelConfig c;
  c.name = get_or<std::string>(j, "_name_or_path", src);
  if (mt.rfind("qwen3_next", 0) == 0) c.family = Family::Qwen3Next;
  else if (mt.rfind("qwen3_5", 0) == 0) c.family = Family::Qwen3_5;
  else
    throw std::invalid_argument(src + ": model_type '" + mt +
                                "' is not a Qwen3-Next (qwen3_next) or Qwen3.5 (qwen3_5*) model");
  c.hidden = get<int64_t>(j, "hidden_size", src);
  c.layers = get<int64_t>(j, "num_hidden_layers", src);
  c.cycle = get_or<int64_t>(j, "full_attention_interval", 4);
  // transformers builds layer_types from full_attention_interval and writes only layer_types back: recover the
  // cycle from the first full-attention layer.
  if (!j.contains("full_attention_interval") && j.contains("layer_types") && j.at("layer_types").is_array()) {
    const auto& lt = j.at("layer_types");
    for (size_t i = 0; i < lt.size(); ++i)
      if (lt[i].is_string() && lt[i].get<std::string>() == "full_attention") {
        c.cycle = static_cast<int64_t>(i) + 1;
        break;
      }
  }
  c.q_heads = get<int64_t>(j, "num_attention_heads", src);
  c.kv_heads = get<int64_t>(j, "num_key_value_heads", src);
  c.head_dim = get_or<int64_t>(j, "head_dim", c.q_heads ? c.hidden / c.q_heads : 0);
  const json rope = j.contains("rope_parameters") && j.at("rope_parameters").is_object() ? j.at("rope_parameters")
                                                                                        : json::object();
  c.rope_theta = get_or<double>(j, "rope_theta", get_or<double>(rope, "rope_theta", 10000.0));
  // Absent, the factor is transformers' default for both families (Qwen3NextConfig and Qwen3_5TextConfig set 0.25).
  c.partial_rotary = get_or<double>(j, "partial_rotary_factor", get_or<double>(rope, "partial_rotary_factor", 0.25));
  c.k_heads = get<int64_t>(j, "linear_num_key_heads", src);
  c.v_heads = get<int64_t>(j, "linear_num_value_heads", src);
  c.dk = get<int64_t>(j, "linear_key_head_dim", src);
  c.dv = get<int64_t>(j, "linear_value_head_dim", src);
  c.conv_width = get_or<int64_t>(j, "linear_conv_kernel_dim", 4);
  c.experts = get_or<int64_t>(j, "num_experts", 0);
  if (c.experts > 0) {
    c.top_k = get<int64_t>(j, "num_experts_per_tok", src);
    c.expert_inter = get<int64_t>(j, "moe_intermediate_size", src);
    c.shared_inter = get_or<int64_t>(j, "shared_expert_intermediate_size", 0);
    c.norm_topk_prob = c.family == Family::Qwen3_5 ? true : get_or<bool>(j, "norm_topk_prob", true);
    auto only = get_or<std::vector<int64_t>>(j, "mlp_only_layers", {});
    int64_t step = get_or<int64_t>(j, "decoder_sparse_step", 1);
    if (!only.empty() || step != 1)
      throw std::invalid_argument(src + ": mixed dense/sparse layers (mlp_only_layers, decoder_sparse_step != 1) "
                                        "are not supported; every layer must be MoE or every layer dense");
  } else {
    c.intermediate = get<int64_t>(j, "intermediate_size", src);
  }
  c.router_aux_coef = get_or<double>(j, "router_aux_loss_coef", 0.001);
  c.rms_eps = get_or<double>(j, "rms_norm_eps", 1e-6);
  c.vocab = get<int64_t>(j, "vocab_size", src);
  // Qwen3-Next names the MTP depth num_nextn_predict_layers, Qwen3.5 mtp_num_hidden_layers (in text_config).
  c.mtp_layers = c.family == Family::Qwen3Next ? get_or<int64_t>(j, "num_nextn_predict_layers", 0)
                                               : get_or<int64_t>(j, "mtp_num_hidden_layers", 0);
  if (c.mtp_layers > 0 && get_or<bool>(j, "mtp_use_dedicated_embeddings", false))
    throw std::invalid_argument(src + ": mtp_use_dedicated_embeddings is true: an MTP layer with its own embedding "
                                      "is not supported (the MTP layer shares embed_tokens and lm_head)");
  if (get_or<bool>(root, "tie_word_embeddings", get_or<bool>(j, "tie_word_embeddings", false)))
    throw std::invalid_argument(src + ": tied word embeddings are not part of the Qwen3-Next / Qwen3.5 family");
  if (j.contains("layer_types") && j.at("layer_types").is_array()) {
    const auto& lt = j.at("layer_types");
    if (static_cast<int64_t>(lt.size()) != c.layers)
      throw std::invalid_argument(src + ": layer_types has " + std::to_string(lt.size()) + " entries, num_hidden_layers is " +
                                  std::to_string(c.layers));
    for (int64_t i = 0; i < c.layers; ++i) {
      std::string t = lt[static_cast<size_t>(i)].get<std::string>();
      bool full = t == "full_attention";
      if (!full && t != "linear_attention")
        throw std::invalid_argument(src + ": layer_types[" + std::to_string(i) + "] is '" + t + "'");
      if (full != c.is_full_attention(i))
        throw std::invalid_argument(src + ": layer_types does not follow full_attention_interval " + std::to_string(c.cycle) +
                                    " at layer " + std::to_string(i) +
                                    "; the scanned layout needs periods of (interval-1) linear layers then one full layer");
    }
  }
  c.validate();
  return c;
}

ModelConfig load_config(const std::string& preset_or_path) {
  for (const auto& n : preset_names())
    if (n == preset_or_path || n + "+mtp" == preset_or_path) return preset(preset_or_path);
  std::string path = preset_or_path;
  if (std::filesystem::is_directory(path)) path += "/config.json";
  std::ifstream f(path);
  if (!f)
    throw std::invalid_argument("'" + preset_or_path +
                                "' is neither a preset nor a readable config.json (or a directory holding one)");
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    throw std::invalid_argument(path + ": invalid JSON: " + e.what());
  }
  return config_from_hf_json(j, path);
}

json config_to_hf_json(const ModelConfig& c) {
  json t;
  t["hidden_size"] = c.hidden;
  t["num_hidden_layers"] = c.layers;
  t["full_attention_interval"] = c.cycle;
  json types = json::array();
  for (int64_t i = 0; i < c.layers; ++i) types.push_back(c.is_full_attention(i) ? "full_attention" : "linear_attention");
  t["layer_types"] = types;
  t["num_attention_heads"] = c.q_heads;
  t["num_key_value_heads"] = c.kv_heads;
  t["head_dim"] = c.head_dim;
  t["linear_num_key_heads"] = c.k_heads;
  t["linear_num_value_heads"] = c.v_heads;
  t["linear_key_head_dim"] = c.dk;
  t["linear_value_head_dim"] = c.dv;
  t["linear_conv_kernel_dim"] = c.conv_width;
  if (c.moe()) {
    t["num_experts"] = c.experts;
    t["num_experts_per_tok"] = c.top_k;
    t["moe_intermediate_size"] = c.expert_inter;
    t["shared_expert_intermediate_size"] = c.shared_inter;
    t["norm_topk_prob"] = c.norm_topk_prob;
    t["router_aux_loss_coef"] = c.router_aux_coef;
  } else {
    t["intermediate_size"] = c.intermediate;
  }
  t["rms_norm_eps"] = c.rms_eps;
  t["vocab_size"] = c.vocab;
  t["hidden_act"] = "silu";
  t["tie_word_embeddings"] = false;
  // Written only when there is an MTP layer, so a config without one reads as before.
  if (c.mtp_layers > 0) {
    if (c.family == Family::Qwen3Next) t["num_nextn_predict_layers"] = c.mtp_layers;
    else {
      t["mtp_num_hidden_layers"] = c.mtp_layers;
      t["mtp_use_dedicated_embeddings"] = false;
    }
  }
  if (c.family == Family::Qwen3Next) {
    t["model_type"] = "qwen3_next";
    t["architectures"] = {"Qwen3NextForCausalLM"};
    t["rope_theta"] = c.rope_theta;
    t["partial_rotary_factor"] = c.partial_rotary;
    t["decoder_sparse_step"] = 1;
    t["mlp_only_layers"] = json::array();
    return t;
  }
  t["model_type"] = c.moe() ? "qwen3_5_moe_text" : "qwen3_5_text";
  t["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rope_theta},
                          {"partial_rotary_factor", c.partial_rotary}, {"mrope_interleaved", true},
                          {"mrope_section", {11, 11, 10}}};
  json root;
  root["model_type"] = c.moe() ? "qwen3_5_moe" : "qwen3_5";
  root["architectures"] = {c.moe() ? "Qwen3_5MoeForConditionalGeneration" : "Qwen3_5ForConditionalGeneration"};
  root["text_config"] = t;
  root["tie_word_embeddings"] = false;
  return root;
}

std::string describe(const ModelConfig& c) {
  std::ostringstream s;
  s << c.name << " (" << family_name(c.family) << "): H " << c.hidden << ", L " << c.layers << " = " << c.blocks()
    << " blocks x (" << c.local_per_block() << " linear + 1 full)";
  if (c.remainder()) s << " + " << c.remainder() << " remainder linear";
  s << ", attn " << c.q_heads << "q/" << c.kv_heads << "kv x " << c.head_dim << ", GDN " << c.k_heads << "k/"
    << c.v_heads << "v x " << c.dk << "/" << c.dv;
  if (c.moe()) s << ", MoE " << c.experts << " experts top-" << c.top_k << " x " << c.expert_inter << " + shared " << c.shared_inter;
  else s << ", dense MLP " << c.intermediate;
  if (c.mtp_layers) s << ", MTP " << c.mtp_layers << " layer";
  s << ", vocab " << c.vocab << ", " << static_cast<double>(c.parameter_count()) / 1e9 << "B params";
  return s.str();
}

}  // namespace hs::model
