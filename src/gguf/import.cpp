#include "gguf/import.h"

#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstring>
#include <map>
#include <random>

#include "checkpoint/hf_layout.h"
#include "checkpoint/sharded.h"
#include "core/atomic_file.h"
#include "core/dtype.h"
#include "gguf/tensor_data.h"
#include "model/params.h"

namespace hs::gguf {

namespace fs = std::filesystem;
using json = nlohmann::json;
using model::Family;
using model::ModelConfig;

namespace {

[[noreturn]] void fail(const GgufReader& r, const std::string& what) {
  throw FormatError("GGUF model " + r.label() + ": " + what);
}

// A float stored as f32 read back as the decimal it was written from (1e-06, not 9.99999997e-07), so the
// imported config equals the source's.
double shortest(double f32_value) {
  char buf[32];
  const auto res = std::to_chars(buf, buf + sizeof buf, static_cast<float>(f32_value));
  return std::strtod(std::string(buf, res.ptr).c_str(), nullptr);
}

std::string arch_of(const GgufReader& r) {
  const auto a = r.find_string("general.architecture");
  if (!a) fail(r, "general.architecture is missing: not a model file");
  if (*a != "qwen3next" && *a != "qwen35" && *a != "qwen35moe")
    fail(r, "architecture '" + *a + "' is not supported: hybridscan loads qwen3next, qwen35 and qwen35moe (Qwen3-Next "
            "and Qwen3.5 hybrid models)");
  return *a;
}

std::string shape_str(const Shape& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

Shape squeeze(const Shape& s) {
  Shape o;
  for (int64_t d : s)
    if (d != 1) o.push_back(d);
  return o;
}

// The GGUF tensor `name` as fp32 after checking its shape (row-major) against what the metadata implies.
std::vector<float> load(const GgufReader& r, const std::string& name, const Shape& expected, const std::string& why) {
  const TensorInfo* t = r.find_tensor(name);
  if (!t) fail(r, "tensor '" + name + "' is missing (" + why + ")");
  if (squeeze(t->shape()) != squeeze(expected))
    fail(r, "tensor '" + name + "' has shape " + shape_str(t->shape()) + " but the metadata implies " +
                shape_str(expected) + " (" + why + "): the file and its metadata disagree");
  return dequantize_tensor(r, *t);
}

void ungroup_v_heads(std::vector<float>& x, int64_t outer, int64_t stride, int64_t offset, int64_t hk, int64_t r,
                     int64_t block) {
  reorder_v_heads(x, outer, stride, offset, hk, r, block, /*to_tiled=*/false);
}

void minus_one(std::vector<float>& x) {
  for (float& v : x) v -= 1.0f;
}

}  // namespace

ModelConfig config_from_gguf(const GgufReader& r, bool with_mtp) {
  const std::string a = arch_of(r);
  const std::string p = a + ".";
  ModelConfig c;
  c.name = r.find_string("general.name").value_or("gguf");
  c.family = a == "qwen3next" ? Family::Qwen3Next : Family::Qwen3_5;
  c.hidden = r.get_int(p + "embedding_length");
  const int64_t nextn = r.get_int(p + "nextn_predict_layers", 0);
  c.layers = r.get_int(p + "block_count") - nextn;
  if (with_mtp && nextn > 0) {
    if (nextn != 1)
      fail(r, p + "nextn_predict_layers is " + std::to_string(nextn) + ": Qwen3-Next / Qwen3.5 have one MTP layer");
    if (!r.find_tensor("blk." + std::to_string(c.layers) + ".nextn.eh_proj.weight"))
      fail(r, p + "nextn_predict_layers is 1 but tensor 'blk." + std::to_string(c.layers) +
                  ".nextn.eh_proj.weight' (the MTP layer's projection) is missing");
    c.mtp_layers = nextn;
  }
  c.cycle = r.get_int(p + "full_attention_interval", 4);
  c.q_heads = r.get_int(p + "attention.head_count");
  c.kv_heads = r.get_int(p + "attention.head_count_kv");
  c.head_dim = r.get_int(p + "attention.key_length", c.q_heads > 0 ? c.hidden / c.q_heads : 0);
  if (r.get_int(p + "attention.value_length", c.head_dim) != c.head_dim)
    fail(r, p + "attention.value_length differs from key_length: not a Qwen3-Next / Qwen3.5 attention");
  const int64_t rot = r.get_int(p + "rope.dimension_count", c.head_dim / 4);
  c.partial_rotary = c.head_dim > 0 ? static_cast<double>(rot) / static_cast<double>(c.head_dim) : 0.25;
  c.rope_theta = shortest(r.get_float(p + "rope.freq_base", 1e7));
  c.k_heads = r.get_int(p + "ssm.group_count");
  c.v_heads = r.get_int(p + "ssm.time_step_rank");
  c.dk = r.get_int(p + "ssm.state_size");
  const int64_t inner = r.get_int(p + "ssm.inner_size");
  c.dv = c.v_heads > 0 ? inner / c.v_heads : 0;
  if (c.dv * c.v_heads != inner)
    fail(r, p + "ssm.inner_size " + std::to_string(inner) + " is not a multiple of ssm.time_step_rank " +
                std::to_string(c.v_heads));
  c.conv_width = r.get_int(p + "ssm.conv_kernel");
  c.rms_eps = shortest(r.get_float(p + "attention.layer_norm_rms_epsilon"));
  if (a == "qwen35") {
    c.intermediate = r.get_int(p + "feed_forward_length");
  } else {
    c.experts = r.get_int(p + "expert_count");
    c.top_k = r.get_int(p + "expert_used_count");
    c.expert_inter = r.get_int(p + "expert_feed_forward_length");
    c.shared_inter = r.get_int(p + "expert_shared_feed_forward_length");
    if (const Value* v = r.find(p + "expert_weights_norm"); v && v->is_integer()) c.norm_topk_prob = v->i != 0;
  }
  const TensorInfo& emb = r.tensor("token_embd.weight");
  if (emb.ne.size() != 2 || emb.ne[0] != c.hidden)
    fail(r, "tensor 'token_embd.weight' has shape " + shape_str(emb.shape()) + ", not [vocab, " +
                std::to_string(c.hidden) + "] (" + p + "embedding_length)");
  c.vocab = emb.ne[1];
  if (const Value* rec = r.find(p + "attention.recurrent_layers"); rec && rec->type == ValueType::ARRAY)
    for (size_t i = 0; i < rec->ints.size() && static_cast<int64_t>(i) < c.layers; ++i)
      if ((rec->ints[i] != 0) == c.is_full_attention(static_cast<int64_t>(i)))
        fail(r, p + "attention.recurrent_layers says layer " + std::to_string(i) + " is " +
                    (rec->ints[i] ? "linear attention" : "full attention") + ", but full_attention_interval " +
                    std::to_string(c.cycle) + " says otherwise: hybridscan runs the periodic layout only");
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    fail(r, std::string("its metadata is not a usable model: ") + e.what());
  }
  return c;
}

json hf_config_json(const GgufReader& r, const ModelConfig& c) {
  json j = model::config_to_hf_json(c);
  json& t = j.contains("text_config") ? j["text_config"] : j;
  const std::string p = arch_of(r) + ".";
  if (r.find(p + "context_length")) t["max_position_embeddings"] = r.get_int(p + "context_length");
  if (r.find("tokenizer.ggml.eos_token_id")) t["eos_token_id"] = r.get_int("tokenizer.ggml.eos_token_id");
  return j;
}

bool is_loadable_type(uint32_t type) { return is_supported_storage_type(type); }

std::vector<float> dequantize_tensor(const GgufReader& r, const TensorInfo& t) {
  if (!is_loadable_type(t.type))
    fail(r, "tensor '" + t.name + "' is stored as " + ggml_type_name(t.type) +
                ", which hybridscan does not read (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K and Q6_K are): requantize "
                "it with llama-quantize or convert the Hugging Face checkpoint");
  std::vector<float> out(static_cast<size_t>(t.numel()));
  to_f32(t.type, r.bytes(t), out);
  return out;
}

static std::vector<float> read_layer_tensor(const GgufReader& r, const ModelConfig& c, int64_t i,
                                            const std::string& s, const std::string& kind);

std::vector<float> read_model_tensor(const GgufReader& r, const ModelConfig& c, const std::string& name) {
  const int64_t H = c.hidden, V = c.vocab;
  if (name == "embed_tokens.weight") return load(r, "token_embd.weight", {V, H}, "the embedding");
  if (name == "norm.weight") {
    auto x = load(r, "output_norm.weight", {H}, "the final norm");
    minus_one(x);
    return x;
  }
  if (name == "lm_head.weight") {
    if (!r.find_tensor("output.weight")) return load(r, "token_embd.weight", {V, H}, "the tied LM head");
    return load(r, "output.weight", {V, H}, "the LM head");
  }
  // The multi-token-prediction layer: block `layers` of the file (llama.cpp's converter), a full-attention layer
  // (mtp.layers.{m}.<spec name>) with the nextn.* tensors beside it.
  if (name.rfind("mtp.", 0) == 0) {
    const std::string b = "blk." + std::to_string(c.layers) + ".", kind = "the multi-token-prediction layer";
    if (name == "mtp.fc.weight") return load(r, b + "nextn.eh_proj.weight", {H, 2 * H}, kind);
    static const std::map<std::string, std::string> norms{{"mtp.pre_fc_norm_embedding.weight", "nextn.enorm.weight"},
                                                          {"mtp.pre_fc_norm_hidden.weight", "nextn.hnorm.weight"},
                                                          {"mtp.norm.weight", "nextn.shared_head_norm.weight"}};
    if (const auto it = norms.find(name); it != norms.end()) {
      auto x = load(r, b + it->second, {H}, kind);
      minus_one(x);
      return x;
    }
    if (name.rfind("mtp.layers.", 0) != 0) throw std::logic_error("read_model_tensor: unknown tensor " + name);
    const size_t dot = name.find('.', 11);
    const int64_t m = std::stoll(name.substr(11, dot - 11));
    return read_layer_tensor(r, c, c.layers + m, name.substr(dot + 1), kind);
  }
  // layers.{i}.<spec name>
  if (name.rfind("layers.", 0) != 0) throw std::logic_error("read_model_tensor: unknown tensor " + name);
  const size_t dot = name.find('.', 7);
  const int64_t i = std::stoll(name.substr(7, dot - 7));
  return read_layer_tensor(r, c, i, name.substr(dot + 1),
                           (c.is_full_attention(i) ? "full-attention layer " : "linear-attention layer ") +
                               std::to_string(i));
}

// Tensor s (a layer spec's name) of the decoder layer in GGUF block i; kind names the layer in errors.
static std::vector<float> read_layer_tensor(const GgufReader& r, const ModelConfig& c, int64_t i,
                                            const std::string& s, const std::string& kind) {
  const int64_t H = c.hidden;
  const bool qwen35 = c.family == Family::Qwen3_5;
  const std::string b = "blk." + std::to_string(i) + ".";
  const int64_t hk = c.k_heads, hv = c.v_heads, r_ = hk > 0 ? hv / hk : 1, dv = c.dv, KD = c.key_dim(), VD = c.value_dim();
  const bool reorder = qwen35 && hk != hv;

  if (s == "input_layernorm.weight" || s == "post_attention_layernorm.weight") {
    auto x = load(r, b + (s[0] == 'i' ? "attn_norm.weight" : "post_attention_norm.weight"), {H}, kind);
    minus_one(x);
    return x;
  }
  // Full attention: the converter renames and adds 1 to the q/k norms; q_proj keeps its per-head query and gate.
  if (s == "self_attn.q_proj.weight") return load(r, b + "attn_q.weight", {c.q_heads * 2 * c.head_dim, H}, kind);
  if (s == "self_attn.k_proj.weight") return load(r, b + "attn_k.weight", {c.kv_heads * c.head_dim, H}, kind);
  if (s == "self_attn.v_proj.weight") return load(r, b + "attn_v.weight", {c.kv_heads * c.head_dim, H}, kind);
  if (s == "self_attn.o_proj.weight") return load(r, b + "attn_output.weight", {H, c.q_heads * c.head_dim}, kind);
  if (s == "self_attn.q_norm.weight" || s == "self_attn.k_norm.weight") {
    auto x = load(r, b + (s[10] == 'q' ? "attn_q_norm.weight" : "attn_k_norm.weight"), {c.head_dim}, kind);
    minus_one(x);
    return x;
  }
  // Gated DeltaNet.
  if (s == "linear_attn.in_proj_qkv.weight") {
    // Both converters write the plain [q all | k all | v all] (Qwen3-Next's in_proj_qkvz is split per key head).
    auto x = load(r, b + "attn_qkv.weight", {c.conv_dim(), H}, kind);
    if (reorder) ungroup_v_heads(x, 1, 0, 2 * KD * H, hk, r_, dv * H);
    return x;
  }
  if (s == "linear_attn.in_proj_z.weight") {
    auto x = load(r, b + "attn_gate.weight", {VD, H}, kind);
    if (reorder) ungroup_v_heads(x, 1, 0, 0, hk, r_, dv * H);
    return x;
  }
  if (s == "linear_attn.in_proj_b.weight" || s == "linear_attn.in_proj_a.weight") {
    const bool beta = s == "linear_attn.in_proj_b.weight";
    if (!qwen35) {
      // Qwen3-Next's ssm_ba is in_proj_ba as stored: per key head g, b (r rows) then a (r rows).
      const auto ba = load(r, b + "ssm_ba.weight", {2 * hv, H}, kind);
      std::vector<float> x(static_cast<size_t>(hv * H));
      for (int64_t g = 0; g < hk; ++g)
        std::memcpy(x.data() + g * r_ * H, ba.data() + (2 * g * r_ + (beta ? 0 : r_)) * H, r_ * H * sizeof(float));
      return x;
    }
    auto x = load(r, b + (beta ? "ssm_beta.weight" : "ssm_alpha.weight"), {hv, H}, kind);
    if (reorder) ungroup_v_heads(x, 1, 0, 0, hk, r_, H);
    return x;
  }
  if (s == "linear_attn.conv1d.weight") {
    auto x = load(r, b + "ssm_conv1d.weight", {c.conv_dim(), c.conv_width}, kind);
    if (reorder) ungroup_v_heads(x, 1, 0, 2 * KD * c.conv_width, hk, r_, dv * c.conv_width);
    return x;
  }
  if (s == "linear_attn.A_log") {
    // The converter stores A = -exp(A_log).
    auto x = load(r, b + "ssm_a", {hv}, kind);
    for (size_t k = 0; k < x.size(); ++k) {
      if (!(x[k] < 0.0f))
        fail(r, "tensor '" + b + "ssm_a' holds " + std::to_string(x[k]) + " at " + std::to_string(k) +
                    ": the converter writes -exp(A_log), which is negative");
      x[k] = std::log(-x[k]);
    }
    if (reorder) ungroup_v_heads(x, 1, 0, 0, hk, r_, 1);
    return x;
  }
  if (s == "linear_attn.dt_bias") {
    auto x = load(r, b + "ssm_dt.bias", {hv}, kind);
    if (reorder) ungroup_v_heads(x, 1, 0, 0, hk, r_, 1);
    return x;
  }
  if (s == "linear_attn.norm.weight") return load(r, b + "ssm_norm.weight", {dv}, kind);  // a plain scale: no +1
  if (s == "linear_attn.out_proj.weight") {
    auto x = load(r, b + "ssm_out.weight", {H, VD}, kind);
    if (reorder) ungroup_v_heads(x, H, VD, 0, hk, r_, dv);
    return x;
  }
  // Feed-forward.
  const int64_t E = c.experts, I = c.expert_inter, Is = c.shared_inter;
  if (s == "mlp.gate.weight") return load(r, b + "ffn_gate_inp.weight", {E, H}, kind);
  if (s == "mlp.experts.gate_up_proj") {
    if (r.find_tensor(b + "ffn_gate_up_exps.weight")) return load(r, b + "ffn_gate_up_exps.weight", {E, 2 * I, H}, kind);
    const auto gate = load(r, b + "ffn_gate_exps.weight", {E, I, H}, kind);
    const auto up = load(r, b + "ffn_up_exps.weight", {E, I, H}, kind);
    std::vector<float> x(static_cast<size_t>(E * 2 * I * H));
    for (int64_t e = 0; e < E; ++e) {
      std::memcpy(x.data() + e * 2 * I * H, gate.data() + e * I * H, I * H * sizeof(float));
      std::memcpy(x.data() + (e * 2 + 1) * I * H, up.data() + e * I * H, I * H * sizeof(float));
    }
    return x;
  }
  if (s == "mlp.experts.down_proj") return load(r, b + "ffn_down_exps.weight", {E, H, I}, kind);
  if (s == "mlp.shared_expert.gate_proj.weight") return load(r, b + "ffn_gate_shexp.weight", {Is, H}, kind);
  if (s == "mlp.shared_expert.up_proj.weight") return load(r, b + "ffn_up_shexp.weight", {Is, H}, kind);
  if (s == "mlp.shared_expert.down_proj.weight") return load(r, b + "ffn_down_shexp.weight", {H, Is}, kind);
  if (s == "mlp.shared_expert_gate.weight") return load(r, b + "ffn_gate_inp_shexp.weight", {1, H}, kind);
  if (s == "mlp.gate_proj.weight") return load(r, b + "ffn_gate.weight", {c.intermediate, H}, kind);
  if (s == "mlp.up_proj.weight") return load(r, b + "ffn_up.weight", {c.intermediate, H}, kind);
  if (s == "mlp.down_proj.weight") return load(r, b + "ffn_down.weight", {H, c.intermediate}, kind);
  throw std::logic_error("read_model_tensor: no GGUF source for " + s + " of " + kind);
}

std::vector<std::string> verbatim_sources(const GgufReader& r, const ModelConfig& c, const std::string& name) {
  if (name == "embed_tokens.weight") return {"token_embd.weight"};
  if (name == "lm_head.weight") return {r.find_tensor("output.weight") ? "output.weight" : "token_embd.weight"};
  if (name.rfind("layers.", 0) != 0) return {};
  const size_t dot = name.find('.', 7);
  const std::string i = name.substr(7, dot - 7), s = name.substr(dot + 1), b = "blk." + i + ".";
  const bool reorder = c.family == Family::Qwen3_5 && c.k_heads != c.v_heads;
  static const std::map<std::string, std::string> plain{
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"mlp.experts.down_proj", "ffn_down_exps.weight"},
      {"mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"},
      {"mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"},
      {"mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"}};
  static const std::map<std::string, std::string> unless_reordered{
      {"linear_attn.in_proj_qkv.weight", "attn_qkv.weight"},
      {"linear_attn.in_proj_z.weight", "attn_gate.weight"},
      {"linear_attn.out_proj.weight", "ssm_out.weight"}};
  if (auto it = plain.find(s); it != plain.end()) return {b + it->second};
  if (auto it = unless_reordered.find(s); it != unless_reordered.end())
    return reorder ? std::vector<std::string>{} : std::vector<std::string>{b + it->second};
  if (s == "mlp.experts.gate_up_proj") {
    if (r.find_tensor(b + "ffn_gate_up_exps.weight")) return {b + "ffn_gate_up_exps.weight"};
    return {b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"};
  }
  return {};
}

std::optional<json> tokenizer_json_from_gguf(const GgufReader& r) {
  const auto model = r.find_string("tokenizer.ggml.model");
  if (!model) return std::nullopt;
  if (*model != "gpt2")
    fail(r, "tokenizer.ggml.model '" + *model + "' is not supported: hybridscan reads byte-level BPE ('gpt2', what "
            "Qwen models use)");
  const Value* tokens = r.find("tokenizer.ggml.tokens");
  if (!tokens || tokens->array_type != ValueType::STRING) fail(r, "tokenizer.ggml.tokens is missing or not strings");
  const Value* types = r.find("tokenizer.ggml.token_type");
  const Value* merges = r.find("tokenizer.ggml.merges");
  const std::string pre = r.find_string("tokenizer.ggml.pre").value_or("qwen2");
  // llama.cpp's pre-tokenizer names for the two Qwen split regexes (llama-vocab.cpp).
  std::string regex;
  if (pre == "qwen2" || pre == "hunyuan" || pre == "solar-open" || pre == "default" || pre == "deepseek-r1-qwen")
    regex = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  else if (pre == "qwen35")
    regex = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  else
    fail(r, "tokenizer.ggml.pre '" + pre + "' is not supported: hybridscan knows the Qwen pre-tokenizers qwen2 and qwen35");
  json vocab = json::object();
  json added = json::array();
  for (size_t id = 0; id < tokens->strings.size(); ++id) {
    // token_type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    const int64_t type = types && id < types->ints.size() ? types->ints[id] : 1;
    const std::string& t = tokens->strings[id];
    if (type == 3 || type == 4)
      added.push_back({{"id", id}, {"content", t}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                       {"normalized", false}, {"special", type == 3}});
    else
      vocab[t] = id;
  }
  // A merge whose parts or result are not tokens can never apply; Hugging Face's tokenizers (and hybridscan's)
  // refuse a tokenizer.json holding one, so it is left out (llama.cpp's converter writes one into byte vocabularies,
  // which have no merges, because llama.cpp refuses a BPE vocabulary without any).
  json m = json::array();
  if (merges && merges->array_type == ValueType::STRING)
    for (const std::string& s : merges->strings) {
      const size_t sp = s.find(' ', 1);
      if (sp == std::string::npos) continue;
      const std::string a = s.substr(0, sp), b = s.substr(sp + 1);
      if (vocab.contains(a) && vocab.contains(b) && vocab.contains(a + b)) m.push_back(s);
    }
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  return json{
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}}, byte_level}}}},
      {"post_processor", byte_level},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", m}}}};
}

