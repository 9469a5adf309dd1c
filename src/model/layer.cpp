#include "model/layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "core/compute.h"
#include "core/profile.h"
#include "distributed/expert_exchange.h"
#include "distributed/expert_pieces.h"
#include "kernels/conv.h"
#include "kernels/decode.h"
#include "kernels/gdn_gates.h"
#include "kernels/norms.h"
#include "kernels/rope.h"
#include "model/layer_recipe.h"
#include "model/linear.h"

namespace hs::model {

using namespace hs::kernels;

template <typename T>
ComputeWeights<T> start_compute_weights(const ModelConfig& c, const LayerWeights& w, MemoryAccountant& mem,
                                        Collectives* comm) {
  using Use = distributed::WeightSource::Use;
  const std::vector<ParamSpec> specs = layer_specs(c, w.kind);
  std::vector<distributed::WeightSource> sources;
  sources.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i)  // the routed experts: taken piece by piece by the MoE kernel
    sources.push_back({&w[i], &specs[i].name,
                       is_routed_expert(specs[i]) ? Use::Skip : specs[i].is_matrix ? Use::Matrix : Use::Vector});
  return distributed::start_compute_weights<T>(sources, w.shards, mem, comm);
}

template <typename T>
ComputeWeights<T> compute_weights(const ModelConfig& c, const LayerWeights& w, MemoryAccountant& mem,
                                  Collectives* comm) {
  ComputeWeights<T> cw = start_compute_weights<T>(c, w, mem, comm);
  cw.wait();
  return cw;
}

namespace {

// The packed forms of a sub-layer's matrix weights (in the compute dtype, as `w` holds them) for one use, packed now
// (LayerContext::pack_weights; nothing otherwise). Routed experts are not among them: their products take the row
// count at execution, which oneDNN runs on plain weights; nor are the weights packing does not apply to (skinny ones).
template <typename T>
std::vector<PackedWeight> pack_weights(const LayerContext& ctx, const LayerWeights& lw, const ComputeWeights<T>& w,
                                       WeightUse use) {
  std::vector<PackedWeight> out;
  if (!ctx.pack_weights) return out;
  const auto specs = layer_specs(ctx.cfg, lw.kind);
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamSpec& s = specs[i];
    if (!s.is_matrix || is_routed_expert(s) || s.shape.size() != 2) continue;
    PackedWeight pw(w.ptr[i], dtype_of<T>(), s.shape[0], s.shape[1], use, ctx.mem, MemCategory::WeightCasts,
                    (use == WeightUse::Forward ? "packed_fwd:" : "packed_bwd:") + s.name);
    if (!pw.active()) continue;
    pw.pack();
    out.push_back(std::move(pw));
  }
  return out;
}

// Allocation helper: what is kept for backward is MemCategory::Activations, the rest Workspace.
struct Alloc {
  MemoryAccountant& mem;
  bool keep;
  template <typename E> Buffer make(int64_t n, const char* tag, bool zero = false) const {
    return mem.allocate_n<E>(static_cast<size_t>(n), keep ? MemCategory::Activations : MemCategory::Workspace, tag, zero);
  }
};
template <typename E> Buffer scratch(MemoryAccountant& mem, int64_t n, const char* tag, bool zero = false) {
  return mem.allocate_n<E>(static_cast<size_t>(n), MemCategory::Workspace, tag, zero);
}

template <typename T>
MoeWeights<T> moe_weights(const ComputeWeights<T>& w, int f, ExpertStream<T>* experts,
                          ExpertRowExchange* exchange) {
  return {w.mat(f + p::kRouter),     nullptr,  nullptr, w.mat(f + p::kSharedGate), w.mat(f + p::kSharedUp),
          w.mat(f + p::kSharedDown), w.vec(f + p::kSharedExpertGate), experts, exchange};
}
// The token exchange of expert parallelism (LayerContext::ep_group), none without it.
distributed::TokenExchange token_exchange(const LayerContext& ctx) {
  return distributed::TokenExchange(ctx.expert_parallel > 1 ? ctx.ep_group : nullptr);
}

