#include "checkpoint/hf_layout.h"

#include <algorithm>
#include <map>
#include <stdexcept>

#include "model/params.h"

namespace hs::checkpoint {

using model::LayerKind;
using model::ModelConfig;

std::string hf_prefix(model::Family f) { return f == model::Family::Qwen3Next ? "model." : "model.language_model."; }

ExpertLayout default_expert_layout(model::Family f) {
  return f == model::Family::Qwen3Next ? ExpertLayout::PerExpert : ExpertLayout::Fused;
}

namespace {

struct Builder {
  const ModelConfig& c;
  HfLayout out;
  std::map<std::string, size_t> index;  // stacked name -> position

  explicit Builder(const ModelConfig& cfg) : c(cfg) {
    MemoryAccountant plan(true);
    model::ParamSet ps(c, DType::F32, plan, MemCategory::Parameters, false);
    for (const auto& p : ps.all()) {
      index[p.name] = out.stacked.size();
      out.stacked.push_back({p.name, p.tensor.shape()});
    }
  }
  size_t stacked(const std::string& name) const {
    auto it = index.find(name);
    if (it == index.end()) throw std::logic_error("no stacked tensor " + name);
    return it->second;
  }
  // Element offset of layer slot `s` inside a stacked tensor of per-layer size `per_layer`.
  int64_t slot_offset(const model::LayerSlot& s, int64_t per_layer) const {
    if (s.group == model::StackGroup::Local) return (s.block * c.local_per_block() + s.local) * per_layer;
    return s.block * per_layer;
  }
};

}  // namespace

HfLayout hf_layout(const ModelConfig& c, ExpertLayout experts, const std::string& prefix) {
  Builder b(c);
  HfLayout& out = b.out;
  out.prefix = prefix.empty() ? hf_prefix(c.family) : prefix;
  const int64_t H = c.hidden;
  auto add_plain = [&](const std::string& hf_name, Shape shape, const std::string& stacked_name, int64_t at) {
    HfTensor t{hf_name, std::move(shape), {}};
    t.runs.push_back({b.stacked(stacked_name), at, 0, hs::numel(t.shape)});
    out.hf.push_back(std::move(t));
  };
  add_plain(out.prefix + "embed_tokens.weight", {c.vocab, H}, "embed_tokens.weight", 0);
  add_plain(out.prefix + "norm.weight", {H}, "norm.weight", 0);
  add_plain("lm_head.weight", {c.vocab, H}, "lm_head.weight", 0);

  // One decoder layer's tensors, named lp + <per-layer name> (HF splits and fusions applied).
  auto add_layer = [&](const model::LayerSlot& slot, const std::string& lp) {
    const LayerKind kind = slot.kind();
    const std::string group = model::group_name(slot.group) + ".";
    for (const model::ParamSpec& s : model::layer_specs(c, kind)) {
      const int64_t per_layer = hs::numel(s.shape);
      const int64_t at = b.slot_offset(slot, per_layer);
      const size_t st = b.stacked(group + s.name);
      if (s.name == "linear_attn.conv1d.weight") {
        add_plain(lp + s.name, {c.conv_dim(), 1, c.conv_width}, group + s.name, at);
      } else if (s.name == "mlp.shared_expert_gate.weight") {
        add_plain(lp + s.name, {1, H}, group + s.name, at);
      } else if (c.family == model::Family::Qwen3Next && s.name == "linear_attn.in_proj_qkv.weight") {
        // in_proj_qkvz rows, per key head g: q(dk) k(dk) v(r dv) z(r dv).
        const int64_t r = c.v_heads / c.k_heads, dk = c.dk, dv = c.dv, KD = c.key_dim();
        const int64_t per_head = 2 * dk + 2 * r * dv;
        const size_t zt = b.stacked(group + "linear_attn.in_proj_z.weight");
        const int64_t zat = b.slot_offset(slot, c.value_dim() * H);
        HfTensor t{lp + "linear_attn.in_proj_qkvz.weight", {c.k_heads * per_head, H}, {}};
        for (int64_t g = 0; g < c.k_heads; ++g) {
          const int64_t row = g * per_head;
          t.runs.push_back({st, at + g * dk * H, row * H, dk * H});
          t.runs.push_back({st, at + (KD + g * dk) * H, (row + dk) * H, dk * H});
          t.runs.push_back({st, at + (2 * KD + g * r * dv) * H, (row + 2 * dk) * H, r * dv * H});
          t.runs.push_back({zt, zat + g * r * dv * H, (row + 2 * dk + r * dv) * H, r * dv * H});
        }
        out.hf.push_back(std::move(t));
      } else if (c.family == model::Family::Qwen3Next && s.name == "linear_attn.in_proj_b.weight") {
        // in_proj_ba rows, per key head g: b(r) a(r).
        const int64_t r = c.v_heads / c.k_heads;
        const size_t at_a = b.stacked(group + "linear_attn.in_proj_a.weight");
        HfTensor t{lp + "linear_attn.in_proj_ba.weight", {2 * c.v_heads, H}, {}};
        for (int64_t g = 0; g < c.k_heads; ++g) {
          t.runs.push_back({st, at + g * r * H, 2 * g * r * H, r * H});
          t.runs.push_back({at_a, at + g * r * H, (2 * g * r + r) * H, r * H});
        }
        out.hf.push_back(std::move(t));
      } else if (c.family == model::Family::Qwen3Next &&
                 (s.name == "linear_attn.in_proj_z.weight" || s.name == "linear_attn.in_proj_a.weight")) {
        continue;  // covered by in_proj_qkvz / in_proj_ba
      } else if (experts == ExpertLayout::PerExpert && s.name == "mlp.experts.gate_up_proj") {
        const int64_t I = c.expert_inter;
        for (int64_t e = 0; e < c.experts; ++e) {
          const std::string ep = lp + "mlp.experts." + std::to_string(e) + ".";
          out.hf.push_back({ep + "gate_proj.weight", {I, H}, {{st, at + e * 2 * I * H, 0, I * H}}});
          out.hf.push_back({ep + "up_proj.weight", {I, H}, {{st, at + (e * 2 * I + I) * H, 0, I * H}}});
        }
      } else if (experts == ExpertLayout::PerExpert && s.name == "mlp.experts.down_proj") {
        const int64_t I = c.expert_inter;
        for (int64_t e = 0; e < c.experts; ++e)
          out.hf.push_back({lp + "mlp.experts." + std::to_string(e) + ".down_proj.weight", {H, I},
                            {{st, at + e * H * I, 0, H * I}}});
      } else {
        add_plain(lp + s.name, s.shape, group + s.name, at);
      }
    }
  };
  for (int64_t i = 0; i < c.layers; ++i)
    add_layer(model::slot_of_layer(c, i), out.prefix + "layers." + std::to_string(i) + ".");
  // The multi-token-prediction layer: "mtp.*" at the top level in both families (no "model." prefix), its decoder
  // layer stored like a full-attention layer of the decoder (experts in the same layout).
  for (int64_t i = 0; i < c.mtp_layers; ++i)
    add_layer({model::StackGroup::Mtp, i, 0}, "mtp.layers." + std::to_string(i) + ".");
  for (const model::ParamSpec& s : model::mtp_specs(c)) add_plain(s.name, s.shape, s.name, 0);
  return out;
}

DetectedHfLayout detect_hf_layout(const std::vector<std::string>& names, const ModelConfig& c) {
  DetectedHfLayout d{"", c.moe() ? default_expert_layout(c.family) : ExpertLayout::Fused};
  for (const std::string& n : names) {
    auto at = n.find("layers.0.");
    if (d.prefix.empty() && at != std::string::npos && n.rfind("mtp.", 0) != 0) d.prefix = n.substr(0, at);
    if (n.find(".mlp.experts.gate_up_proj") != std::string::npos) d.experts = ExpertLayout::Fused;
    else if (n.find(".mlp.experts.0.gate_proj.weight") != std::string::npos) d.experts = ExpertLayout::PerExpert;
  }
  if (d.prefix.empty())
    throw std::invalid_argument("no decoder layer tensors (\"...layers.0.*\") found: not a Qwen3-Next / Qwen3.5 checkpoint");
  return d;
}

bool is_skipped_hf_tensor(const std::string& name) {
  // mtp.* is only skipped when the config has no MTP layer: with one, its names are among the layout's.
  return name.rfind("mtp.", 0) == 0 || name.rfind("model.visual.", 0) == 0 || name.rfind("visual.", 0) == 0;
}

HfLayout unscanned_layout(const ModelConfig& c) {
  Builder b(c);
  HfLayout& out = b.out;
  for (const char* g : {"embed_tokens.weight", "norm.weight", "lm_head.weight"})
    out.hf.push_back({g, b.out.stacked[b.stacked(g)].shape, {{b.stacked(g), 0, 0, hs::numel(b.out.stacked[b.stacked(g)].shape)}}});
  auto add_layer = [&](const model::LayerSlot& slot, const std::string& lp) {
    const std::string group = model::group_name(slot.group) + ".";
    for (const model::ParamSpec& s : model::layer_specs(c, slot.kind())) {
      const int64_t n = hs::numel(s.shape);
      out.hf.push_back({lp + s.name, s.shape, {{b.stacked(group + s.name), b.slot_offset(slot, n), 0, n}}});
    }
  };
  for (int64_t i = 0; i < c.layers; ++i) add_layer(model::slot_of_layer(c, i), "layers." + std::to_string(i) + ".");
  for (int64_t i = 0; i < c.mtp_layers; ++i)
    add_layer({model::StackGroup::Mtp, i, 0}, "mtp.layers." + std::to_string(i) + ".");
  for (const model::ParamSpec& s : model::mtp_specs(c))
    out.hf.push_back({s.name, s.shape, {{b.stacked(s.name), 0, 0, hs::numel(s.shape)}}});
  return out;
}

}  // namespace hs::checkpoint
