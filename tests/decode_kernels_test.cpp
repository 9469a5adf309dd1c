// The decoding kernels (kernels/decode.h, delta_rule_forward_cached) against the full-sequence references: a
// sequence fed in pieces and single tokens, its state carried in a slot, must give what the reference gives on the
// whole sequence at once.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/attention.h"
#include "kernels/conv.h"
#include "kernels/decode.h"
#include "kernels/delta_rule.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

using test::cast;
using test::widen;
using Vec = std::vector<double>;

// Rows [t0, t0 + n) of every batch row of x [B, T, width] as [B, n, width].
template <typename E>
std::vector<E> piece(const std::vector<E>& x, int64_t B, int64_t T, int64_t width, int64_t t0, int64_t n) {
  std::vector<E> out(static_cast<size_t>(B * n * width));
  for (int64_t b = 0; b < B; ++b)
    std::copy_n(x.begin() + (b * T + t0) * width, n * width, out.begin() + b * n * width);
  return out;
}
template <typename E>
void put(std::vector<E>& x, const std::vector<E>& p, int64_t B, int64_t T, int64_t width, int64_t t0, int64_t n) {
  for (int64_t b = 0; b < B; ++b) std::copy_n(p.begin() + b * n * width, n * width, x.begin() + (b * T + t0) * width);
}

// Piece boundaries that cover single tokens, partial chunks and chunk-crossing pieces: 1, 63, 64, 65, ... tokens.
std::vector<int64_t> pieces(int64_t T) {
  const int64_t sizes[] = {1, 63, 1, 64, 65, 2, 107};
  std::vector<int64_t> out;
  for (int64_t t = 0, i = 0; t < T; ++i) {
    const int64_t n = std::min(sizes[i % 7], T - t);
    out.push_back(n);
    t += n;
  }
  return out;
}

// Slots in the reverse order of the rows: a kernel that ignores the slot map reads the wrong sequence's state.
const int32_t kSlots[2] = {1, 0};

// C: 40 channels (one partial block of the kernel's 64), 150 (two whole blocks and a partial one).
template <typename T>
void conv_case(double tol, int64_t C) {
  const int64_t B = 2, S = 300, K = 4;
  std::mt19937 rng(7);
  const Vec xd = widen(cast<T>(test::randn(B * S * C, rng)));
  const Vec w = widen(test::randn(C * K, rng, 0.5f));
  Vec want(xd.size());
  reference::causal_conv_silu_forward(xd.data(), w.data(), want.data(), B, S, C, K);
  const std::vector<T> x = cast<T>(xd);
  const std::vector<float> wf = cast<float>(w);
  std::vector<T> window(2 * (K - 1) * C, from_f32<T>(0.0f)), got(x.size());
  int64_t t0 = 0;
  for (int64_t n : pieces(S)) {
    std::vector<T> y(B * n * C);
    causal_conv_silu_cached(piece(x, B, S, C, t0, n).data(), wf.data(), ColumnBlocks<T>(y.data(), C), window.data(),
                            kSlots, B, n, C, K);
    put(got, y, B, S, C, t0, n);
    t0 += n;
  }
  EXPECT_LT(test::rel_rms(got, want), tol);
  // The window of slot 1 (row 0) holds row 0's last K-1 inputs.
  for (int64_t i = 0; i < K - 1; ++i)
    for (int64_t c = 0; c < C; ++c)
      EXPECT_EQ(to_f32(window[((1 * (K - 1)) + i) * C + c]), to_f32(x[(S - K + 1 + i) * C + c]));
}

// fp32: the same taps in the same order as the reference's double sums, rounded once: 1e-6 is a few fp32 ulps.
// bf16: the output is rounded to bf16 (relative step 2^-8), so the error is about half of 3.9e-3 at most.
TEST(DecodeKernels, ConvWindowCarriesAcrossPiecesFp32) {
  for (int64_t C : {40, 150}) conv_case<float>(1e-6, C);
}
TEST(DecodeKernels, ConvWindowCarriesAcrossPiecesBf16) {
  for (int64_t C : {40, 150}) conv_case<bf16>(4e-3, C);
}