// The layer's routed experts as this rank stores them (their gradients too in backward), for PiecedExperts.
distributed::StoredExperts stored_experts(const ModelConfig& c, const LayerWeights& w, const LayerWeights* grads) {
  const int f = ffn_offset(w.kind);
  distributed::StoredExperts x;
  x.experts = c.experts, x.hidden = c.hidden, x.expert_inter = c.expert_inter;
  x.gate_up = w[f + p::kGateUp], x.down = w[f + p::kDown], x.shards = w.shards;
  if (grads) {
    x.backward = true;
    x.dgate_up = static_cast<float*>((*grads)[f + p::kGateUp].data);
    x.ddown = static_cast<float*>((*grads)[f + p::kDown].data);
  }
  return x;
}
MoeShape moe_shape(const ModelConfig& c, int64_t N) {
  return {N, c.hidden, c.experts, c.top_k, c.expert_inter, c.shared_inter, c.norm_topk_prob};
}
float* G(const LayerWeights& g, size_t i) { return static_cast<float*>(g[i].data); }

// The gate's gradient into the gate rows of the q_proj output gradient [N, heads, 2*hd] (the query rows are written
// by the q norm's backward), rounded to T.
template <typename D>
void merge_gate(const float* dgate, D* dqg, int64_t N, int64_t heads, int64_t hd) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "merge_query_gate");
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < heads; ++h) {
      const float* src = dgate + (n * heads + h) * hd;
      D* dst = dqg + (n * heads + h) * 2 * hd + hd;
#pragma omp simd
      for (int64_t j = 0; j < hd; ++j) dst[j] = from_f32<D>(src[j]);
    }
}

kernels::DeltaRuleProducts delta_rule_products(const LayerContext& ctx) {
  return ctx.delta_rule_bf16_products ? kernels::DeltaRuleProducts::Bf16 : kernels::DeltaRuleProducts::Fp32;
}

