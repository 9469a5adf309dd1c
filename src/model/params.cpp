#include "model/params.h"

#include "core/collectives.h"
#include "core/hash.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace hs::model {

std::string group_name(StackGroup g) {
  switch (g) {
    case StackGroup::Local: return "local";
    case StackGroup::Global: return "global";
    case StackGroup::Remainder: return "remainder";
    case StackGroup::Mtp: return "mtp.layers";
  }
  return "?";
}

namespace {

ParamSpec matrix(std::string n, Shape s) { return {std::move(n), std::move(s), false, true, true}; }
ParamSpec vec(std::string n, Shape s) { return {std::move(n), std::move(s), false, false, false}; }
ParamSpec fp32(std::string n, Shape s) { return {std::move(n), std::move(s), true, false, false}; }

void add_ffn(const ModelConfig& c, std::vector<ParamSpec>& v) {
  const int64_t H = c.hidden;
  if (c.moe()) {
    v.push_back(matrix("mlp.gate.weight", {c.experts, H}));
    v.push_back(matrix("mlp.experts.gate_up_proj", {c.experts, 2 * c.expert_inter, H}));
    v.push_back(matrix("mlp.experts.down_proj", {c.experts, H, c.expert_inter}));
    v.push_back(matrix("mlp.shared_expert.gate_proj.weight", {c.shared_inter, H}));
    v.push_back(matrix("mlp.shared_expert.up_proj.weight", {c.shared_inter, H}));
    v.push_back(matrix("mlp.shared_expert.down_proj.weight", {H, c.shared_inter}));
    v.push_back(vec("mlp.shared_expert_gate.weight", {H}));
  } else {
    v.push_back(matrix("mlp.gate_proj.weight", {c.intermediate, H}));
    v.push_back(matrix("mlp.up_proj.weight", {c.intermediate, H}));
    v.push_back(matrix("mlp.down_proj.weight", {H, c.intermediate}));
  }
}

}  // namespace

std::vector<ParamSpec> layer_specs(const ModelConfig& c, LayerKind kind) {
  const int64_t H = c.hidden;
  std::vector<ParamSpec> v = {vec("input_layernorm.weight", {H}), vec("post_attention_layernorm.weight", {H})};
  if (kind == LayerKind::LinearAttention) {
    v.push_back(matrix("linear_attn.in_proj_qkv.weight", {c.conv_dim(), H}));
    v.push_back(matrix("linear_attn.in_proj_z.weight", {c.value_dim(), H}));
    v.push_back(matrix("linear_attn.in_proj_b.weight", {c.v_heads, H}));
    v.push_back(matrix("linear_attn.in_proj_a.weight", {c.v_heads, H}));
    v.push_back(vec("linear_attn.conv1d.weight", {c.conv_dim(), c.conv_width}));
    v.push_back(fp32("linear_attn.A_log", {c.v_heads}));
    v.push_back(fp32("linear_attn.dt_bias", {c.v_heads}));
    v.push_back(vec("linear_attn.norm.weight", {c.dv}));
    v.push_back(matrix("linear_attn.out_proj.weight", {H, c.value_dim()}));
  } else {
    v.push_back(matrix("self_attn.q_proj.weight", {c.q_heads * 2 * c.head_dim, H}));
    v.push_back(matrix("self_attn.k_proj.weight", {c.kv_heads * c.head_dim, H}));
    v.push_back(matrix("self_attn.v_proj.weight", {c.kv_heads * c.head_dim, H}));
    v.push_back(matrix("self_attn.o_proj.weight", {H, c.q_heads * c.head_dim}));
    v.push_back(vec("self_attn.q_norm.weight", {c.head_dim}));
    v.push_back(vec("self_attn.k_norm.weight", {c.head_dim}));
  }
  add_ffn(c, v);
  return v;
}

int ffn_offset(LayerKind kind) {
  return kind == LayerKind::LinearAttention ? static_cast<int>(p::kLinearFfn) : static_cast<int>(p::kFullFfn);
}

std::vector<ParamSpec> global_specs(const ModelConfig& c) {
  return {matrix("embed_tokens.weight", {c.vocab, c.hidden}), vec("norm.weight", {c.hidden}),
          matrix("lm_head.weight", {c.vocab, c.hidden})};
}

std::vector<ParamSpec> mtp_specs(const ModelConfig& c) {
  if (c.mtp_layers == 0) return {};
  const int64_t H = c.hidden;
  return {matrix("mtp.fc.weight", {H, 2 * H}), vec("mtp.pre_fc_norm_embedding.weight", {H}),
          vec("mtp.pre_fc_norm_hidden.weight", {H}), vec("mtp.norm.weight", {H})};
}

LayerSlot slot_of_layer(const ModelConfig& c, int64_t layer) {
  if (layer < 0 || layer >= c.layers) throw std::out_of_range("layer " + std::to_string(layer) + " out of range");
  int64_t b = layer / c.cycle, pos = layer % c.cycle;
  if (b >= c.blocks()) return {StackGroup::Remainder, pos, 0};
  if (pos == c.cycle - 1) return {StackGroup::Global, b, 0};
  return {StackGroup::Local, b, pos};
}

