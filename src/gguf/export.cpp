#include "gguf/export.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "checkpoint/convert.h"
#include "checkpoint/hf_io.h"
#include "gguf/gguf_file.h"
#include "gguf/tensor_data.h"
#include "kernels/quant.h"
#include "model/params.h"

namespace hs::gguf {

namespace fs = std::filesystem;
using json = nlohmann::json;
using model::Family;
using model::ModelConfig;

QuantScheme parse_quant_scheme(const std::string& s) {
  static const std::map<std::string, QuantScheme> m{{"f32", QuantScheme::F32},   {"f16", QuantScheme::F16},
                                                    {"bf16", QuantScheme::BF16}, {"q8_0", QuantScheme::Q8_0},
                                                    {"q4_k", QuantScheme::Q4_K}, {"q5_k", QuantScheme::Q5_K},
                                                    {"q6_k", QuantScheme::Q6_K}, {"mixed", QuantScheme::Mixed}};
  const auto it = m.find(s);
  if (it == m.end())
    throw std::invalid_argument("--quantize '" + s + "': use f32, f16, bf16, q8_0, q4_k, q5_k, q6_k or mixed");
  return it->second;
}

std::string quant_scheme_name(QuantScheme s) {
  switch (s) {
    case QuantScheme::F32: return "f32";
    case QuantScheme::F16: return "f16";
    case QuantScheme::BF16: return "bf16";
    case QuantScheme::Q8_0: return "q8_0";
    case QuantScheme::Q4_K: return "q4_k";
    case QuantScheme::Q5_K: return "q5_k";
    case QuantScheme::Q6_K: return "q6_k";
    case QuantScheme::Mixed: return "mixed";
  }
  return "?";
}

namespace {

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

uint32_t fit(uint32_t want, int64_t ne0) {
  const auto info = ggml_type_info(want);
  if (ne0 % info->block == 0) return want;
  return ne0 % 32 == 0 ? ggml_type::Q8_0 : ggml_type::F32;
}

// general.file_type (llama_ftype) for the scheme: what llama.cpp prints as the file's type.
uint32_t file_type(QuantScheme s) {
  switch (s) {
    case QuantScheme::F32: return 0;
    case QuantScheme::F16: return 1;
    case QuantScheme::Q8_0: return 7;
    case QuantScheme::Q4_K: return 15;  // Q4_K_M
    case QuantScheme::Q5_K: return 17;  // Q5_K_M
    case QuantScheme::Q6_K: return 18;
    case QuantScheme::BF16: return 32;
    case QuantScheme::Mixed: return 15;  // closest named mix: Q4_K_M
  }
  return 0;
}

}  // namespace

uint32_t tensor_type_for(QuantScheme s, const std::string& n, int64_t ne0, int64_t dims) {
  // Kept in F32 whatever the scheme: vectors, the convolution, the routers (llama-quantize keeps ffn_gate_inp too).
  if (dims < 2 || contains(n, "ssm_conv1d") || contains(n, "ffn_gate_inp")) return ggml_type::F32;
  switch (s) {
    case QuantScheme::F32: return ggml_type::F32;
    case QuantScheme::F16: return ggml_type::F16;
    case QuantScheme::BF16: return ggml_type::BF16;
    case QuantScheme::Q8_0: return fit(ggml_type::Q8_0, ne0);
    case QuantScheme::Q4_K: return fit(ggml_type::Q4_K, ne0);
    case QuantScheme::Q5_K: return fit(ggml_type::Q5_K, ne0);
    case QuantScheme::Q6_K: return fit(ggml_type::Q6_K, ne0);
    case QuantScheme::Mixed: {
      const bool routed = contains(n, "_exps.");
      const bool dense_mlp = contains(n, ".ffn_gate.") || contains(n, ".ffn_up.") || contains(n, ".ffn_down.");
      if (routed || dense_mlp) return fit(contains(n, "ffn_down") ? ggml_type::Q5_K : ggml_type::Q4_K, ne0);
      return fit(ggml_type::Q8_0, ne0);
    }
  }
  return ggml_type::F32;
}

namespace {

struct Source {
  const model::ParamSet& ps;
  std::map<std::string, const checkpoint::HfTensor*> by_name;
  std::vector<float> get(const std::string& name) const { return checkpoint::hf_tensor_from(ps, *by_name.at(name)); }
};

void plus(std::vector<float>& x, float v) {
  for (float& e : x) e += v;
}

}  // namespace

void write_tokenizer(GgufWriter& w, const fs::path& dir, int64_t vocab, std::vector<std::string>& notes) {
  struct {
    int64_t vocab;
  } c{vocab};
  std::vector<std::string> tokens(static_cast<size_t>(c.vocab));
  std::vector<int64_t> types(static_cast<size_t>(c.vocab), 5);  // unused until named
  std::vector<std::string> merges;
  std::string pre = "qwen2";
  const fs::path tj = dir / "tokenizer.json";
  if (fs::is_regular_file(tj)) {
    std::ifstream in(tj);
    const json j = json::parse(in);
    const json& m = j.at("model");
    if (m.value("type", "") != "BPE") throw std::runtime_error(tj.string() + ": only byte-level BPE tokenizers export to GGUF");
    for (const auto& [tok, id] : m.at("vocab").items()) {
      const int64_t i = id.get<int64_t>();
      if (i >= 0 && i < c.vocab) {
        tokens[size_t(i)] = tok;
        types[size_t(i)] = 1;
      }
    }
    for (const json& mg : m.at("merges"))
      merges.push_back(mg.is_string() ? mg.get<std::string>() : mg[0].get<std::string>() + " " + mg[1].get<std::string>());
    for (const json& a : j.value("added_tokens", json::array())) {
      const int64_t i = a.at("id").get<int64_t>();
      if (i >= 0 && i < c.vocab) {
        tokens[size_t(i)] = a.at("content").get<std::string>();
        types[size_t(i)] = a.value("special", false) ? 3 : 4;
      }
    }
    if (j.dump().find("\\\\p{M}") != std::string::npos) pre = "qwen35";
  } else {
    // GPT-2's byte-to-unicode map: printable bytes stand for themselves, the rest for U+0100 upwards.
    int next = 256;
    for (int b = 0; b < 256 && b < c.vocab; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const int cp = printable ? b : next++;
      std::string u;
      if (cp < 0x80) u.push_back(static_cast<char>(cp));
      else {
        u.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        u.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      tokens[size_t(b)] = u;
      types[size_t(b)] = 1;
    }
    // llama.cpp refuses a BPE vocabulary without merges: one that no text can reach (its result is not a token).
    merges.push_back("\xc4\x80 \xc4\x81");
    notes.push_back("no tokenizer.json: wrote the 256-byte vocabulary");
  }
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i].empty()) tokens[i] = "[PAD" + std::to_string(i) + "]";
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", pre);
  w.set_strings("tokenizer.ggml.tokens", tokens);
  w.set_i32s("tokenizer.ggml.token_type", types);
  w.set_strings("tokenizer.ggml.merges", merges);
  const fs::path tc = dir / "tokenizer_config.json";
  std::optional<std::string> eos;
  if (fs::is_regular_file(tc)) {
    std::ifstream in(tc);
    const json j = json::parse(in, nullptr, false);
    if (j.is_object() && j.contains("chat_template") && j["chat_template"].is_string())
      w.set_string("tokenizer.chat_template", j["chat_template"].get<std::string>());
    if (j.is_object() && j.contains("eos_token") && j["eos_token"].is_string()) eos = j["eos_token"].get<std::string>();
  }
  for (size_t i = 0; i < tokens.size(); ++i)
    if ((eos && tokens[i] == *eos) || (!eos && tokens[i] == "<|endoftext|>")) {
      w.set_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(i));
      w.set_u32("tokenizer.ggml.padding_token_id", static_cast<uint32_t>(i));
      break;
    }
  w.set_bool("tokenizer.ggml.add_bos_token", false);
}