template <typename T>
void gdn_forward(const LayerContext& ctx, const ComputeWeights<T>& w, const T* h_in, T* mix, LayerSaved<T>& s,
                 bool keep) {
  const ModelConfig& c = ctx.cfg;
  MemoryAccountant& mem = ctx.mem;
  const int64_t N = ctx.tokens(), H = c.hidden, CD = c.conv_dim(), KD = c.key_dim(), VD = c.value_dim();
  const int64_t Hk = c.k_heads, Hv = c.v_heads;
  Alloc A{mem, keep};
  s.xn = A.make<T>(N * H, "gdn.xn");
  s.rstd1 = A.make<float>(N, "gdn.rstd1");
  s.qkv = A.make<T>(N * CD, "gdn.qkv");
  s.z = A.make<T>(N * VD, "gdn.z");
  s.b = A.make<T>(N * Hv, "gdn.b");
  s.a = A.make<T>(N * Hv, "gdn.a");
  s.q = A.make<T>(N * KD, "gdn.q");
  s.k = A.make<T>(N * KD, "gdn.k");
  s.v = A.make<T>(N * VD, "gdn.v");
  s.qn = A.make<T>(N * KD, "gdn.qn");
  s.kn = A.make<T>(N * KD, "gdn.kn");
  s.rstdq = A.make<float>(N * Hk, "gdn.rstdq");
  s.rstdk = A.make<float>(N * Hk, "gdn.rstdk");
  s.beta = A.make<float>(N * Hv, "gdn.beta");
  s.g = A.make<float>(N * Hv, "gdn.g");
  s.o = A.make<T>(N * VD, "gdn.o");
  auto act = [&](recipe::Act x) -> T* {
    switch (x) {
      case recipe::Act::kXn: return ptr<T>(s.xn);
      case recipe::Act::kQkv: return ptr<T>(s.qkv);
      case recipe::Act::kZ: return ptr<T>(s.z);
      case recipe::Act::kB: return ptr<T>(s.b);
      case recipe::Act::kA: return ptr<T>(s.a);
      case recipe::Act::kY: return ptr<T>(s.y);
      case recipe::Act::kMix: return mix;
      default: throw std::logic_error("gdn_forward: no buffer for this activation");
    }
  };
  compute(mem, [&] {
    rmsnorm_forward(h_in, w.vec(p::kInputNorm), ptr<T>(s.xn), ptr<float>(s.rstd1), N, H, float(c.rms_eps));
    for (const recipe::Product& m : recipe::gdn_in(c)) linear_forward(act(m.in), w.mat(m.weight), act(m.out), N, m.cols, m.depth);
    // The conv's channels are [q | k | v]: written straight into the three tensors.
    const auto qkv = ColumnBlocks<T>().add(ptr<T>(s.q), KD).add(ptr<T>(s.k), KD).add(ptr<T>(s.v), VD);
    if (ctx.cache)
      causal_conv_silu_cached(ptr<T>(s.qkv), w.vec(p::kConv), qkv, ptr<T>(ctx.cache->conv), ctx.slots, ctx.batch,
                              ctx.seq, CD, c.conv_width);
    else
      causal_conv_silu_forward(ptr<T>(s.qkv), w.vec(p::kConv), qkv, ctx.batch, ctx.seq, CD, c.conv_width,
                               ctx.document_positions());
    recipe::gdn_norms_gates(c, w.vec(p::kALog), w.vec(p::kDtBias), ptr<T>(s.q), ptr<T>(s.k), ptr<T>(s.b), ptr<T>(s.a),
                            ptr<T>(s.qn), ptr<T>(s.kn), ptr<float>(s.rstdq), ptr<float>(s.rstdk), ptr<float>(s.beta),
                            ptr<float>(s.g), N);
  });
  DeltaRuleShape ds{ctx.batch, ctx.seq, Hk, Hv, c.dk, c.dv, ctx.document_positions()};
  if (!ctx.cache) {
    delta_rule_forward(ds, ptr<T>(s.qn), ptr<T>(s.kn), ptr<T>(s.v), ptr<float>(s.beta), ptr<float>(s.g), ptr<T>(s.o),
                       keep ? &s.delta : nullptr, mem, keep && ctx.keep_recomputables, delta_rule_products(ctx));
  } else if (ctx.seq == 1) {  // one token per sequence: the recurrent step (the chunked form would pad it to 64)
    compute(mem, [&] {
      delta_rule_step(ds, ptr<T>(s.qn), ptr<T>(s.kn), ptr<T>(s.v), ptr<float>(s.beta), ptr<float>(s.g), ptr<T>(s.o),
                      ptr<float>(ctx.cache->state), ctx.slots);
    });
  } else {
    delta_rule_forward_cached(ds, ptr<T>(s.qn), ptr<T>(s.kn), ptr<T>(s.v), ptr<float>(s.beta), ptr<float>(s.g),
                              ptr<T>(s.o), ptr<float>(ctx.cache->state), ctx.slots, mem);
  }
  s.y = A.make<T>(N * VD, "gdn.y");
  s.rstdg = A.make<float>(N * Hv, "gdn.rstdg");
  compute(mem, [&] {
    gated_rmsnorm_forward(ptr<T>(s.o), ptr<T>(s.z), w.vec(p::kGdnNorm), ptr<T>(s.y), ptr<float>(s.rstdg), N * Hv, c.dv,
                          float(c.rms_eps));
    const recipe::Product m = recipe::gdn_out(c);
    linear_forward(act(m.in), w.mat(m.weight), act(m.out), N, m.cols, m.depth);
  });
}

