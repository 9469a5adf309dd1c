// Plain references for the feed-forward kernels and the LM head: one token at a time, no grouping, no
// chunking, no intermediate rounding, templated so they run in double for finite differences.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/lm_head.h"
#include "kernels/mlp.h"
#include "kernels/moe.h"

namespace hs::kernels::reference {
namespace {

template <typename S>
S sigmoid(S x) {
  return S(1) / (S(1) + std::exp(-x));
}

template <typename S>
S dot(const S* a, const S* b, int64_t n) {
  S s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out[H] = W_down (silu(W_gate x) * (W_up x)) for one token.
template <typename S>
void mlp_token_forward(int64_t H, int64_t I, const S* x, const S* wg, const S* wu, const S* wd, S* out) {
  std::vector<S> a(static_cast<size_t>(I));
  for (int64_t i = 0; i < I; ++i) {
    const S g = dot(wg + i * H, x, H), u = dot(wu + i * H, x, H);
    a[static_cast<size_t>(i)] = g * sigmoid(g) * u;
  }
  for (int64_t h = 0; h < H; ++h) out[h] = dot(wd + h * I, a.data(), I);
}

// Backward of mlp_token_forward for upstream dout[H]; accumulates dx, dwg, dwu, dwd.
template <typename S>
void mlp_token_backward(int64_t H, int64_t I, const S* x, const S* wg, const S* wu, const S* wd, const S* dout, S* dx,
                        S* dwg, S* dwu, S* dwd) {
  for (int64_t i = 0; i < I; ++i) {
    const S g = dot(wg + i * H, x, H), u = dot(wu + i * H, x, H);
    const S sg = sigmoid(g), a = g * sg * u;
    S da = 0;
    for (int64_t h = 0; h < H; ++h) {
      da += dout[h] * wd[h * I + i];
      dwd[h * I + i] += dout[h] * a;
    }
    const S dg = da * u * sg * (S(1) + g * (S(1) - sg)), du = da * g * sg;
    for (int64_t j = 0; j < H; ++j) {
      dwg[i * H + j] += dg * x[j];
      dwu[i * H + j] += du * x[j];
      dx[j] += dg * wg[i * H + j] + du * wu[i * H + j];
    }
  }
}

template <typename S>
struct TokenRouting {
  std::vector<S> p;             // [E] softmax
  std::vector<int64_t> chosen;  // [k]
  std::vector<S> weight;        // [k]
};

template <typename S>
TokenRouting<S> route_token(const MoeShape& s, const S* x, const S* router) {
  const auto E = static_cast<size_t>(s.experts);
  TokenRouting<S> r;
  r.p.resize(E);
  for (size_t e = 0; e < E; ++e) r.p[e] = dot(router + static_cast<int64_t>(e) * s.hidden, x, s.hidden);
  const S mx = *std::max_element(r.p.begin(), r.p.end());
  S sum = 0;
  for (S& v : r.p) sum += (v = std::exp(v - mx));
  for (S& v : r.p) v /= sum;
  std::vector<int64_t> order(E);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return r.p[static_cast<size_t>(a)] > r.p[static_cast<size_t>(b)]; });
  r.chosen.assign(order.begin(), order.begin() + s.top_k);
  S total = 0;
  for (int64_t e : r.chosen) {
    r.weight.push_back(r.p[static_cast<size_t>(e)]);
    total += r.p[static_cast<size_t>(e)];
  }
  if (s.norm_topk_prob)
    for (S& v : r.weight) v /= total;
  return r;
}

// The routing weight of every expert for one token (0 where not selected): the dense mask.
template <typename S>
std::vector<S> dense_mask(const MoeShape& s, const TokenRouting<S>& r) {
  std::vector<S> m(static_cast<size_t>(s.experts), S(0));
  for (size_t j = 0; j < r.chosen.size(); ++j) m[static_cast<size_t>(r.chosen[j])] = r.weight[j];
  return m;
}

}  // namespace

template <typename S>
void swiglu_forward(int64_t tokens, int64_t hidden, int64_t inter, const S* x, const S* w_gate, const S* w_up,
                    const S* w_down, S* y) {
  for (int64_t t = 0; t < tokens; ++t)
    mlp_token_forward(hidden, inter, x + t * hidden, w_gate, w_up, w_down, y + t * hidden);
}