namespace {

// Every tensor of the GGUF model in the converter's order: its name, shape (row-major) and how to make its fp32
// values from the engine's tensors (src may be null when only names and shapes are wanted).
using Make = std::function<std::vector<float>()>;
void for_each_tensor(const ModelConfig& c, std::shared_ptr<Source> src,
                     const std::function<void(const std::string&, const Shape&, Make)>& add) {
  const int64_t H = c.hidden, V = c.vocab, hk = c.k_heads, hv = c.v_heads, r = hv / hk, dv = c.dv, KD = c.key_dim(),
                VD = c.value_dim(), K = c.conv_width;
  const bool reorder = c.family == Family::Qwen3_5 && hk != hv;
  auto get = [src](std::string n) { return [src, n] { return src->get(n); }; };
  auto shifted = [src](std::string n) {
    return [src, n] {
      auto x = src->get(n);
      plus(x, 1.0f);
      return x;
    };
  };
  // reorder: value-head blocks of `block` elements from `offset` in each of `outer` rows `stride` apart.
  auto tiled = [src, reorder, hk, r](std::string n, int64_t outer, int64_t stride, int64_t offset, int64_t block,
                                     std::function<void(std::vector<float>&)> before = nullptr) {
    return [=] {
      auto x = src->get(n);
      if (before) before(x);
      if (reorder) reorder_v_heads(x, outer, stride, offset, hk, r, block, /*to_tiled=*/true);
      return x;
    };
  };
  add("token_embd.weight", {V, H}, get("embed_tokens.weight"));
  add("output_norm.weight", {H}, shifted("norm.weight"));
  add("output.weight", {V, H}, get("lm_head.weight"));
  // One decoder layer: GGUF block prefix b ("blk.{i}."), the engine's Hugging Face prefix l ("layers.{i}.").
  auto layer = [&](const std::string& b, const std::string& l, bool full_attention) {
    add(b + "attn_norm.weight", {H}, shifted(l + "input_layernorm.weight"));
    add(b + "post_attention_norm.weight", {H}, shifted(l + "post_attention_layernorm.weight"));
    if (full_attention) {
      add(b + "attn_q.weight", {c.q_heads * 2 * c.head_dim, H}, get(l + "self_attn.q_proj.weight"));
      add(b + "attn_k.weight", {c.kv_heads * c.head_dim, H}, get(l + "self_attn.k_proj.weight"));
      add(b + "attn_v.weight", {c.kv_heads * c.head_dim, H}, get(l + "self_attn.v_proj.weight"));
      add(b + "attn_output.weight", {H, c.q_heads * c.head_dim}, get(l + "self_attn.o_proj.weight"));
      add(b + "attn_q_norm.weight", {c.head_dim}, shifted(l + "self_attn.q_norm.weight"));
      add(b + "attn_k_norm.weight", {c.head_dim}, shifted(l + "self_attn.k_norm.weight"));
    } else {
      const std::string la = l + "linear_attn.";
      add(b + "attn_qkv.weight", {c.conv_dim(), H}, tiled(la + "in_proj_qkv.weight", 1, 0, 2 * KD * H, dv * H));
      add(b + "attn_gate.weight", {VD, H}, tiled(la + "in_proj_z.weight", 1, 0, 0, dv * H));
      if (c.family == Family::Qwen3Next) {
        add(b + "ssm_ba.weight", {2 * hv, H}, [src, la, hk, r, H, hv] {
          const auto bt = src->get(la + "in_proj_b.weight"), at = src->get(la + "in_proj_a.weight");
          std::vector<float> x(static_cast<size_t>(2 * hv * H));
          for (int64_t g = 0; g < hk; ++g) {
            std::memcpy(x.data() + 2 * g * r * H, bt.data() + g * r * H, r * H * sizeof(float));
            std::memcpy(x.data() + (2 * g * r + r) * H, at.data() + g * r * H, r * H * sizeof(float));
          }
          return x;
        });
      } else {
        add(b + "ssm_beta.weight", {hv, H}, tiled(la + "in_proj_b.weight", 1, 0, 0, H));
        add(b + "ssm_alpha.weight", {hv, H}, tiled(la + "in_proj_a.weight", 1, 0, 0, H));
      }
      add(b + "ssm_conv1d.weight", {c.conv_dim(), K}, tiled(la + "conv1d.weight", 1, 0, 2 * KD * K, dv * K));
      add(b + "ssm_a", {hv}, tiled(la + "A_log", 1, 0, 0, 1, [](std::vector<float>& x) {
            for (float& v : x) v = -std::exp(v);
          }));
      add(b + "ssm_dt.bias", {hv}, tiled(la + "dt_bias", 1, 0, 0, 1));
      add(b + "ssm_norm.weight", {dv}, get(la + "norm.weight"));
      add(b + "ssm_out.weight", {H, VD}, tiled(la + "out_proj.weight", H, VD, 0, dv));
    }
    if (c.moe()) {
      const int64_t E = c.experts, I = c.expert_inter, Is = c.shared_inter;
      add(b + "ffn_gate_inp.weight", {E, H}, get(l + "mlp.gate.weight"));
      for (int half = 0; half < 2; ++half)
        add(b + (half == 0 ? "ffn_gate_exps.weight" : "ffn_up_exps.weight"), {E, I, H}, [src, l, E, I, H, half] {
          const auto gu = src->get(l + "mlp.experts.gate_up_proj");
          std::vector<float> x(static_cast<size_t>(E * I * H));
          for (int64_t e = 0; e < E; ++e)
            std::memcpy(x.data() + e * I * H, gu.data() + (e * 2 + half) * I * H, I * H * sizeof(float));
          return x;
        });
      add(b + "ffn_down_exps.weight", {E, H, I}, get(l + "mlp.experts.down_proj"));
      add(b + "ffn_gate_shexp.weight", {Is, H}, get(l + "mlp.shared_expert.gate_proj.weight"));
      add(b + "ffn_up_shexp.weight", {Is, H}, get(l + "mlp.shared_expert.up_proj.weight"));
      add(b + "ffn_down_shexp.weight", {H, Is}, get(l + "mlp.shared_expert.down_proj.weight"));
      add(b + "ffn_gate_inp_shexp.weight", {1, H}, get(l + "mlp.shared_expert_gate.weight"));
    } else {
      add(b + "ffn_gate.weight", {c.intermediate, H}, get(l + "mlp.gate_proj.weight"));
      add(b + "ffn_up.weight", {c.intermediate, H}, get(l + "mlp.up_proj.weight"));
      add(b + "ffn_down.weight", {H, c.intermediate}, get(l + "mlp.down_proj.weight"));
    }
  };
  for (int64_t i = 0; i < c.layers; ++i)
    layer("blk." + std::to_string(i) + ".", "layers." + std::to_string(i) + ".", c.is_full_attention(i));
  // The multi-token-prediction layer as llama.cpp's converter writes it (its _QwenMtpMixin): one more block after
  // the decoder's, a full-attention layer with the family's feed-forward, plus its nextn.* tensors (the 2H -> H
  // projection and the three norms, +1 like every zero-centred norm).
  for (int64_t m = 0; m < c.mtp_layers; ++m) {
    const std::string b = "blk." + std::to_string(c.layers + m) + ".";
    layer(b, "mtp.layers." + std::to_string(m) + ".", true);
    if (m > 0) continue;
    add(b + "nextn.eh_proj.weight", {H, 2 * H}, get("mtp.fc.weight"));
    add(b + "nextn.enorm.weight", {H}, shifted("mtp.pre_fc_norm_embedding.weight"));
    add(b + "nextn.hnorm.weight", {H}, shifted("mtp.pre_fc_norm_hidden.weight"));
    add(b + "nextn.shared_head_norm.weight", {H}, shifted("mtp.norm.weight"));
  }
}

}  // namespace