template <typename T>
void gdn_backward(const LayerContext& ctx, const ComputeWeights<T>& w, const LayerWeights& gr, const T* h_in,
                  const LayerSaved<T>& s, const float* dmix, const T* dmix_t, float* dh_in) {
  const ModelConfig& c = ctx.cfg;
  MemoryAccountant& mem = ctx.mem;
  const int64_t N = ctx.tokens(), H = c.hidden, CD = c.conv_dim(), KD = c.key_dim(), VD = c.value_dim();
  const int64_t Hk = c.k_heads, Hv = c.v_heads;
  Buffer dy = scratch<float>(mem, N * VD, "gdn.dy");
  Buffer d_o = scratch<float>(mem, N * VD, "gdn.do");
  Buffer dz = scratch<T>(mem, N * VD, "gdn.dz");  // in T: it only feeds the z projection's products
  compute(mem, [&] {
    linear_backward_from(ptr<T>(s.y), w.mat(p::kOut), dmix_t, ptr<float>(dy), G(gr, p::kOut), N, H, VD, false);
    gated_rmsnorm_backward(ptr<T>(s.o), ptr<T>(s.z), w.vec(p::kGdnNorm), ptr<float>(s.rstdg), ptr<float>(dy),
                           ptr<float>(d_o), ptr<T>(dz), G(gr, p::kGdnNorm), N * Hv, c.dv, /*accumulate=*/false);
  });
  dy.reset();
  // Written whole by the delta rule's backward (accumulate = false): not cleared first.
  Buffer dqn = scratch<float>(mem, N * KD, "gdn.dqn");
  Buffer dkn = scratch<float>(mem, N * KD, "gdn.dkn");
  Buffer dv = scratch<float>(mem, N * VD, "gdn.dv");
  Buffer dbeta = scratch<float>(mem, N * Hv, "gdn.dbeta");
  Buffer dg = scratch<float>(mem, N * Hv, "gdn.dg");
  DeltaRuleShape ds{ctx.batch, ctx.seq, Hk, Hv, c.dk, c.dv, ctx.document_positions()};
  delta_rule_backward(ds, ptr<T>(s.qn), ptr<T>(s.kn), ptr<T>(s.v), ptr<float>(s.beta), ptr<float>(s.g), s.delta,
                      ptr<float>(d_o), ptr<float>(dqn), ptr<float>(dkn), ptr<float>(dv), ptr<float>(dbeta),
                      ptr<float>(dg), mem, /*accumulate=*/false, delta_rule_products(ctx));
  d_o.reset();
  Buffer db = scratch<float>(mem, N * Hv, "gdn.db", true);
  Buffer da = scratch<float>(mem, N * Hv, "gdn.da", true);
  Buffer dq = scratch<float>(mem, N * KD, "gdn.dq");
  Buffer dk = scratch<float>(mem, N * KD, "gdn.dk");
  compute(mem, [&] {
    const float qscale = 1.0f / std::sqrt(static_cast<float>(c.dk));
    l2norm_backward(L2NormBackwardPair<T>{{ptr<T>(s.q), ptr<T>(s.k)},
                                          {ptr<float>(s.rstdq), ptr<float>(s.rstdk)},
                                          {ptr<float>(dqn), ptr<float>(dkn)},
                                          {ptr<float>(dq), ptr<float>(dk)},
                                          {qscale, 1.0f}},
                    N * Hk, c.dk, false);
    gdn_gates_backward(ptr<T>(s.b), ptr<T>(s.a), w.vec(p::kALog), w.vec(p::kDtBias), ptr<float>(dbeta),
                       ptr<float>(dg), ptr<float>(db), ptr<float>(da), G(gr, p::kALog), G(gr, p::kDtBias), N, Hv);
  });
  dqn.reset();
  dkn.reset();
  dbeta.reset();
  dg.reset();
  // The conv reads its output gradient [dq | dk | dv] from the three tensors and writes dqkv in T, the in_proj
  // product's input (no gather into one fp32 array, no cast pass).
  Buffer dqkv = scratch<T>(mem, N * CD, "gdn.dqkv");
  compute(mem, [&] {
    causal_conv_silu_backward<T, T>(
        ptr<T>(s.qkv), w.vec(p::kConv),
        ColumnBlocks<const float>().add(ptr<float>(dq), KD).add(ptr<float>(dk), KD).add(ptr<float>(dv), VD),
        ptr<T>(dqkv), G(gr, p::kConv), ctx.batch, ctx.seq, CD, c.conv_width, /*accumulate_dx=*/false,
        ctx.document_positions());
  });
  dq.reset();
  dk.reset();
  dv.reset();
  Buffer dxn = scratch<float>(mem, N * H, "gdn.dxn");
  compute(mem, [&] {
    linear_backward_from(ptr<T>(s.xn), w.mat(p::kQkv), ptr<T>(dqkv), ptr<float>(dxn), G(gr, p::kQkv), N, CD, H, false);
    linear_backward_from(ptr<T>(s.xn), w.mat(p::kZ), ptr<T>(dz), ptr<float>(dxn), G(gr, p::kZ), N, VD, H);
  });
  linear_backward(ptr<T>(s.xn), w.mat(p::kB), ptr<float>(db), ptr<float>(dxn), G(gr, p::kB), N, Hv, H, mem);
  linear_backward(ptr<T>(s.xn), w.mat(p::kA), ptr<float>(da), ptr<float>(dxn), G(gr, p::kA), N, Hv, H, mem);
  compute(mem, [&] {  // dh_in = dmix (the residual's gradient) + the norm's
    rmsnorm_backward(h_in, w.vec(p::kInputNorm), ptr<float>(s.rstd1), ptr<float>(dxn), dh_in, G(gr, p::kInputNorm), N,
                     H, /*accumulate=*/false, /*residual=*/dmix);
  });
}

