#include "infer/quant_prefill.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "kernels/attention.h"
#include "kernels/conv.h"
#include "kernels/decode.h"
#include "kernels/delta_rule.h"
#include "kernels/gdn_gates.h"
#include "kernels/matmul.h"
#include "kernels/mlp.h"
#include "kernels/moe.h"
#include "kernels/norms.h"
#include "kernels/rope.h"
#include "model/layer_recipe.h"
#include "model/linear.h"

namespace hs::infer {

using namespace hs::kernels;
namespace p = model::p;

void quant_product(MemoryAccountant& mem, const QuantMatrix& m, int64_t row0, const float* x, float* y, int64_t M,
                   int64_t N, int64_t K, int64_t ldx, int64_t ldy, QuantMatmul how) {
  const int64_t bytes = quant_matmul_workspace_bytes<float>(m.type, M, N, K, how);
  Buffer ws = mem.allocate(static_cast<size_t>(bytes), MemCategory::Workspace, "quant_matmul.workspace");
  if (mem.planning()) return;
  quant_matmul(m.type, x, m.row(row0), y, M, N, K, ldx, ldy, how, ws.data(), bytes);
}

namespace {

Buffer f32(MemoryAccountant& mem, int64_t n, const char* tag) {
  return mem.allocate_n<float>(static_cast<size_t>(n), MemCategory::Workspace, tag);
}

struct Layer {
  const model::LayerContext& ctx;
  const model::LayerWeights& lw;
  const model::ComputeWeights<float>& cw;  // small vectors in fp32, unquantized matrices in place
  const QuantLayer& ql;
  QuantMatmul how;

  bool planning() const { return ctx.mem.planning(); }

  // y[N, out] = x[N, in] W^T for the layer's spec `spec`: on its quantized blocks, or the fp32 matrix.
  void product(size_t spec, const float* x, float* y, int64_t N, int64_t out, int64_t in, int64_t ldy = 0) const {
    if (const QuantMatrix* m = ql.one(spec)) return quant_product(ctx.mem, *m, 0, x, y, N, out, in, 0, ldy, how);
    if (planning()) return;
    MatmulLayout ld;
    ld.ldc = ldy;
    if (ldy == 0) matmul(x, cw.mat(spec), y, N, out, in, false, true);
    else matmul(x, cw.mat(spec), y, N, out, in, false, true, false, ld);
  }

