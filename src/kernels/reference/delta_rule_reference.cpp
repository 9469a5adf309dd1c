// The recurrent gated delta rule, token by token: the test oracle for the chunked kernels.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/delta_rule.h"

namespace hs::kernels::reference {

namespace {

// Offsets of token t of one (batch, head) in the [B, T, H, d] layouts.
struct HeadIndex {
  const DeltaRuleShape& s;
  int64_t b, h;
  int64_t qk(int64_t t) const { return ((b * s.seq + t) * s.k_heads + h / s.ratio()) * s.dk; }
  int64_t vo(int64_t t) const { return ((b * s.seq + t) * s.v_heads + h) * s.dv; }
  int64_t gate(int64_t t) const { return (b * s.seq + t) * s.v_heads + h; }
  // exp(g_t), or 0 at a document start: the state restarts from zero there.
  template <typename R> R decay(const R* g, int64_t t) const {
    return s.positions && s.positions[b * s.seq + t] == 0 ? R(0) : std::exp(g[gate(t)]);
  }
};

}  // namespace

template <typename R>
void delta_rule_recurrent_forward(const DeltaRuleShape& s, const R* q, const R* k, const R* v, const R* beta,
                                  const R* g, R* o) {
  const int64_t dk = s.dk, dv = s.dv;
  std::vector<R> S(dk * dv), kv(dv);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.v_heads; ++h) {
      const HeadIndex ix{s, b, h};
      std::fill(S.begin(), S.end(), R(0));
      for (int64_t t = 0; t < s.seq; ++t) {
        const R* qt = q + ix.qk(t);
        const R* kt = k + ix.qk(t);
        const R* vt = v + ix.vo(t);
        const R decay = ix.decay(g, t), bt = beta[ix.gate(t)];
        for (auto& x : S) x *= decay;
        std::fill(kv.begin(), kv.end(), R(0));
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) kv[j] += S[i * dv + j] * kt[i];
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) S[i * dv + j] += kt[i] * bt * (vt[j] - kv[j]);
        R* ot = o + ix.vo(t);
        for (int64_t j = 0; j < dv; ++j) ot[j] = 0;
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) ot[j] += S[i * dv + j] * qt[i];
      }
    }
}

// Reverse pass over the stored states. With S'_t = exp(g_t) S_{t-1} and dS the gradient of S_t:
//   o_t = S_t^T q_t            -> dq_t = S_t do_t,  dS += q_t do_t^T
//   S_t = S'_t + k_t delta^T   -> dk_t += dS delta, ddelta = dS^T k_t
//   delta = beta (v - S'^T k)  -> dbeta = ddelta . (v - S'^T k), dv = beta ddelta,
//                                 dS' = dS - beta k ddelta^T, dk_t -= beta S' ddelta
//   S'_t = exp(g_t) S_{t-1}    -> dg_t = <dS', S'_t>, dS_{t-1} = exp(g_t) dS'.
template <typename R>
void delta_rule_recurrent_backward(const DeltaRuleShape& s, const R* q, const R* k, const R* v, const R* beta,
                                   const R* g, const R* d_o, R* dq, R* dk, R* dv, R* dbeta, R* dg) {
  const int64_t dk_ = s.dk, dv_ = s.dv, T = s.seq, n = dk_ * dv_;
  std::vector<R> states((T + 1) * n);  // states[t + 1] = S_t, states[0] = 0
  std::vector<R> dS(n), Sp(n), kv(dv_), dd(dv_);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.v_heads; ++h) {
      const HeadIndex ix{s, b, h};
      std::fill(states.begin(), states.begin() + n, R(0));
      for (int64_t t = 0; t < T; ++t) {
        const R* kt = k + ix.qk(t);
        const R* vt = v + ix.vo(t);
        const R decay = ix.decay(g, t), bt = beta[ix.gate(t)];
        const R* prev = states.data() + t * n;
        R* cur = states.data() + (t + 1) * n;
        for (int64_t i = 0; i < n; ++i) cur[i] = decay * prev[i];
        std::fill(kv.begin(), kv.end(), R(0));
        for (int64_t i = 0; i < dk_; ++i)
          for (int64_t j = 0; j < dv_; ++j) kv[j] += cur[i * dv_ + j] * kt[i];
        for (int64_t i = 0; i < dk_; ++i)
          for (int64_t j = 0; j < dv_; ++j) cur[i * dv_ + j] += kt[i] * bt * (vt[j] - kv[j]);
      }
      std::fill(dS.begin(), dS.end(), R(0));
      for (int64_t t = T - 1; t >= 0; --t) {
        const R* qt = q + ix.qk(t);
        const R* kt = k + ix.qk(t);
        const R* vt = v + ix.vo(t);
        const R* dot = d_o + ix.vo(t);
        const R decay = ix.decay(g, t), bt = beta[ix.gate(t)];
        const R* St = states.data() + (t + 1) * n;
        const R* Sprev = states.data() + t * n;
        for (int64_t i = 0; i < n; ++i) Sp[i] = decay * Sprev[i];
        R* dqt = dq + ix.qk(t);
        R* dkt = dk + ix.qk(t);
        for (int64_t i = 0; i < dk_; ++i)
          for (int64_t j = 0; j < dv_; ++j) {
            dqt[i] += St[i * dv_ + j] * dot[j];
            dS[i * dv_ + j] += qt[i] * dot[j];
          }
        std::fill(kv.begin(), kv.end(), R(0));
        std::fill(dd.begin(), dd.end(), R(0));
        for (int64_t i = 0; i < dk_; ++i)
          for (int64_t j = 0; j < dv_; ++j) {
            kv[j] += Sp[i * dv_ + j] * kt[i];
            dd[j] += dS[i * dv_ + j] * kt[i];
          }
        R db = 0;
        R* dvt = dv + ix.vo(t);
        for (int64_t j = 0; j < dv_; ++j) {
          const R resid = vt[j] - kv[j];
          db += dd[j] * resid;
          dvt[j] += bt * dd[j];
          for (int64_t i = 0; i < dk_; ++i) dkt[i] += dS[i * dv_ + j] * bt * resid;
        }
        dbeta[ix.gate(t)] += db;
        R dgt = 0;
        for (int64_t i = 0; i < dk_; ++i)
          for (int64_t j = 0; j < dv_; ++j) {
            dkt[i] -= bt * Sp[i * dv_ + j] * dd[j];
            R& d = dS[i * dv_ + j];
            d -= bt * kt[i] * dd[j];
            dgt += d * Sp[i * dv_ + j];
            d *= decay;
          }
        dg[ix.gate(t)] += dgt;
      }
    }
}

template void delta_rule_recurrent_forward<float>(const DeltaRuleShape&, const float*, const float*, const float*,
                                                  const float*, const float*, float*);
template void delta_rule_recurrent_forward<double>(const DeltaRuleShape&, const double*, const double*,
                                                   const double*, const double*, const double*, double*);
template void delta_rule_recurrent_backward<float>(const DeltaRuleShape&, const float*, const float*, const float*,
                                                   const float*, const float*, const float*, float*, float*, float*,
                                                   float*, float*);
template void delta_rule_recurrent_backward<double>(const DeltaRuleShape&, const double*, const double*,
                                                    const double*, const double*, const double*, const double*,
                                                    double*, double*, double*, double*, double*);

}  // namespace hs::kernels::reference