template <typename T>
void attention_forward(const LayerContext& ctx, const ComputeWeights<T>& w, const T* h_in, T* mix, LayerSaved<T>& s,
                       bool keep) {
  const ModelConfig& c = ctx.cfg;
  MemoryAccountant& mem = ctx.mem;
  const int64_t N = ctx.tokens(), H = c.hidden, nH = c.q_heads, nKV = c.kv_heads, hd = c.head_dim;
  Alloc A{mem, keep};
  s.xn = A.make<T>(N * H, "attn.xn");
  s.rstd1 = A.make<float>(N, "attn.rstd1");
  s.q_raw = A.make<T>(N * nH * hd, "attn.q_raw");
  s.gate = A.make<T>(N * nH * hd, "attn.gate");
  s.k_raw = A.make<T>(N * nKV * hd, "attn.k_raw");
  s.vv = A.make<T>(N * nKV * hd, "attn.v");
  Buffer qg = scratch<T>(mem, N * nH * 2 * hd, "attn.q_proj_out");
  auto act = [&](recipe::Act x) -> T* {
    switch (x) {
      case recipe::Act::kXn: return ptr<T>(s.xn);
      case recipe::Act::kQGate: return ptr<T>(qg);
      case recipe::Act::kKRaw: return ptr<T>(s.k_raw);
      case recipe::Act::kV: return ptr<T>(s.vv);
      case recipe::Act::kAttn: return ptr<T>(s.attn_out);
      case recipe::Act::kMix: return mix;
      default: throw std::logic_error("attention_forward: no buffer for this activation");
    }
  };
  compute(mem, [&] {
    rmsnorm_forward(h_in, w.vec(p::kInputNorm), ptr<T>(s.xn), ptr<float>(s.rstd1), N, H, float(c.rms_eps));
    for (const recipe::Product& m : recipe::attention_in(c))
      linear_forward(act(m.in), w.mat(m.weight), act(m.out), N, m.cols, m.depth);
    recipe::split_query_gate(c, ptr<T>(qg), ptr<T>(s.q_raw), ptr<T>(s.gate), N);
  });
  qg.reset();
  s.qn = A.make<T>(N * nH * hd, "attn.q");
  s.kn = A.make<T>(N * nKV * hd, "attn.k");
  s.rstdq = A.make<float>(N * nH, "attn.rstdq");
  s.rstdk = A.make<float>(N * nKV, "attn.rstdk");
  s.attn_out = A.make<T>(N * nH * hd, "attn.out");
  AttentionShape as{ctx.batch, ctx.seq, nH, nKV, hd, ctx.document_positions()};
  // Decoding writes the keys and values into the cache. Rows that all start their sequences (whole prompts) still
  // take the flash kernel over their own keys; later pieces and single tokens attend to the cache.
  auto starts_sequences = [&] {
    if (!ctx.cache) return true;
    for (int64_t b = 0; b < ctx.batch; ++b)
      if (ctx.positions[b * ctx.seq] != 0) return false;
    return true;
  };
  const bool from_start = starts_sequences();
  compute(mem, [&] {
    recipe::attention_norms_rope(c, w.vec(p::kQNorm), w.vec(p::kKNorm), ptr<T>(s.q_raw), ptr<T>(s.k_raw), ptr<T>(s.qn),
                                 ptr<T>(s.kn), ptr<float>(s.rstdq), ptr<float>(s.rstdk), ctx.positions, N);
    if (ctx.cache)
      kv_cache_write({nKV, hd, ctx.cache->capacity}, ptr<T>(s.kn), ptr<T>(s.vv), ptr<T>(ctx.cache->k),
                     ptr<T>(ctx.cache->v), ctx.slots, ctx.positions, ctx.batch, ctx.seq);
  });
  if (ctx.cache) {
    const KvCacheShape kc{nKV, hd, ctx.cache->capacity};
    if (!from_start)
      attention_cached_forward(kc, nH, ptr<T>(s.qn), ptr<T>(s.gate), ptr<T>(ctx.cache->k), ptr<T>(ctx.cache->v),
                               ptr<T>(s.attn_out), ctx.slots, ctx.positions, ctx.batch, ctx.seq, mem);
  }
  if (from_start)
    gated_attention_forward(as, ptr<T>(s.qn), ptr<T>(s.kn), ptr<T>(s.vv), ptr<T>(s.gate), ptr<T>(s.attn_out),
                            keep ? &s.attn : nullptr, mem);
  compute(mem, [&] {
    const recipe::Product m = recipe::attention_out(c);
    linear_forward(act(m.in), w.mat(m.weight), act(m.out), N, m.cols, m.depth);
  });
}