struct DeltaProblem {
  DeltaRuleShape s;
  Vec q, k, v, beta, g;
};

DeltaProblem delta_problem(int64_t T, uint32_t seed) {
  DeltaProblem p{{2, T, 2, 4, 32, 48}, {}, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd;
  const auto& s = p.s;
  auto unit_rows = [&](Vec& x, double scale) {
    x.resize(s.batch * T * s.k_heads * s.dk);
    for (size_t r = 0; r < x.size() / s.dk; ++r) {
      double ss = 0;
      for (int64_t j = 0; j < s.dk; ++j) ss += (x[r * s.dk + j] = nd(rng)) * x[r * s.dk + j];
      for (int64_t j = 0; j < s.dk; ++j) x[r * s.dk + j] *= scale / std::sqrt(ss);
    }
  };
  unit_rows(p.q, 1.0 / std::sqrt(double(s.dk)));
  unit_rows(p.k, 1.0);
  p.v.resize(s.batch * T * s.v_heads * s.dv);
  for (auto& x : p.v) x = nd(rng);
  for (int64_t i = 0; i < s.batch * T * s.v_heads; ++i) {
    p.beta.push_back(1.0 / (1.0 + std::exp(-nd(rng))));
    const double z = nd(rng);
    p.g.push_back(0.1 * (std::min(z, 0.0) - std::log1p(std::exp(-std::abs(z)))));  // slow decay: long memory
  }
  return p;
}

// The whole sequence through the chunked kernel in pieces (pieces of one token through the step kernel when
// `steps`), the state carried in the slots.
Vec delta_in_pieces(const DeltaProblem& p, bool steps) {
  const auto& s = p.s;
  const int64_t T = s.seq, QK = s.k_heads * s.dk, VO = s.v_heads * s.dv, G = s.v_heads;
  const std::vector<float> q = cast<float>(p.q), k = cast<float>(p.k), v = cast<float>(p.v);
  const std::vector<float> beta = cast<float>(p.beta), g = cast<float>(p.g);
  std::vector<float> state(2 * s.v_heads * s.dk * s.dv, 0.0f), o(v.size());
  MemoryAccountant mem;
  int64_t t0 = 0;
  for (int64_t n : steps ? std::vector<int64_t>(T, 1) : pieces(T)) {
    DeltaRuleShape ps = s;
    ps.seq = n;
    std::vector<float> op(s.batch * n * VO);
    const auto qp = piece(q, 2, T, QK, t0, n), kp = piece(k, 2, T, QK, t0, n), vp = piece(v, 2, T, VO, t0, n);
    const auto bp = piece(beta, 2, T, G, t0, n), gp = piece(g, 2, T, G, t0, n);
    if (n == 1 && steps)
      delta_rule_step(ps, qp.data(), kp.data(), vp.data(), bp.data(), gp.data(), op.data(), state.data(), kSlots);
    else
      delta_rule_forward_cached(ps, qp.data(), kp.data(), vp.data(), bp.data(), gp.data(), op.data(), state.data(),
                                kSlots, mem);
    put(o, op, 2, T, VO, t0, n);
    t0 += n;
  }
  EXPECT_EQ(mem.live_total(), 0u);
  return widen(o);
}

// Both against the recurrent reference in double on 300 tokens. The chunked kernel alone (whole sequences) is held
// to 1e-5 relative RMS in delta_rule_test; carrying the state between pieces adds nothing of its own order, so the
// same bound holds. The step kernel is the recurrence itself in fp32: ~1e-6 after 300 steps.
TEST(DecodeKernels, DeltaRuleInPiecesEqualsTheRecurrence) {
  const DeltaProblem p = delta_problem(300, 11);
  Vec want(p.v.size());
  reference::delta_rule_recurrent_forward(p.s, p.q.data(), p.k.data(), p.v.data(), p.beta.data(), p.g.data(),
                                          want.data());
  EXPECT_LT(test::rel_rms(delta_in_pieces(p, false), want), 1e-5);
  EXPECT_LT(test::rel_rms(delta_in_pieces(p, true), want), 1e-5);
}

TEST(DecodeKernels, DeltaRuleStepTakesOneToken) {
  const DeltaProblem p = delta_problem(2, 3);
  std::vector<float> st(2 * 4 * 32 * 48), q = cast<float>(p.q), o(p.v.size());
  const std::vector<float> beta = cast<float>(p.beta);
  EXPECT_THROW(delta_rule_step(p.s, q.data(), q.data(), q.data(), beta.data(), beta.data(), o.data(), st.data(), kSlots),
               std::invalid_argument);
}

template <typename T>
void attention_case(double tol, int64_t hd = 32) {
  const int64_t B = 2, S = 150, nH = 4, nKV = 2;
  const AttentionShape as{B, S, nH, nKV, hd};
  std::mt19937 rng(5);
  const Vec q = widen(cast<T>(test::randn(B * S * nH * hd, rng))), gate = widen(cast<T>(test::randn(q.size(), rng)));
  const Vec k = widen(cast<T>(test::randn(B * S * nKV * hd, rng))), v = widen(cast<T>(test::randn(k.size(), rng)));
  Vec want(q.size());
  reference::gated_attention_forward(as, q.data(), k.data(), v.data(), gate.data(), want.data());
  const KvCacheShape kc{nKV, hd, S};
  std::vector<T> kcache(2 * kc.slot_stride()), vcache(kcache.size()), got(q.size());
  const auto qt = cast<T>(q), gt = cast<T>(gate), kt = cast<T>(k), vt = cast<T>(v);
  MemoryAccountant mem;
  int64_t t0 = 0;
  for (int64_t n : pieces(S)) {
    std::vector<int32_t> pos(B * n);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < n; ++i) pos[b * n + i] = static_cast<int32_t>(t0 + i);
    kv_cache_write(kc, piece(kt, B, S, nKV * hd, t0, n).data(), piece(vt, B, S, nKV * hd, t0, n).data(),
                   kcache.data(), vcache.data(), kSlots, pos.data(), B, n);
    std::vector<T> out(B * n * nH * hd);
    attention_cached_forward(kc, nH, piece(qt, B, S, nH * hd, t0, n).data(), piece(gt, B, S, nH * hd, t0, n).data(),
                             kcache.data(), vcache.data(), out.data(), kSlots, pos.data(), B, n, mem);
    put(got, out, B, S, nH * hd, t0, n);
    t0 += n;
  }
  EXPECT_LT(test::rel_rms(got, want), tol);
  const int32_t beyond = static_cast<int32_t>(S);
  EXPECT_THROW(kv_cache_write(kc, kt.data(), vt.data(), kcache.data(), vcache.data(), kSlots, &beyond, 1, 1),
               std::out_of_range);
}

// fp32: one softmax in fp32 over <= 150 scores (its error ~1e-7 relative per term): 1e-5. bf16: the output rounded
// to bf16 (at most 2^-9 relative): 4e-3.
// Head dims 64 and 256 (multiples of 64) take the AVX-512 path on CPUs that have it, 32 the portable loop.
TEST(DecodeKernels, AttentionAgainstTheCacheEqualsCausalAttentionFp32) {
  for (int64_t hd : {32, 64, 256}) attention_case<float>(1e-5, hd);
}
TEST(DecodeKernels, AttentionAgainstTheCacheEqualsCausalAttentionBf16) {
  for (int64_t hd : {32, 64, 256}) attention_case<bf16>(4e-3, hd);
}

}  // namespace
}  // namespace hs::kernels