int64_t layer_of_slot(const ModelConfig& c, const LayerSlot& s) {
  switch (s.group) {
    case StackGroup::Local: return s.block * c.cycle + s.local;
    case StackGroup::Global: return s.block * c.cycle + c.cycle - 1;
    case StackGroup::Remainder: return c.blocks() * c.cycle + s.block;
    case StackGroup::Mtp: return c.layers + s.block;  // as vLLM numbers them: after the decoder's layers
  }
  return -1;
}

bool is_routed_expert(const ParamSpec& s) { return s.name.rfind("mlp.experts.", 0) == 0; }

int64_t shard_units(const ParamSpec& s) { return is_routed_expert(s) ? s.shape.at(0) : 1; }

int64_t layer_shard_elems(const ParamSpec& s, int64_t shards) {
  const int64_t units = shard_units(s);
  return units * Collectives::shard_elems(hs::numel(s.shape) / units, shards);
}

ParamSet::ParamSet(const ModelConfig& c, DType weight_dtype, MemoryAccountant& mem, MemCategory cat, bool zero,
                   int64_t shards)
    : cfg_(c), shards_(shards) {
  if (shards < 1) throw std::invalid_argument("shard count must be >= 1");
  auto add = [&](const std::string& prefix, const ParamSpec& s, const Shape& lead) {
    Shape full = lead;
    full.insert(full.end(), s.shape.begin(), s.shape.end());
    DType t = (s.keep_fp32 || cat == MemCategory::Gradients) ? DType::F32 : weight_dtype;
    std::string name = prefix + s.name;
    // Sharded: each layer's tensor is split over the ranks on its own, so a sub-layer's gather reads contiguous
    // shards: lead ++ [layer_shard_elems].
    Shape stored = full;
    if (shards > 1) {
      stored = lead;
      stored.push_back(layer_shard_elems(s, shards));
    }
    Tensor tensor = zero ? Tensor::zeros(mem, cat, t, stored, name) : Tensor::empty(mem, cat, t, stored, name);
    params_.push_back({name, s, lead, std::move(tensor), full, t, {}});
  };
  for (const auto& s : global_specs(c)) add("", s, {});
  struct G { StackGroup g; Shape lead; LayerKind kind; };
  const G groups[4] = {{StackGroup::Local, {c.blocks(), c.local_per_block()}, LayerKind::LinearAttention},
                       {StackGroup::Global, {c.blocks()}, LayerKind::FullAttention},
                       {StackGroup::Remainder, {c.remainder()}, LayerKind::LinearAttention},
                       {StackGroup::Mtp, {c.mtp_layers}, LayerKind::FullAttention}};
  for (const G& grp : groups) {
    first_[static_cast<int>(grp.g)] = params_.size();
    if (hs::numel(grp.lead) == 0) continue;
    for (const auto& s : layer_specs(c, grp.kind)) add(group_name(grp.g) + ".", s, grp.lead);
  }
  mtp_first_ = params_.size();
  for (const auto& s : mtp_specs(c)) add("", s, {});
}