template <typename T>
void attention_backward(const LayerContext& ctx, const ComputeWeights<T>& w, const LayerWeights& gr, const T* h_in,
                        const LayerSaved<T>& s, const float* dmix, const T* dmix_t, float* dh_in) {
  const ModelConfig& c = ctx.cfg;
  MemoryAccountant& mem = ctx.mem;
  const int64_t N = ctx.tokens(), H = c.hidden, nH = c.q_heads, nKV = c.kv_heads, hd = c.head_dim;
  Buffer dattn = scratch<float>(mem, N * nH * hd, "attn.dout");
  compute(mem, [&] {
    linear_backward_from(ptr<T>(s.attn_out), w.mat(p::kO), dmix_t, ptr<float>(dattn), G(gr, p::kO), N, H, nH * hd,
                         false);
  });
  Buffer dq = scratch<float>(mem, N * nH * hd, "attn.dq", true);
  Buffer dk = scratch<float>(mem, N * nKV * hd, "attn.dk", true);
  Buffer dv = scratch<float>(mem, N * nKV * hd, "attn.dv", true);
  Buffer dgate = scratch<float>(mem, N * nH * hd, "attn.dgate", true);
  AttentionShape as{ctx.batch, ctx.seq, nH, nKV, hd, ctx.document_positions()};
  gated_attention_backward(as, ptr<T>(s.qn), ptr<T>(s.kn), ptr<T>(s.vv), ptr<T>(s.gate), s.attn, ptr<float>(dattn),
                           ptr<float>(dq), ptr<float>(dk), ptr<float>(dv), ptr<float>(dgate), mem);
  dattn.reset();
  // The q_proj output gradient [N, heads, query | gate] and the k_proj one are written in T straight by the norms'
  // backward (and the gate's gradient rounded into its slots): no fp32 copies, no merge pass, no cast before the
  // products (the same bits as norm, merge, then cast).
  Buffer dqg = scratch<T>(mem, N * nH * 2 * hd, "attn.dq_proj_out");
  Buffer dk_raw = scratch<T>(mem, N * nKV * hd, "attn.dk_raw");
  compute(mem, [&] {
    rope_backward(ptr<float>(dq), nH, ptr<float>(dk), nKV, ctx.positions, N, hd, c.rotary_dim(), float(c.rope_theta));
    rmsnorm_backward_strided(ptr<T>(s.q_raw), w.vec(p::kQNorm), ptr<float>(s.rstdq), ptr<float>(dq), ptr<T>(dqg),
                             2 * hd, G(gr, p::kQNorm), N * nH, hd);
    rmsnorm_backward_strided(ptr<T>(s.k_raw), w.vec(p::kKNorm), ptr<float>(s.rstdk), ptr<float>(dk), ptr<T>(dk_raw), hd,
                             G(gr, p::kKNorm), N * nKV, hd);
    merge_gate(ptr<float>(dgate), ptr<T>(dqg), N, nH, hd);
  });
  dq.reset();
  dk.reset();
  dgate.reset();
  Buffer dxn = scratch<float>(mem, N * H, "attn.dxn");
  compute(mem, [&] {
    linear_backward_from(ptr<T>(s.xn), w.mat(p::kQ), ptr<T>(dqg), ptr<float>(dxn), G(gr, p::kQ), N, nH * 2 * hd, H,
                         false);
    linear_backward_from(ptr<T>(s.xn), w.mat(p::kK), ptr<T>(dk_raw), ptr<float>(dxn), G(gr, p::kK), N, nKV * hd, H);
  });
  linear_backward(ptr<T>(s.xn), w.mat(p::kV), ptr<float>(dv), ptr<float>(dxn), G(gr, p::kV), N, nKV * hd, H, mem);
  compute(mem, [&] {  // dh_in = dmix (the residual's gradient) + the norm's
    rmsnorm_backward(h_in, w.vec(p::kInputNorm), ptr<float>(s.rstd1), ptr<float>(dxn), dh_in, G(gr, p::kInputNorm), N,
                     H, /*accumulate=*/false, /*residual=*/dmix);
  });
}

}  // namespace