  void gdn(const float* h_in, float* mix) const {
    const model::ModelConfig& c = ctx.cfg;
    MemoryAccountant& mem = ctx.mem;
    const bool P = planning();
    const int64_t N = ctx.tokens(), H = c.hidden, CD = c.conv_dim(), KD = c.key_dim(), VD = c.value_dim();
    const int64_t Hk = c.k_heads, Hv = c.v_heads;
    Buffer xn = f32(mem, N * H, "gdn.xn"), rstd = f32(mem, N, "gdn.rstd1");
    if (!P) rmsnorm_forward(h_in, cw.vec(p::kInputNorm), ptr<float>(xn), ptr<float>(rstd), N, H, float(c.rms_eps));
    Buffer qkv = f32(mem, N * CD, "gdn.qkv"), z = f32(mem, N * VD, "gdn.z"), b = f32(mem, N * Hv, "gdn.b"),
           a = f32(mem, N * Hv, "gdn.a"), y;
    auto act = [&](model::recipe::Act x) -> float* {
      using model::recipe::Act;
      switch (x) {
        case Act::kXn: return ptr<float>(xn);
        case Act::kQkv: return ptr<float>(qkv);
        case Act::kZ: return ptr<float>(z);
        case Act::kB: return ptr<float>(b);
        case Act::kA: return ptr<float>(a);
        case Act::kY: return ptr<float>(y);
        case Act::kMix: return mix;
        default: throw std::logic_error("quantized prefill: no buffer for this activation");
      }
    };
    for (const model::recipe::Product& m : model::recipe::gdn_in(c))
      product(static_cast<size_t>(m.weight), act(m.in), act(m.out), N, m.cols, m.depth);
    xn.reset();
    Buffer q = f32(mem, N * KD, "gdn.q"), k = f32(mem, N * KD, "gdn.k"), v = f32(mem, N * VD, "gdn.v");
    if (!P) {  // the conv's channels are [q | k | v]
      const auto cols = ColumnBlocks<float>().add(ptr<float>(q), KD).add(ptr<float>(k), KD).add(ptr<float>(v), VD);
      causal_conv_silu_cached(ptr<float>(qkv), cw.vec(p::kConv), cols, ptr<float>(ctx.cache->conv), ctx.slots,
                              ctx.batch, ctx.seq, CD, c.conv_width);
    }
    qkv.reset();
    Buffer qn = f32(mem, N * KD, "gdn.qn"), kn = f32(mem, N * KD, "gdn.kn"), rq = f32(mem, N * Hk, "gdn.rstdq"),
           rk = f32(mem, N * Hk, "gdn.rstdk"), beta = f32(mem, N * Hv, "gdn.beta"), g = f32(mem, N * Hv, "gdn.g");
    if (!P)
      model::recipe::gdn_norms_gates(c, cw.vec(p::kALog), cw.vec(p::kDtBias), ptr<float>(q), ptr<float>(k), ptr<float>(b),
                                     ptr<float>(a), ptr<float>(qn), ptr<float>(kn), ptr<float>(rq), ptr<float>(rk),
                                     ptr<float>(beta), ptr<float>(g), N);
    Buffer o = f32(mem, N * VD, "gdn.o");
    const DeltaRuleShape ds{ctx.batch, ctx.seq, Hk, Hv, c.dk, c.dv};
    if (ctx.seq == 1) {  // the recurrent step (the chunked form would pad one token to a chunk)
      if (!P)
        delta_rule_step(ds, ptr<float>(qn), ptr<float>(kn), ptr<float>(v), ptr<float>(beta), ptr<float>(g),
                        ptr<float>(o), ptr<float>(ctx.cache->state), ctx.slots);
    } else {
      delta_rule_forward_cached(ds, ptr<float>(qn), ptr<float>(kn), ptr<float>(v), ptr<float>(beta), ptr<float>(g),
                                ptr<float>(o), ptr<float>(ctx.cache->state), ctx.slots, mem);
    }
    y = f32(mem, N * VD, "gdn.y");
    Buffer rg = f32(mem, N * Hv, "gdn.rstdg");
    if (!P)
      gated_rmsnorm_forward(ptr<float>(o), ptr<float>(z), cw.vec(p::kGdnNorm), ptr<float>(y), ptr<float>(rg), N * Hv,
                            c.dv, float(c.rms_eps));
    const model::recipe::Product m = model::recipe::gdn_out(c);
    const float* yin = act(m.in);
    const QuantMatrix* qo = ql.one(static_cast<size_t>(m.weight));
    if (qo && qo->col_hk > 0) {  // the activations in the file's column order (QuantMatrix::col_hk)
      if (!P)
#pragma omp parallel for schedule(static)
        for (int64_t row = 0; row < N; ++row)
          for (int64_t gi = 0; gi < qo->col_hk; ++gi)
            for (int64_t j = 0; j < qo->col_r; ++j)
              std::copy_n(yin + row * VD + (gi * qo->col_r + j) * qo->col_block, qo->col_block,
                          ptr<float>(o) + row * VD + (j * qo->col_hk + gi) * qo->col_block);
      yin = ptr<float>(o);
    }
    product(static_cast<size_t>(m.weight), yin, act(m.out), N, m.cols, m.depth);
  }

