// Plain references for attention.h and rope.h: the textbook formulas with the full [T, T] score
// matrix, written for clarity and run in double by the tests.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/attention.h"
#include "kernels/rope.h"

namespace hs::kernels::reference {
namespace {

// Row-major [T, T] causal softmax probabilities (0 outside the query's document) of one (batch, head) and the scores' log-sum-exp.
template <typename R>
void causal_probs(const AttentionShape& s, const R* q, const R* k, int64_t b, int64_t h, std::vector<R>& P,
                  std::vector<R>& lse) {
  const int64_t T = s.seq, hd = s.head_dim, kvh = h / (s.q_heads / s.kv_heads);
  const R scale = R(1) / std::sqrt(R(hd));
  P.assign(static_cast<size_t>(T * T), R(0));
  lse.assign(static_cast<size_t>(T), R(0));
  for (int64_t i = 0; i < T; ++i) {
    const R* qi = q + ((b * T + i) * s.q_heads + h) * hd;
    R* row = P.data() + i * T;
    R mx = -std::numeric_limits<R>::infinity();
    const int64_t lo = document_start(s.positions, b * T + i, i);  // keys of the query's own document only
    for (int64_t j = lo; j <= i; ++j) {
      const R* kj = k + ((b * T + j) * s.kv_heads + kvh) * hd;
      R dot = 0;
      for (int64_t d = 0; d < hd; ++d) dot += qi[d] * kj[d];
      row[j] = dot * scale;
      mx = std::max(mx, row[j]);
    }
    R sum = 0;
    for (int64_t j = lo; j <= i; ++j) sum += std::exp(row[j] - mx);
    for (int64_t j = lo; j <= i; ++j) row[j] = std::exp(row[j] - mx) / sum;
    lse[static_cast<size_t>(i)] = mx + std::log(sum);
  }
}

template <typename R> R sigmoid(R x) { return R(1) / (R(1) + std::exp(-x)); }

// Applies the NeoX rotation by sign * angle to every head of every token.
template <typename R>
void rotate(R* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rotary_dim,
            double theta, R sign) {
  const int64_t half = rotary_dim / 2;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const R inv_freq = std::pow(R(theta), -R(2 * i) / R(rotary_dim));
      const R angle = R(positions[t]) * inv_freq;
      const R c = std::cos(angle), sn = sign * std::sin(angle);
      for (int64_t h = 0; h < heads; ++h) {
        R* xh = x + (t * heads + h) * head_dim;
        const R a = xh[i], b = xh[i + half];
        xh[i] = a * c - b * sn;
        xh[i + half] = b * c + a * sn;
      }
    }
}

}  // namespace

template <typename R>
void gated_attention_forward(const AttentionShape& s, const R* q, const R* k, const R* v, const R* gate, R* out,
                             R* attn, R* lse) {
  const int64_t T = s.seq, hd = s.head_dim, kv_group = s.q_heads / s.kv_heads;
  std::vector<R> P, row_lse;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h) {
      causal_probs(s, q, k, b, h, P, row_lse);
      for (int64_t i = 0; i < T; ++i) {
        const int64_t o = ((b * T + i) * s.q_heads + h) * hd;
        for (int64_t d = 0; d < hd; ++d) {
          R a = 0;
          for (int64_t j = 0; j <= i; ++j) a += P[i * T + j] * v[((b * T + j) * s.kv_heads + h / kv_group) * hd + d];
          out[o + d] = a * sigmoid(gate[o + d]);
          if (attn) attn[o + d] = a;
        }
        if (lse) lse[(b * s.q_heads + h) * T + i] = row_lse[static_cast<size_t>(i)];
      }
    }
}

template <typename R>
void gated_attention_backward(const AttentionShape& s, const R* q, const R* k, const R* v, const R* gate,
                              const R* dout, R* dq, R* dk, R* dv, R* dgate) {
  const int64_t T = s.seq, hd = s.head_dim, kv_group = s.q_heads / s.kv_heads;
  const R scale = R(1) / std::sqrt(R(hd));
  std::vector<R> P, row_lse, dA(static_cast<size_t>(T * hd)), dP(static_cast<size_t>(T));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h) {
      causal_probs(s, q, k, b, h, P, row_lse);
      const int64_t kvh = h / kv_group;
      auto qrow = [&](int64_t t) { return ((b * T + t) * s.q_heads + h) * hd; };
      auto kvrow = [&](int64_t t) { return ((b * T + t) * s.kv_heads + kvh) * hd; };
      // Gate: out = attn * sigmoid(gate).
      for (int64_t i = 0; i < T; ++i)
        for (int64_t d = 0; d < hd; ++d) {
          R a = 0;
          for (int64_t j = 0; j <= i; ++j) a += P[i * T + j] * v[kvrow(j) + d];
          const R sg = sigmoid(gate[qrow(i) + d]), g = dout[qrow(i) + d];
          dgate[qrow(i) + d] += g * a * sg * (R(1) - sg);
          dA[i * hd + d] = g * sg;
        }
      // Softmax and the two products.
      for (int64_t i = 0; i < T; ++i) {
        R rowdot = 0;
        for (int64_t j = 0; j <= i; ++j) {
          R x = 0;
          for (int64_t d = 0; d < hd; ++d) x += dA[i * hd + d] * v[kvrow(j) + d];
          dP[j] = x;
          rowdot += P[i * T + j] * x;
        }
        for (int64_t j = 0; j <= i; ++j) {
          const R p = P[i * T + j], dS = p * (dP[j] - rowdot);
          for (int64_t d = 0; d < hd; ++d) {
            dv[kvrow(j) + d] += p * dA[i * hd + d];
            dq[qrow(i) + d] += scale * dS * k[kvrow(j) + d];
            dk[kvrow(j) + d] += scale * dS * q[qrow(i) + d];
          }
        }
      }
    }
}

template <typename R>
void rope_forward(R* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                  int64_t rotary_dim, double theta) {
  rotate(x, positions, tokens, heads, head_dim, rotary_dim, theta, R(1));
}

template <typename R>
void rope_backward(R* dx, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                   int64_t rotary_dim, double theta) {
  rotate(dx, positions, tokens, heads, head_dim, rotary_dim, theta, R(-1));
}

#define HS_INSTANTIATE(R)                                                                                       \
  template void gated_attention_forward<R>(const AttentionShape&, const R*, const R*, const R*, const R*, R*,   \
                                           R*, R*);                                                             \
  template void gated_attention_backward<R>(const AttentionShape&, const R*, const R*, const R*, const R*,      \
                                            const R*, R*, R*, R*, R*);                                          \
  template void rope_forward<R>(R*, const int32_t*, int64_t, int64_t, int64_t, int64_t, double);               \
  template void rope_backward<R>(R*, const int32_t*, int64_t, int64_t, int64_t, int64_t, double);
HS_INSTANTIATE(float)
HS_INSTANTIATE(double)
#undef HS_INSTANTIATE

}  // namespace hs::kernels::reference