const StackedParam* ParamSet::find(const std::string& name) const {
  for (const auto& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

LayerWeights ParamSet::layer(const LayerSlot& s) const {
  LayerWeights w{s.kind(), {}, shards_};
  size_t n = layer_specs(cfg_, s.kind()).size();
  size_t first = first_[static_cast<int>(s.group)];
  for (size_t i = 0; i < n; ++i) {
    const StackedParam& sp = params_.at(first + i);
    if (!sp.layers.empty()) {
      const int64_t at = s.group == StackGroup::Local ? s.block * sp.lead.at(1) + s.local : s.block;
      w.t.push_back(TensorView(sp.layers.at(static_cast<size_t>(at)), sp.dtype, sp.spec.shape));
      continue;
    }
    TensorView v = sp.tensor.view()[s.block];
    if (s.group == StackGroup::Local) v = v[s.local];
    // Sharded: this rank's shard of the layer's tensor, described by the per-layer shape the gather produces.
    if (shards_ > 1) v = TensorView(v.data, sp.dtype, sp.spec.shape);
    w.t.push_back(v);
  }
  return w;
}

int64_t ParamSet::numel() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.layers.empty() ? p.tensor.numel() : hs::numel(p.full_shape);
  return n;
}

size_t ParamSet::nbytes() const {
  size_t n = 0;
  for (const auto& p : params_)
    n += p.layers.empty() ? p.tensor.nbytes() : static_cast<size_t>(hs::numel(p.full_shape)) * dtype_size(p.dtype);
  return n;
}

void ParamSet::zero() {
  for (auto& p : params_)
    if (p.tensor.data()) std::fill_n(static_cast<unsigned char*>(p.tensor.data()), p.tensor.nbytes(), 0);
}

namespace {

uint64_t hash_name(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (char ch : s) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
  return h;
}
double uniform01(uint64_t key, uint64_t i) {
  return (static_cast<double>(splitmix64(key ^ splitmix64(i)) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

template <typename T, typename F>
void fill(T* data, int64_t n, F f) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) data[i] = from_f32<T>(static_cast<float>(f(static_cast<uint64_t>(i))));
}

}  // namespace

void init_params(ParamSet& params, uint64_t seed) {
  const ModelConfig& c = params.config();
  for (auto& prm : params.all()) {
    if (!prm.tensor.data()) continue;
    const uint64_t key = splitmix64(seed) ^ hash_name(prm.name);
    const std::string& n = prm.spec.name;
    auto gen = [&](uint64_t i) -> double {
      if (prm.spec.is_matrix) {
        double u1 = uniform01(key, 2 * i), u2 = uniform01(key, 2 * i + 1);
        return 0.02 * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
      }
      if (n == "linear_attn.A_log") return std::log(1.0 + 15.0 * uniform01(key, i));
      if (n == "linear_attn.dt_bias") return std::log(std::expm1(0.001 + 0.099 * uniform01(key, i)));
      if (n == "linear_attn.norm.weight") return 1.0;
      if (n == "linear_attn.conv1d.weight")
        return (2.0 * uniform01(key, i) - 1.0) / std::sqrt(static_cast<double>(c.conv_width));
      if (n == "mlp.shared_expert_gate.weight") {
        double u1 = uniform01(key, 2 * i), u2 = uniform01(key, 2 * i + 1);
        return 0.02 * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
      }
      return 0.0;  // zero-centred norms: runtime scale 1 + w = 1
    };
    if (prm.tensor.dtype() == DType::F32) fill(prm.tensor.as<float>(), prm.tensor.numel(), gen);
    else fill(prm.tensor.as<bf16>(), prm.tensor.numel(), gen);
  }
}

}  // namespace hs::model

namespace hs::model {

namespace {

// The pairs of tensors copy_shard and gather_full move between, checked to be of the same model and dtypes, as
// `units` runs of `per_unit` elements, each sharded on its own into `shard` elements per rank.
struct ShardGeometry {
  int64_t units, per_unit, shard;
  size_t elem;
};
ShardGeometry geometry(const StackedParam& full, const StackedParam& shard, int64_t shards) {
  if (full.name != shard.name || full.dtype != shard.dtype || full.full_shape != shard.full_shape)
    throw std::invalid_argument("shards of '" + shard.name + "' do not match the full tensor '" + full.name + "'");
  const int64_t units = shard_units(shard.spec), per_unit = hs::numel(shard.spec.shape) / units;
  return {hs::numel(shard.lead) * units, per_unit, Collectives::shard_elems(per_unit, shards), dtype_size(shard.dtype)};
}

void check_sets(const ParamSet& full, const ParamSet& shard) {
  if (full.shards() != 1 || full.all().size() != shard.all().size())
    throw std::invalid_argument("a sharded set needs a full set of the same model");
}

}  // namespace

void copy_shard(const ParamSet& full, ParamSet& shard, int64_t rank) {
  check_sets(full, shard);
  for (size_t t = 0; t < full.all().size(); ++t) {
    const StackedParam& f = full.all()[t];
    StackedParam& s = shard.all()[t];
    const ShardGeometry g = geometry(f, s, shard.shards());
    const int64_t begin = std::min(g.per_unit, rank * g.shard), count = std::min(g.shard, g.per_unit - begin);
    for (int64_t l = 0; l < g.units; ++l) {
      const char* src = static_cast<const char*>(f.tensor.data()) + (l * g.per_unit + begin) * g.elem;
      char* dst = static_cast<char*>(s.tensor.data()) + l * g.shard * g.elem;
      std::memcpy(dst, src, static_cast<size_t>(count) * g.elem);
      std::memset(dst + count * g.elem, 0, static_cast<size_t>(g.shard - count) * g.elem);
    }
  }
}

void gather_full(const ParamSet& shard, ParamSet& full, Collectives& group) {
  check_sets(full, shard);
  if (group.size() != shard.shards())
    throw std::invalid_argument("the set is sharded " + std::to_string(shard.shards()) + " ways but the group has " +
                                std::to_string(group.size()) + " ranks");
  std::vector<char> gathered;
  for (size_t t = 0; t < full.all().size(); ++t) {
    const StackedParam& s = shard.all()[t];
    StackedParam& f = full.all()[t];
    const ShardGeometry g = geometry(f, s, shard.shards());
    gathered.resize(static_cast<size_t>(group.padded_elems(g.per_unit)) * g.elem);
    for (int64_t l = 0; l < g.units; ++l) {
      char* src = static_cast<char*>(s.tensor.data()) + l * g.shard * g.elem;
      group.all_gather(TensorView(src, s.dtype, {g.shard}), gathered.data(), s.dtype, g.per_unit);
      std::memcpy(static_cast<char*>(f.tensor.data()) + l * g.per_unit * g.elem, gathered.data(),
                  static_cast<size_t>(g.per_unit) * g.elem);
    }
  }
}

}  // namespace hs::model