  void attention(const float* h_in, float* mix) const {
    const model::ModelConfig& c = ctx.cfg;
    MemoryAccountant& mem = ctx.mem;
    const bool P = planning();
    const int64_t N = ctx.tokens(), H = c.hidden, nH = c.q_heads, nKV = c.kv_heads, hd = c.head_dim;
    Buffer xn = f32(mem, N * H, "attn.xn"), rstd = f32(mem, N, "attn.rstd1");
    if (!P) rmsnorm_forward(h_in, cw.vec(p::kInputNorm), ptr<float>(xn), ptr<float>(rstd), N, H, float(c.rms_eps));
    Buffer q_raw = f32(mem, N * nH * hd, "attn.q_raw"), gate = f32(mem, N * nH * hd, "attn.gate"),
           k_raw = f32(mem, N * nKV * hd, "attn.k_raw"), vv = f32(mem, N * nKV * hd, "attn.v"), qg, out;
    auto act = [&](model::recipe::Act x) -> float* {
      using model::recipe::Act;
      switch (x) {
        case Act::kXn: return ptr<float>(xn);
        case Act::kQGate: return ptr<float>(qg);
        case Act::kKRaw: return ptr<float>(k_raw);
        case Act::kV: return ptr<float>(vv);
        case Act::kAttn: return ptr<float>(out);
        case Act::kMix: return mix;
        default: throw std::logic_error("quantized prefill: no buffer for this activation");
      }
    };
    qg = f32(mem, N * nH * 2 * hd, "attn.q_proj_out");
    for (const model::recipe::Product& m : model::recipe::attention_in(c))
      product(static_cast<size_t>(m.weight), act(m.in), act(m.out), N, m.cols, m.depth);
    if (!P) model::recipe::split_query_gate(c, ptr<float>(qg), ptr<float>(q_raw), ptr<float>(gate), N);
    qg.reset();
    xn.reset();
    Buffer qn = f32(mem, N * nH * hd, "attn.q"), kn = f32(mem, N * nKV * hd, "attn.k"),
           rq = f32(mem, N * nH, "attn.rstdq"), rk = f32(mem, N * nKV, "attn.rstdk");
    if (!P)
      model::recipe::attention_norms_rope(c, cw.vec(p::kQNorm), cw.vec(p::kKNorm), ptr<float>(q_raw), ptr<float>(k_raw),
                                          ptr<float>(qn), ptr<float>(kn), ptr<float>(rq), ptr<float>(rk), ctx.positions,
                                          N);
    out = f32(mem, N * nH * hd, "attn.out");
    // As the layered path: a piece that starts its sequence takes the flash kernel over its own keys, later pieces
    // attend to the cache; the keys and values go into the cache either way.
    bool from_start = true;
    for (int64_t bi = 0; bi < ctx.batch; ++bi)
      if (ctx.positions[bi * ctx.seq] != 0) from_start = false;
    const KvCacheShape kc{nKV, hd, ctx.cache->capacity};
    if (!P)
      kv_cache_write(kc, ptr<float>(kn), ptr<float>(vv), ptr<float>(ctx.cache->k), ptr<float>(ctx.cache->v),
                     ctx.slots, ctx.positions, ctx.batch, ctx.seq);
    if (from_start) {
      const AttentionShape as{ctx.batch, ctx.seq, nH, nKV, hd};
      gated_attention_forward(as, ptr<float>(qn), ptr<float>(kn), ptr<float>(vv), ptr<float>(gate), ptr<float>(out),
                              nullptr, mem);
    } else {
      attention_cached_forward(kc, nH, ptr<float>(qn), ptr<float>(gate), ptr<float>(ctx.cache->k),
                               ptr<float>(ctx.cache->v), ptr<float>(out), ctx.slots, ctx.positions, ctx.batch, ctx.seq,
                               mem);
    }
    const model::recipe::Product m = model::recipe::attention_out(c);
    product(static_cast<size_t>(m.weight), act(m.in), act(m.out), N, m.cols, m.depth);
  }

  void dense_ffn(const float* x2, float* ffn) const {
    const model::ModelConfig& c = ctx.cfg;
    const int f = model::ffn_offset(lw.kind);
    const int64_t N = ctx.tokens(), H = c.hidden, I = c.intermediate;
    Buffer gu = f32(ctx.mem, N * 2 * I, "mlp.gate_up"), act = f32(ctx.mem, N * I, "mlp.act");
    product(f + p::kMlpGate, x2, ptr<float>(gu), N, I, H, 2 * I);
    product(f + p::kMlpUp, x2, ptr<float>(gu) + I, N, I, H, 2 * I);
    if (!planning()) pieces::swiglu_act_rows(N, I, ptr<float>(gu), nullptr, ptr<float>(act));
    product(f + p::kMlpDown, ptr<float>(act), ffn, N, H, I);
  }