template <typename T>
RouterStats layer_forward(const LayerContext& ctx, const LayerWeights& lw, const T* h_in, T* h_out,
                          LayerSaved<T>* saved, ComputeWeights<T>* weights) {
  const ModelConfig& c = ctx.cfg;
  MemoryAccountant& mem = ctx.mem;
  const bool keep = saved != nullptr;
  const int64_t N = ctx.tokens(), H = c.hidden;
  LayerSaved<T> local;
  LayerSaved<T>& s = keep ? *saved : local;
  s.weights = weights ? std::move(*weights) : start_compute_weights<T>(c, lw, mem, ctx.comm);
  {
    profile::Scope profile_scope(profile::Phase::Communication, "wait_weights");
    s.weights.wait();
  }
  const ComputeWeights<T>& w = s.weights;
  const std::vector<PackedWeight> packed = pack_weights(ctx, lw, w, WeightUse::Forward);
  Alloc A{mem, keep};
  {
    Buffer mix = scratch<T>(mem, N * H, "layer.mixer_out");
    if (lw.kind == LayerKind::LinearAttention) gdn_forward(ctx, w, h_in, ptr<T>(mix), s, keep);
    else attention_forward(ctx, w, h_in, ptr<T>(mix), s, keep);
    s.h_mid = A.make<T>(N * H, "layer.h_mid");
    s.x2 = A.make<T>(N * H, "ffn.xn");
    s.rstd2 = A.make<float>(N, "ffn.rstd");
    compute(mem, [&] {  // h_mid = h_in + mix and its post-attention norm, one pass
      recipe::residual_post_norm(c, w.vec(p::kPostNorm), h_in, ptr<T>(mix), ptr<T>(s.h_mid), ptr<T>(s.x2),
                                 ptr<float>(s.rstd2), N);
    });
  }
  const int f = ffn_offset(lw.kind);
  Buffer ffn_out = scratch<T>(mem, N * H, "ffn.out");
  RouterStats stats;
  if (c.moe()) {
    distributed::PiecedExperts<T> experts(stored_experts(c, lw, nullptr), mem, ctx.comm, ctx.expert_parallel, ctx.piece_bytes);
    distributed::TokenExchange exchange = token_exchange(ctx);
    stats = moe_forward(moe_shape(c, N), ptr<T>(s.x2), moe_weights(w, f, &experts, exchange.get()), ptr<T>(ffn_out),
                        keep ? &s.moe : nullptr, mem);
  } else {
    swiglu_forward(N, H, c.intermediate, ptr<T>(s.x2), w.mat(f + p::kMlpGate), w.mat(f + p::kMlpUp),
                   w.mat(f + p::kMlpDown), ptr<T>(ffn_out), keep ? &s.mlp : nullptr, mem);
  }
  compute(mem, [&] { add(ptr<T>(s.h_mid), ptr<T>(ffn_out), h_out, N * H); });
  return stats;
}