template <typename S>
void swiglu_backward(int64_t tokens, int64_t hidden, int64_t inter, const S* x, const S* w_gate, const S* w_up,
                     const S* w_down, const S* dy, S* dx, S* dw_gate, S* dw_up, S* dw_down) {
  for (int64_t t = 0; t < tokens; ++t)
    mlp_token_backward(hidden, inter, x + t * hidden, w_gate, w_up, w_down, dy + t * hidden, dx + t * hidden, dw_gate,
                       dw_up, dw_down);
}

template <typename S>
RouterStats moe_forward(const MoeShape& s, const S* x, const MoeParams<S>& w, S* y) {
  const int64_t H = s.hidden, I = s.expert_inter, E = s.experts;
  RouterStats stats;
  stats.expert_counts.assign(static_cast<size_t>(E), 0.0);
  stats.prob_sums.assign(static_cast<size_t>(E), 0.0);
  stats.rows = s.tokens;
  std::vector<S> h(static_cast<size_t>(H));
  for (int64_t t = 0; t < s.tokens; ++t) {
    const S* xt = x + t * H;
    S* yt = y + t * H;
    const TokenRouting<S> r = route_token(s, xt, w.router);
    for (int64_t e : r.chosen) stats.expert_counts[static_cast<size_t>(e)] += 1;
    for (int64_t e = 0; e < E; ++e)
      stats.prob_sums[static_cast<size_t>(e)] += static_cast<double>(r.p[static_cast<size_t>(e)]);
    const std::vector<S> m = dense_mask(s, r);
    std::fill_n(yt, H, S(0));
    for (int64_t e = 0; e < E; ++e) {
      const S* gate = w.gate_up + e * 2 * I * H;
      mlp_token_forward(H, I, xt, gate, gate + I * H, w.down + e * H * I, h.data());
      for (int64_t j = 0; j < H; ++j) yt[j] += m[static_cast<size_t>(e)] * h[static_cast<size_t>(j)];
    }
    mlp_token_forward(H, s.shared_inter, xt, w.shared_gate, w.shared_up, w.shared_down, h.data());
    const S sg = sigmoid(dot(xt, w.shared_expert_gate, H));
    for (int64_t j = 0; j < H; ++j) yt[j] += sg * h[static_cast<size_t>(j)];
  }
  return stats;
}

template <typename S>
void moe_backward(const MoeShape& s, const S* x, const MoeParams<S>& w, const S* dy, const S* aux_dprob, S* dx,
                  const MoeParamGrads<S>& g) {
  const int64_t H = s.hidden, I = s.expert_inter, E = s.experts;
  const auto Hs = static_cast<size_t>(H), Es = static_cast<size_t>(E);
  std::vector<S> h(Hs), dout(Hs), dm(Es), dp(Es);
  for (int64_t t = 0; t < s.tokens; ++t) {
    const S* xt = x + t * H;
    const S* dyt = dy + t * H;
    S* dxt = dx + t * H;
    const TokenRouting<S> r = route_token(s, xt, w.router);
    const std::vector<S> m = dense_mask(s, r);
    // Every expert, selected or not; an unselected one has weight 0 and so contributes nothing.
    for (int64_t e = 0; e < E; ++e) {
      const S* gate = w.gate_up + e * 2 * I * H;
      S* dgate = g.gate_up + e * 2 * I * H;
      mlp_token_forward(H, I, xt, gate, gate + I * H, w.down + e * H * I, h.data());
      dm[static_cast<size_t>(e)] = dot(dyt, h.data(), H);
      for (size_t j = 0; j < Hs; ++j) dout[j] = m[static_cast<size_t>(e)] * dyt[j];
      mlp_token_backward(H, I, xt, gate, gate + I * H, w.down + e * H * I, dout.data(), dxt, dgate, dgate + I * H,
                         g.down + e * H * I);
    }
    mlp_token_forward(H, s.shared_inter, xt, w.shared_gate, w.shared_up, w.shared_down, h.data());
    const S sg = sigmoid(dot(xt, w.shared_expert_gate, H));
    const S dz = sg * (S(1) - sg) * dot(dyt, h.data(), H);
    for (size_t j = 0; j < Hs; ++j) dout[j] = sg * dyt[j];
    mlp_token_backward(H, s.shared_inter, xt, w.shared_gate, w.shared_up, w.shared_down, dout.data(), dxt,
                       g.shared_gate, g.shared_up, g.shared_down);
    for (int64_t j = 0; j < H; ++j) {
      g.shared_expert_gate[j] += dz * xt[j];
      dxt[j] += dz * w.shared_expert_gate[j];
    }
    // Router: mask weights -> probabilities (renormalisation) -> logits (softmax).
    for (size_t e = 0; e < Es; ++e) dp[e] = aux_dprob ? aux_dprob[e] : S(0);
    S total = 0, wdot = 0;
    for (size_t j = 0; j < r.chosen.size(); ++j) {
      total += r.p[static_cast<size_t>(r.chosen[j])];
      wdot += dm[static_cast<size_t>(r.chosen[j])] * r.weight[j];
    }
    for (int64_t e : r.chosen) {
      const auto ei = static_cast<size_t>(e);
      dp[ei] += s.norm_topk_prob ? (dm[ei] - wdot) / total : dm[ei];
    }
    const S pdp = dot(r.p.data(), dp.data(), E);
    for (int64_t e = 0; e < E; ++e) {
      const auto ei = static_cast<size_t>(e);
      const S dlogit = r.p[ei] * (dp[ei] - pdp);
      for (int64_t j = 0; j < H; ++j) {
        g.router[e * H + j] += dlogit * xt[j];
        dxt[j] += dlogit * w.router[e * H + j];
      }
    }
  }
}