  // The routed experts' products of one expert on its grouped rows: quantized (parts as QuantLayer holds them) or
  // the fp32 stack's rows. ws: scratch for quant_matmul (bytes), sized for any row count up to the tokens.
  void expert_product(size_t spec, int64_t e, int64_t per, const float* x, float* y, int64_t m, int64_t out,
                      int64_t in, int64_t ldy, void* ws, int64_t bytes) const {
    const std::vector<QuantMatrix>& parts = ql.parts.at(spec);
    if (parts.size() == 2) {  // gate [E, I, H] and up [E, I, H] apart: out = 2 per
      quant_matmul(parts[0].type, x, parts[0].row(e * per), y, m, per, in, 0, ldy, how, ws, bytes);
      quant_matmul(parts[1].type, x, parts[1].row(e * per), y + per, m, per, in, 0, ldy, how, ws, bytes);
    } else if (parts.size() == 1) {
      quant_matmul(parts[0].type, x, parts[0].row(e * out), y, m, out, in, 0, ldy, how, ws, bytes);
    } else {
      const float* w = static_cast<const float*>(lw[spec].data) + e * out * in;
      MatmulLayout ld;
      ld.ldc = ldy;
      ld.varying_rows = true;
      matmul(x, w, y, m, out, in, false, true, false, ld);
    }
  }
  int64_t expert_workspace(size_t spec, int64_t N, int64_t out, int64_t in) const {
    int64_t bytes = 0;
    for (const QuantMatrix& m : ql.parts.at(spec))  // the largest of any row count in [1, N] (the way depends on it)
      for (int64_t rows : {std::min<int64_t>(N, kGemvMaxRows), N})
        bytes = std::max(bytes, quant_matmul_workspace_bytes<float>(m.type, rows, out, in, how));
    return bytes;
  }

  void moe_ffn(const float* x2, float* ffn) const {
    const model::ModelConfig& c = ctx.cfg;
    MemoryAccountant& mem = ctx.mem;
    const bool P = planning();
    const int f = model::ffn_offset(lw.kind);
    const int64_t N = ctx.tokens(), H = c.hidden, E = c.experts, k = c.top_k, I = c.expert_inter,
                  Is = c.shared_inter;
    Buffer probs = f32(mem, N * E, "moe.probs"), wts = f32(mem, N * k, "moe.weights"), scale = f32(mem, N, "moe.scale");
    Buffer idx = mem.allocate_n<int32_t>(static_cast<size_t>(N * k), MemCategory::Workspace, "moe.index");
    Buffer rslot = mem.allocate_n<int32_t>(static_cast<size_t>(N * k), MemCategory::Workspace, "moe.rows");
    Buffer offb = mem.allocate_n<int64_t>(static_cast<size_t>(E + 1), MemCategory::Workspace, "moe.offsets");
    product(f + p::kRouter, x2, ptr<float>(probs), N, E, H);
    int64_t* off = ptr<int64_t>(offb);
    if (!P) {
      pieces::moe_route(N, E, k, c.norm_topk_prob, ptr<float>(probs), ptr<int32_t>(idx), ptr<float>(wts));
      pieces::moe_group_by_expert(N * k, E, ptr<int32_t>(idx), off, ptr<int32_t>(rslot));
      pieces::moe_shared_scale(N, H, x2, cw.vec(f + p::kSharedExpertGate), ptr<float>(scale));
    }
    probs.reset();
    Buffer xg = f32(mem, N * k * H, "moe.rows_in");
    if (!P)
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < N * k; ++r) std::copy_n(x2 + (ptr<int32_t>(rslot)[r] / k) * H, H, ptr<float>(xg) + r * H);
    Buffer gu = f32(mem, N * k * 2 * I, "moe.gate_up"), sgu = f32(mem, N * 2 * Is, "moe.shared_gate_up");
    {
      const int64_t bytes = expert_workspace(f + p::kGateUp, N, ql.parts.at(f + p::kGateUp).size() == 2 ? I : 2 * I, H);
      Buffer ws = mem.allocate(static_cast<size_t>(bytes), MemCategory::Workspace, "quant_matmul.workspace");
      if (!P)
        for (int64_t e = 0; e < E; ++e) {
          const int64_t a = off[e], m = off[e + 1] - a;
          if (m > 0)
            expert_product(f + p::kGateUp, e, I, ptr<float>(xg) + a * H, ptr<float>(gu) + a * 2 * I, m, 2 * I, H,
                           2 * I, ws.data(), bytes);
        }
    }
    xg.reset();
    product(f + p::kSharedGate, x2, ptr<float>(sgu), N, Is, H, 2 * Is);
    product(f + p::kSharedUp, x2, ptr<float>(sgu) + Is, N, Is, H, 2 * Is);
    Buffer act = f32(mem, N * k * I, "moe.act"), sact = f32(mem, N * Is, "moe.shared_act");
    if (!P) {
      pieces::swiglu_act_rows(N * k, I, ptr<float>(gu), nullptr, ptr<float>(act));
      pieces::swiglu_act_rows(N, Is, ptr<float>(sgu), nullptr, ptr<float>(sact));
    }
    gu.reset();
    sgu.reset();
    Buffer ye = f32(mem, N * k * H, "moe.rows_out"), sout = f32(mem, N * H, "moe.shared_out"),
           sum = f32(mem, N * H, "moe.sum");
    {
      const int64_t bytes = expert_workspace(f + p::kDown, N, H, I);
      Buffer ws = mem.allocate(static_cast<size_t>(bytes), MemCategory::Workspace, "quant_matmul.workspace");
      if (!P)
        for (int64_t e = 0; e < E; ++e) {
          const int64_t a = off[e], m = off[e + 1] - a;
          if (m > 0)
            expert_product(f + p::kDown, e, H, ptr<float>(act) + a * I, ptr<float>(ye) + a * H, m, H, I, 0, ws.data(),
                           bytes);
        }
    }
    product(f + p::kSharedDown, ptr<float>(sact), ptr<float>(sout), N, H, Is);
    if (!P)
      for (int64_t e = 0; e < E; ++e) {  // experts in ascending order (moe_add_expert_rows)
        const int64_t a = off[e], m = off[e + 1] - a;
        if (m > 0)
          pieces::moe_add_expert_rows(m, H, k, ptr<int32_t>(rslot) + a, ptr<int32_t>(idx), ptr<float>(wts),
                                      ptr<float>(scale), ptr<float>(sout), ptr<float>(ye) + a * H, ptr<float>(sum),
                                      ffn);
      }
  }
};

}  // namespace