template <typename T>
void layer_backward(const LayerContext& ctx, const LayerWeights& lw, const LayerWeights& gr, const T* h_in,
                    const LayerSaved<T>& s, const float* dh_out, float* dh_in, const float* aux_dprob) {
  const ModelConfig& c = ctx.cfg;
  MemoryAccountant& mem = ctx.mem;
  const int64_t N = ctx.tokens(), H = c.hidden;
  const ComputeWeights<T>& w = s.weights;
  const std::vector<PackedWeight> packed = pack_weights(ctx, lw, w, WeightUse::BackwardData);
  const int f = ffn_offset(lw.kind);
  // Feed-forward branch: dh_mid = dh_out + d(FFN(norm(h_mid)))/dh_mid.
  Buffer dh_mid = scratch<float>(mem, N * H, "layer.dh_mid");
  // dh_mid in T as well, for the mixer's output projection (written in the same pass; for fp32 dh_mid itself).
  Buffer dh_mid_t;
  if constexpr (!std::is_same_v<T, float>) dh_mid_t = scratch<T>(mem, N * H, "layer.dh_mid_t");
  {
    Buffer dx2 = scratch<float>(mem, N * H, "ffn.dxn");  // written whole by the FFN backward (accumulate_dx = false)
    if (c.moe()) {
      MoeGrads mg{G(gr, f + p::kRouter),     G(gr, f + p::kGateUp),   G(gr, f + p::kDown),
                  G(gr, f + p::kSharedGate), G(gr, f + p::kSharedUp), G(gr, f + p::kSharedDown),
                  G(gr, f + p::kSharedExpertGate)};
      distributed::PiecedExperts<T> experts(stored_experts(c, lw, &gr), mem, ctx.comm, ctx.expert_parallel, ctx.piece_bytes);
      distributed::TokenExchange exchange = token_exchange(ctx);
      moe_backward(moe_shape(c, N), ptr<T>(s.x2), moe_weights(w, f, &experts, exchange.get()), s.moe, dh_out, aux_dprob,
                   ptr<float>(dx2), mg, mem, /*accumulate_dx=*/false);
    } else {
      swiglu_backward(N, H, c.intermediate, ptr<T>(s.x2), w.mat(f + p::kMlpGate), w.mat(f + p::kMlpUp),
                      w.mat(f + p::kMlpDown), s.mlp, dh_out, ptr<float>(dx2), G(gr, f + p::kMlpGate),
                      G(gr, f + p::kMlpUp), G(gr, f + p::kMlpDown), mem, nullptr, /*accumulate_dx=*/false);
    }
    compute(mem, [&] {
      rmsnorm_backward(ptr<T>(s.h_mid), w.vec(p::kPostNorm), ptr<float>(s.rstd2), ptr<float>(dx2), ptr<float>(dh_mid),
                       G(gr, p::kPostNorm), N, H, /*accumulate=*/false, /*residual=*/dh_out,
                       std::is_same_v<T, float> ? nullptr : ptr<T>(dh_mid_t));
    });
  }
  // Mixer branch: dh_in = dh_mid + d(Mixer(norm(h_in)))/dh_in (the mixer's last step writes dh_in whole).
  const T* dmix_t = std::is_same_v<T, float> ? ptr<T>(dh_mid) : ptr<T>(dh_mid_t);
  if (lw.kind == LayerKind::LinearAttention) gdn_backward(ctx, w, gr, h_in, s, ptr<float>(dh_mid), dmix_t, dh_in);
  else attention_backward(ctx, w, gr, h_in, s, ptr<float>(dh_mid), dmix_t, dh_in);
}

#define HS_INSTANTIATE(T)                                                                                          \
  template ComputeWeights<T> start_compute_weights<T>(const ModelConfig&, const LayerWeights&, MemoryAccountant&,  \
                                                      Collectives*);                                               \
  template ComputeWeights<T> compute_weights<T>(const ModelConfig&, const LayerWeights&, MemoryAccountant&,        \
                                                Collectives*);                                                     \
  template RouterStats layer_forward<T>(const LayerContext&, const LayerWeights&, const T*, T*, LayerSaved<T>*,    \
                                        ComputeWeights<T>*);                                                       \
  template void layer_backward<T>(const LayerContext&, const LayerWeights&, const LayerWeights&, const T*,          \
                                  const LayerSaved<T>&, const float*, float*, const float*);
HS_INSTANTIATE(float)
HS_INSTANTIATE(bf16)
#undef HS_INSTANTIATE

}  // namespace hs::model