template <typename S>
XentResult lm_head_xent(const S* x, const S* W, const int32_t* targets, int64_t tokens, int64_t hidden, int64_t vocab,
                        S grad_scale, S* dx, S* dW) {
  XentResult res;
  std::vector<S> logits(static_cast<size_t>(vocab));
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t tgt = targets[t];
    if (tgt < 0) continue;
    if (tgt >= vocab) throw std::out_of_range("lm_head_xent: target " + std::to_string(tgt) + " >= vocab");
    const S* xt = x + t * hidden;
    for (int64_t v = 0; v < vocab; ++v) logits[static_cast<size_t>(v)] = dot(W + v * hidden, xt, hidden);
    const S mx = *std::max_element(logits.begin(), logits.end());
    S sum = 0;
    for (S l : logits) sum += std::exp(l - mx);
    const S lse = mx + std::log(sum);
    res.loss_sum += static_cast<double>(lse - logits[static_cast<size_t>(tgt)]);
    ++res.count;
    if (!dx) continue;
    for (int64_t v = 0; v < vocab; ++v) {
      const S dl = grad_scale * (std::exp(logits[static_cast<size_t>(v)] - lse) - (v == tgt ? S(1) : S(0)));
      for (int64_t j = 0; j < hidden; ++j) {
        dx[t * hidden + j] += dl * W[v * hidden + j];
        if (dW) dW[v * hidden + j] += dl * xt[j];
      }
    }
  }
  return res;
}

#define HS_INSTANTIATE_REFERENCE(S)                                                                                 \
  template void swiglu_forward<S>(int64_t, int64_t, int64_t, const S*, const S*, const S*, const S*, S*);           \
  template void swiglu_backward<S>(int64_t, int64_t, int64_t, const S*, const S*, const S*, const S*, const S*, S*, \
                                   S*, S*, S*);                                                                     \
  template RouterStats moe_forward<S>(const MoeShape&, const S*, const MoeParams<S>&, S*);                          \
  template void moe_backward<S>(const MoeShape&, const S*, const MoeParams<S>&, const S*, const S*, S*,             \
                                const MoeParamGrads<S>&);                                                           \
  template XentResult lm_head_xent<S>(const S*, const S*, const int32_t*, int64_t, int64_t, int64_t, S, S*, S*);
HS_INSTANTIATE_REFERENCE(float)
HS_INSTANTIATE_REFERENCE(double)
#undef HS_INSTANTIATE_REFERENCE

}  // namespace hs::kernels::reference