void quant_layer_prefill(const model::LayerContext& ctx, const model::LayerWeights& lw, const QuantLayer& ql,
                         const float* h_in, float* h_out, QuantMatmul how) {
  const model::ModelConfig& c = ctx.cfg;
  MemoryAccountant& mem = ctx.mem;
  const bool P = mem.planning();
  const int64_t N = ctx.tokens(), H = c.hidden;
  // Small vectors in fp32 and the unquantized matrices where they lie (load_gguf_weights converted them to fp32:
  // nothing is copied); the quantized matrices' views hold no data.
  const model::ComputeWeights<float> cw = model::compute_weights<float>(c, lw, mem, nullptr);
  const Layer L{ctx, lw, cw, ql, how};
  Buffer h_mid = f32(mem, N * H, "layer.h_mid"), x2 = f32(mem, N * H, "ffn.xn"), rstd2 = f32(mem, N, "ffn.rstd");
  {
    Buffer mix = f32(mem, N * H, "layer.mixer_out");
    if (lw.kind == model::LayerKind::LinearAttention) L.gdn(h_in, ptr<float>(mix));
    else L.attention(h_in, ptr<float>(mix));
    if (!P)  // h_mid = h_in + mix and its post-attention norm, one pass
      model::recipe::residual_post_norm(c, cw.vec(p::kPostNorm), h_in, ptr<float>(mix), ptr<float>(h_mid),
                                        ptr<float>(x2), ptr<float>(rstd2), N);
  }
  Buffer ffn = f32(mem, N * H, "ffn.out");
  if (c.moe()) L.moe_ffn(ptr<float>(x2), ptr<float>(ffn));
  else L.dense_ffn(ptr<float>(x2), ptr<float>(ffn));
  if (!P) model::add(ptr<float>(h_mid), ptr<float>(ffn), h_out, N * H);
}

}  // namespace hs::infer