ImportReport import_gguf(const fs::path& path, const fs::path& dir, bool tensors) {
  GgufReader r(path);
  ImportReport rep;
  rep.architecture = arch_of(r);
  rep.config = config_from_gguf(r, /*with_mtp=*/true);
  const ModelConfig& c = rep.config;
  if (fs::exists(dir) && !fs::is_empty(dir)) throw std::runtime_error(dir.string() + " exists and is not empty");
  fs::create_directories(dir);

  const checkpoint::HfLayout layout = checkpoint::unscanned_layout(c);
  std::vector<checkpoint::TensorDecl> decls;
  for (const checkpoint::HfTensor& t : layout.hf) {
    // bf16 where the stored tensor is BF16 (no value changes), fp32 otherwise (dequantized values are fp32 products).
    checkpoint::FileDType dt = checkpoint::FileDType::F32;
    if (t.name == "embed_tokens.weight" || t.name == "lm_head.weight") {
      const TensorInfo* src = r.find_tensor(t.name == "lm_head.weight" && r.find_tensor("output.weight") ? "output.weight"
                                                                                                       : "token_embd.weight");
      if (src && src->type == ggml_type::BF16) dt = checkpoint::FileDType::BF16;
    }
    decls.push_back({t.name, dt, t.shape});
  }
  for (const TensorInfo& t : r.tensors())
    if (int64_t i = -1; t.name.rfind("blk.", 0) == 0 &&
                        std::from_chars(t.name.data() + 4, t.name.data() + t.name.size(), i).ec == std::errc() &&
                        i >= c.layers + c.mtp_layers)
      rep.notes.push_back("skipped " + t.name + " (a block past the decoder's and its multi-token-prediction layer)");
  if (tensors) {
    checkpoint::ShardedWriter w(dir, decls, 5'000'000'000ull, {{"format", "hybridscan"}});
    for (const checkpoint::TensorDecl& d : decls) {
      const std::vector<float> x = read_model_tensor(r, c, d.name);
      if (static_cast<int64_t>(x.size()) != hs::numel(d.shape))
        throw std::logic_error("import_gguf: " + d.name + " has the wrong element count");
      if (d.dtype == checkpoint::FileDType::BF16) {
        std::vector<bf16> y(x.size());
        for (size_t k = 0; k < x.size(); ++k) y[k] = bf16(x[k]);
        w.write(d.name, std::as_bytes(std::span(y)));
      } else {
        w.write(d.name, std::as_bytes(std::span(x)));
      }
    }
    w.commit();
  }
  write_file_atomically(dir / "config.json", hf_config_json(r, c).dump(2) + "\n");
  const json native = {{"format", "hybridscan-native"},
                       {"version", 1},
                       {"layout", "unscanned"},
                       {"family", model::family_name(c.family)},
                       {"hf", {{"prefix", checkpoint::hf_prefix(c.family)},
                               {"experts", c.family == Family::Qwen3Next ? "per_expert" : "fused"},
                               {"metadata", json::object()}}},
                       {"source", fs::absolute(path).string()}};
  write_file_atomically(dir / "hybridscan.json", native.dump(2) + "\n");
  if (const auto tok = tokenizer_json_from_gguf(r)) {
    write_file_atomically(dir / "tokenizer.json", tok->dump() + "\n");
    json tc = {{"tokenizer_class", "PreTrainedTokenizerFast"}};
    if (const auto tmpl = r.find_string("tokenizer.chat_template")) tc["chat_template"] = *tmpl;
    const Value* eos = r.find("tokenizer.ggml.eos_token_id");
    const Value* toks = r.find("tokenizer.ggml.tokens");
    if (eos && eos->is_integer() && toks && eos->i >= 0 && static_cast<size_t>(eos->i) < toks->strings.size())
      tc["eos_token"] = toks->strings[static_cast<size_t>(eos->i)];
    write_file_atomically(dir / "tokenizer_config.json", tc.dump(2) + "\n");
  } else {
    rep.notes.push_back("the file has no tokenizer (tokenizer.ggml.*): text goes in as byte tokens");
  }
  return rep;
}

bool is_gguf_path(const std::string& path) {
  return path.size() > 5 && path.compare(path.size() - 5, 5, ".gguf") == 0;
}

CheckpointPath::CheckpointPath(const std::string& p, Weights weights) : dir_(p) {
  if (!is_gguf_path(p)) return;
  std::random_device rd;
  const fs::path base = fs::temp_directory_path();
  temp_ = base / ("hybridscan-gguf-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
  try {
    const bool dequantize = weights == Weights::Dequantized;
    const ImportReport rep = import_gguf(p, temp_, dequantize);
    for (const std::string& n : rep.notes) std::fprintf(stderr, "gguf: %s\n", n.c_str());
    if (dequantize)
      std::fprintf(stderr, "gguf: %s (%s) dequantized into %s for this run (the weights take their fp32/bf16 size)\n",
                   p.c_str(), rep.architecture.c_str(), temp_.c_str());
  } catch (...) {
    std::error_code ec;
    fs::remove_all(temp_, ec);
    throw;
  }
  dir_ = temp_.string();
}

CheckpointPath::~CheckpointPath() {
  if (temp_.empty()) return;
  std::error_code ec;
  fs::remove_all(temp_, ec);
}

}  // namespace hs::gguf