uint64_t quantized_weight_bytes(const ModelConfig& c, QuantScheme scheme) {
  uint64_t total = 0;
  for_each_tensor(c, nullptr, [&](const std::string& name, const Shape& shape, Make) {
    std::vector<int64_t> ne(shape.rbegin(), shape.rend());
    total += tensor_nbytes(tensor_type_for(scheme, name, ne[0], static_cast<int64_t>(ne.size())), ne, name);
  });
  return total;
}

ExportReport export_gguf(const fs::path& from, const fs::path& to, QuantScheme scheme) {
  const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(from);
  const ModelConfig& c = d.config;
  ExportReport rep;
  rep.architecture = c.family == Family::Qwen3Next ? "qwen3next" : c.moe() ? "qwen35moe" : "qwen35";
  auto mem = std::make_shared<MemoryAccountant>();
  auto ps = std::make_shared<model::ParamSet>(c, DType::F32, *mem, MemCategory::Parameters, false);
  for (const std::string& n : checkpoint::load_parameters(d, *ps)) rep.notes.push_back(n);
  auto layout = std::make_shared<checkpoint::HfLayout>(checkpoint::unscanned_layout(c));
  auto src = std::make_shared<Source>(Source{*ps, {}});
  for (const auto& t : layout->hf) src->by_name[t.name] = &t;

  GgufWriter w;
  const std::string a = rep.architecture, p = a + ".";
  w.set_string("general.architecture", a);
  w.set_string("general.type", "model");
  w.set_string("general.name", c.name);
  w.set_u32(p + "block_count", static_cast<uint32_t>(c.layers + c.mtp_layers));
  if (c.mtp_layers > 0) w.set_u32(p + "nextn_predict_layers", static_cast<uint32_t>(c.mtp_layers));
  int64_t ctx = 32768;  // config.json without max_position_embeddings: transformers' default for all three config classes
  const json& cj = d.config_json.contains("text_config") ? d.config_json["text_config"] : d.config_json;
  if (cj.contains("max_position_embeddings")) ctx = cj["max_position_embeddings"].get<int64_t>();
  w.set_u32(p + "context_length", static_cast<uint32_t>(ctx));
  w.set_u32(p + "embedding_length", static_cast<uint32_t>(c.hidden));
  if (!c.moe()) w.set_u32(p + "feed_forward_length", static_cast<uint32_t>(c.intermediate));
  else if (cj.contains("intermediate_size")) w.set_u32(p + "feed_forward_length", cj["intermediate_size"].get<uint32_t>());
  w.set_u32(p + "attention.head_count", static_cast<uint32_t>(c.q_heads));
  w.set_u32(p + "attention.head_count_kv", static_cast<uint32_t>(c.kv_heads));
  if (c.family == Family::Qwen3_5) {
    // llama.cpp's qwen35 rope is interleaved M-RoPE: pair i rotates by the text position only while it lies inside
    // the t/h/w sections (i mod 3 picks one); pairs past them take the fourth, zero for text. The converter writes
    // config.json's mrope_section, or transformers' default [11, 11, 10], with a 0 appended; so does this.
    Value sections;
    sections.type = ValueType::ARRAY;
    sections.array_type = ValueType::I32;
    sections.ints = {11, 11, 10, 0};
    if (cj.contains("rope_parameters") && cj["rope_parameters"].contains("mrope_section")) {
      sections.ints.clear();
      for (const json& v : cj["rope_parameters"]["mrope_section"]) sections.ints.push_back(v.get<int64_t>());
      sections.ints.resize(4, 0);
    }
    w.set(p + "rope.dimension_sections", sections);
  }
  w.set_f32(p + "rope.freq_base", static_cast<float>(c.rope_theta));
  w.set_f32(p + "attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_eps));
  if (c.moe()) {
    w.set_u32(p + "expert_count", static_cast<uint32_t>(c.experts));
    w.set_u32(p + "expert_used_count", static_cast<uint32_t>(c.top_k));
  }
  w.set_u32(p + "attention.key_length", static_cast<uint32_t>(c.head_dim));
  w.set_u32(p + "attention.value_length", static_cast<uint32_t>(c.head_dim));
  w.set_u32("general.file_type", file_type(scheme));
  if (c.moe()) {
    w.set_u32(p + "expert_feed_forward_length", static_cast<uint32_t>(c.expert_inter));
    w.set_u32(p + "expert_shared_feed_forward_length", static_cast<uint32_t>(c.shared_inter));
  }
  w.set_u32(p + "ssm.conv_kernel", static_cast<uint32_t>(c.conv_width));
  w.set_u32(p + "ssm.state_size", static_cast<uint32_t>(c.dk));
  w.set_u32(p + "ssm.group_count", static_cast<uint32_t>(c.k_heads));
  w.set_u32(p + "ssm.time_step_rank", static_cast<uint32_t>(c.v_heads));
  w.set_u32(p + "ssm.inner_size", static_cast<uint32_t>(c.value_dim()));
  {
    Value rec;
    rec.type = ValueType::ARRAY;
    rec.array_type = ValueType::BOOL;
    for (int64_t i = 0; i < c.layers; ++i) rec.ints.push_back(c.is_full_attention(i) ? 0 : 1);
    rec.ints.resize(static_cast<size_t>(c.layers + c.mtp_layers), 0);  // the MTP blocks: full attention
    w.set(p + "attention.recurrent_layers", rec);
  }
  w.set_u32(p + "full_attention_interval", static_cast<uint32_t>(c.cycle));
  w.set_u32(p + "rope.dimension_count", static_cast<uint32_t>(c.rotary_dim()));
  w.set_u32("general.quantization_version", 2);
  write_tokenizer(w, d.path, c.vocab, rep.notes);

  for_each_tensor(c, src, [&](const std::string& name, const Shape& shape, Make make) {
    std::vector<int64_t> ne(shape.rbegin(), shape.rend());
    const uint32_t type = tensor_type_for(scheme, name, ne[0], static_cast<int64_t>(ne.size()));
    const int64_t n = hs::numel(shape);
    w.add_tensor(name, ne, type, [make = std::move(make), type, n, name, keep = std::make_tuple(mem, ps, layout, src)](
                                     std::span<std::byte> out) {
      const std::vector<float> x = make();
      if (static_cast<int64_t>(x.size()) != n) throw std::logic_error("export_gguf: " + name + " has the wrong size");
      kernels::quantize_row(static_cast<kernels::GgmlType>(type), x.data(), out.data(), n);
    });
    ++rep.tensors;
  });
  w.write(to);
  rep.bytes = fs::file_size(to);
  return rep;
}

}  // namespace hs::gguf
