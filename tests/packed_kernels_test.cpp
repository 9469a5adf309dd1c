// Packed documents at the kernel level: a batch whose sequences pack several documents (positions restarting at 0,
// kernels/common.h) gives, for every document, what the plain reference gives that document run alone, forward and
// backward, for the causal conv, the chunked delta rule and gated attention, fp32 and bf16 storage. The documents
// (lengths 1, 63, 64, 65, 127 in one sequence; 300, 20 in the other) start at chunk edges (64, 128) and inside
// chunks (1, 193, 300), so the delta rule's reset runs both at a chunk start and mid-chunk.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/conv.h"
#include "kernels/delta_rule.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

using test::cast;
using test::widen;
using Vec = std::vector<double>;

constexpr int64_t kSeq = 320;
const std::vector<std::vector<int64_t>> kDocs = {{1, 63, 64, 65, 127}, {300, 20}};

struct Doc {
  int64_t b, start, len;
};

std::vector<Doc> documents() {
  std::vector<Doc> out;
  for (int64_t b = 0; b < static_cast<int64_t>(kDocs.size()); ++b) {
    int64_t at = 0;
    for (int64_t len : kDocs[b]) {
      out.push_back({b, at, len});
      at += len;
    }
    EXPECT_EQ(at, kSeq);
  }
  return out;
}

std::vector<int32_t> positions() {
  std::vector<int32_t> pos;
  for (const auto& seq : kDocs)
    for (int64_t len : seq)
      for (int64_t i = 0; i < len; ++i) pos.push_back(static_cast<int32_t>(i));
  return pos;
}

// Rows [d.start, d.start + d.len) of sequence d.b of a [B, kSeq, width] array, as a [1, len, width] array.
template <typename E>
std::vector<E> rows_of(const std::vector<E>& x, const Doc& d, int64_t width) {
  const auto first = x.begin() + (d.b * kSeq + d.start) * width;
  return std::vector<E>(first, first + d.len * width);
}

Vec randn(size_t n, std::mt19937& rng, double stddev = 1.0) {
  std::normal_distribution<double> nd(0.0, stddev);
  Vec v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Values representable in T (the kernels' inputs), in double for the reference.
template <typename T>
Vec representable(Vec x) {
  for (auto& e : x) e = static_cast<double>(to_f32(from_f32<T>(static_cast<float>(e))));
  return x;
}

double rel_rms(const Vec& a, const Vec& ref) { return test::rel_rms(a, ref, 1e-20); }

// ---- Causal conv ----------------------------------------------------------------------------------------------

// fp32: each output is a sum of 4 products and a SiLU (~1e-7 relative), each dx a sum of 4 and dw of ~600 O(1)
// terms (relative RMS <= ~1e-6); 1e-5 keeps the margin, while a tap read across a document start gives O(0.1).
// bf16: outputs are rounded once (relative RMS of bf16 rounding <= 2^-9); the gradients are fp32.
template <typename T>
void conv_case() {
  constexpr bool kF32 = std::is_same_v<T, float>;
  const int64_t B = 2, C = 48, W = 4;
  std::mt19937 rng(5);
  const Vec x = representable<T>(randn(B * kSeq * C, rng)), w = representable<float>(randn(C * W, rng, 0.5)),
            dy = representable<float>(randn(B * kSeq * C, rng));
  const std::vector<int32_t> pos = positions();
  const auto xs = cast<T>(x);
  const auto wf = cast<float>(w), dyf = cast<float>(dy);
  std::vector<T> y(x.size());
  causal_conv_silu_forward(xs.data(), wf.data(), y.data(), B, kSeq, C, W, pos.data());
  std::vector<float> dx(x.size(), 0.25f), dw(w.size(), 0.0f);
  causal_conv_silu_backward(xs.data(), wf.data(), dyf.data(), dx.data(), dw.data(), B, kSeq, C, W, true, pos.data());
  Vec dw_alone(w.size(), 0.0);
  for (const Doc& d : documents()) {
    const Vec xd = rows_of(x, d, C), dyd = rows_of(dy, d, C);
    Vec yd(xd.size()), dxd(xd.size(), 0.0);
    reference::causal_conv_silu_forward(xd.data(), w.data(), yd.data(), 1, d.len, C, W);
    reference::causal_conv_silu_backward(xd.data(), w.data(), dyd.data(), dxd.data(), dw_alone.data(), 1, d.len, C, W);
    const std::string what = "document at " + std::to_string(d.start) + " of sequence " + std::to_string(d.b);
    EXPECT_LT(rel_rms(widen(rows_of(y, d, C)), yd), kF32 ? 1e-5 : 4e-3) << what << " y";
    Vec got = widen(rows_of(dx, d, C));
    for (auto& e : got) e -= 0.25;
    EXPECT_LT(rel_rms(got, dxd), 1e-5) << what << " dx";
  }
  EXPECT_LT(rel_rms(widen(dw), dw_alone), 1e-5) << "dw (the sum over the documents)";
}

TEST(PackedKernels, ConvEqualsEachDocumentAloneFp32) { conv_case<float>(); }
TEST(PackedKernels, ConvEqualsEachDocumentAloneBf16) { conv_case<bf16>(); }

// ---- Delta rule -----------------------------------------------------------------------------------------------

struct DeltaInputs {
  Vec q, k, v, beta, g, d_o;
};

DeltaInputs delta_inputs(const DeltaRuleShape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd;
  DeltaInputs p;
  auto unit_rows = [&](double scale) {
    Vec x(s.batch * s.seq * s.k_heads * s.dk);
    for (int64_t r = 0; r < s.batch * s.seq * s.k_heads; ++r) {
      double ss = 0;
      for (int64_t j = 0; j < s.dk; ++j) ss += (x[r * s.dk + j] = nd(rng)) * x[r * s.dk + j];
      for (int64_t j = 0; j < s.dk; ++j) x[r * s.dk + j] *= scale / std::sqrt(ss + 1e-6);
    }
    return x;
  };
  p.q = unit_rows(1.0 / std::sqrt(double(s.dk)));
  p.k = unit_rows(1.0);
  const int64_t nv = s.batch * s.seq * s.v_heads;
  p.v = randn(nv * s.dv, rng);
  p.d_o = randn(nv * s.dv, rng);
  p.beta.resize(nv);
  p.g.resize(nv);
  for (auto& x : p.beta) x = 1.0 / (1.0 + std::exp(-nd(rng)));
  for (auto& x : p.g) {
    const double z = nd(rng);
    x = std::min(z, 0.0) - std::log1p(std::exp(-std::abs(z)));  // logsigmoid
  }
  return p;
}

// The chunked kernel against the double recurrent oracle run on each document alone. The tolerances are the
// chunked-vs-recurrent ones of DeltaRuleChunkedVsRecurrent (observed <= 7e-7, dg <= 8e-6; 1e-5 and 1e-4 keep a
// >= 10x margin); the bf16 output adds its one rounding (2^-9 relative RMS), the gradients are fp32 either way.
// Without the mid-chunk reset (or with the chunk-edge one alone) the documents at 1, 193 and 300 read another
// document's state: O(0.1) errors.
// With bf16-input products (bf16 storage on AVX-512-BF16): every product rounds its operands to bf16, which
// DeltaRuleBf16Products bounds at 1e-2 relative RMS against the double oracle (observed 2.5e-3 - 3.5e-3).
template <typename T>
void delta_case(bool keep_states, DeltaRuleProducts products = DeltaRuleProducts::Fp32) {
  constexpr bool kF32 = std::is_same_v<T, float>;
  const bool bf16_products = products == DeltaRuleProducts::Bf16;
  const std::vector<int32_t> pos = positions();
  DeltaRuleShape s{2, kSeq, 2, 4, 32, 48};
  s.positions = pos.data();
  DeltaInputs p = delta_inputs(s, 21);
  p.q = representable<T>(p.q);
  p.k = representable<T>(p.k);
  p.v = representable<T>(p.v);
  p.beta = representable<float>(p.beta);
  p.g = representable<float>(p.g);
  p.d_o = representable<float>(p.d_o);
  const auto q = cast<T>(p.q), k = cast<T>(p.k), v = cast<T>(p.v);
  const auto beta = cast<float>(p.beta), g = cast<float>(p.g), d_o = cast<float>(p.d_o);
  std::vector<T> o(p.v.size());
  std::vector<float> dq(p.q.size(), 0.5f), dk(p.k.size(), 0.5f), dv(p.v.size(), 0.5f), dbeta(p.beta.size(), 0.5f),
      dg(p.g.size(), 0.5f);
  MemoryAccountant mem;
  {
    DeltaRuleSaved saved;
    delta_rule_forward(s, q.data(), k.data(), v.data(), beta.data(), g.data(), o.data(), &saved, mem, keep_states,
                       products);
    delta_rule_backward(s, q.data(), k.data(), v.data(), beta.data(), g.data(), saved, d_o.data(), dq.data(),
                        dk.data(), dv.data(), dbeta.data(), dg.data(), mem, true, products);
  }
  EXPECT_EQ(mem.live_total(), 0u);
  const int64_t wqk = s.k_heads * s.dk, wv = s.v_heads * s.dv, wg = s.v_heads;
  for (const Doc& d : documents()) {
    DeltaRuleShape one{1, d.len, s.k_heads, s.v_heads, s.dk, s.dv};
    const Vec qd = rows_of(p.q, d, wqk), kd = rows_of(p.k, d, wqk), vd = rows_of(p.v, d, wv),
              bd = rows_of(p.beta, d, wg), gd = rows_of(p.g, d, wg), dod = rows_of(p.d_o, d, wv);
    Vec od(vd.size()), dqd(qd.size()), dkd(kd.size()), dvd(vd.size()), dbd(bd.size()), dgd(gd.size());
    reference::delta_rule_recurrent_forward(one, qd.data(), kd.data(), vd.data(), bd.data(), gd.data(), od.data());
    reference::delta_rule_recurrent_backward(one, qd.data(), kd.data(), vd.data(), bd.data(), gd.data(), dod.data(),
                                             dqd.data(), dkd.data(), dvd.data(), dbd.data(), dgd.data());
    const std::string what = "document at " + std::to_string(d.start) + " (length " + std::to_string(d.len) +
                             ") of sequence " + std::to_string(d.b);
    auto got = [&](const std::vector<float>& x, int64_t width) {
      Vec r = widen(rows_of(x, d, width));
      for (auto& e : r) e -= 0.5;
      return r;
    };
    const double tol = bf16_products ? 1e-2 : 1e-4;
    EXPECT_LT(rel_rms(widen(rows_of(o, d, wv)), od), bf16_products ? 1e-2 : kF32 ? 1e-5 : 4e-3) << what << " o";
    EXPECT_LT(rel_rms(got(dq, wqk), dqd), tol) << what << " dq";
    EXPECT_LT(rel_rms(got(dk, wqk), dkd), tol) << what << " dk";
    EXPECT_LT(rel_rms(got(dv, wv), dvd), tol) << what << " dv";
    EXPECT_LT(rel_rms(got(dbeta, wg), dbd), tol) << what << " dbeta";
    // A one-token document reads a zero state: its dg is exactly 0 alone and packed.
    if (d.len == 1) {
      for (double e : got(dg, wg)) EXPECT_EQ(e, 0.0) << what << " dg";
    } else {
      EXPECT_LT(rel_rms(got(dg, wg), dgd), tol) << what << " dg";
    }
  }
}

TEST(PackedKernels, DeltaRuleEqualsEachDocumentAloneFp32) { delta_case<float>(false); }
TEST(PackedKernels, DeltaRuleEqualsEachDocumentAloneKeptStates) { delta_case<float>(true); }
TEST(PackedKernels, DeltaRuleEqualsEachDocumentAloneBf16) { delta_case<bf16>(false); }
TEST(PackedKernels, DeltaRuleEqualsEachDocumentAloneBf16Products) {
  if (!delta_rule_bf16_products_available()) GTEST_SKIP() << "the CPU (or HS_MAX_ISA) has no AVX-512-BF16";
  delta_case<bf16>(false, DeltaRuleProducts::Bf16);
}

// The oracle with positions is the oracle run on each document: the reset is exactly a zero state.
TEST(PackedKernels, DeltaRuleReferenceResetIsRunningAlone) {
  const std::vector<int32_t> pos = positions();
  DeltaRuleShape s{2, kSeq, 1, 1, 8, 8};
  s.positions = pos.data();
  const DeltaInputs p = delta_inputs(s, 3);
  Vec o(p.v.size());
  reference::delta_rule_recurrent_forward(s, p.q.data(), p.k.data(), p.v.data(), p.beta.data(), p.g.data(), o.data());
  for (const Doc& d : documents()) {
    const DeltaRuleShape one{1, d.len, 1, 1, 8, 8};
    const Vec qd = rows_of(p.q, d, 8), kd = rows_of(p.k, d, 8), vd = rows_of(p.v, d, 8), bd = rows_of(p.beta, d, 1),
              gd = rows_of(p.g, d, 1);
    Vec od(vd.size());
    reference::delta_rule_recurrent_forward(one, qd.data(), kd.data(), vd.data(), bd.data(), gd.data(), od.data());
    EXPECT_EQ(rows_of(o, d, 8), od);
  }
}

// ---- Attention ------------------------------------------------------------------------------------------------

// Tolerances of Attention.* (tests/attention_test.cpp): fp32 2e-5 on outputs and 1e-5 relative RMS on the
// gradients (observed ~1e-6); bf16 adds the output's rounding (2^-8) and the saved attention's in the backward
// (1e-2). A key of another document in a row's softmax changes it at O(0.1).
template <typename T>
void attention_case() {
  constexpr bool kF32 = std::is_same_v<T, float>;
  const std::vector<int32_t> pos = positions();
  AttentionShape s{2, kSeq, 4, 2, 32};
  s.positions = pos.data();
  std::mt19937 rng(9);
  const int64_t wq = s.q_heads * s.head_dim, wkv = s.kv_heads * s.head_dim;
  const Vec q = representable<T>(randn(2 * kSeq * wq, rng)), k = representable<T>(randn(2 * kSeq * wkv, rng)),
            v = representable<T>(randn(2 * kSeq * wkv, rng)), gate = representable<T>(randn(2 * kSeq * wq, rng)),
            dout = representable<float>(randn(2 * kSeq * wq, rng));
  const auto qs = cast<T>(q), ks = cast<T>(k), vs = cast<T>(v), gs = cast<T>(gate);
  const auto dof = cast<float>(dout);
  std::vector<T> out(q.size());
  std::vector<float> dq(q.size(), 0.0f), dk(k.size(), 0.0f), dv(v.size(), 0.0f), dgate(q.size(), 0.0f);
  MemoryAccountant mem;
  {
    AttentionSaved saved;
    gated_attention_forward(s, qs.data(), ks.data(), vs.data(), gs.data(), out.data(), &saved, mem);
    gated_attention_backward(s, qs.data(), ks.data(), vs.data(), gs.data(), saved, dof.data(), dq.data(), dk.data(),
                             dv.data(), dgate.data(), mem);
  }
  for (const Doc& d : documents()) {
    const AttentionShape one{1, d.len, s.q_heads, s.kv_heads, s.head_dim};
    const Vec qd = rows_of(q, d, wq), kd = rows_of(k, d, wkv), vd = rows_of(v, d, wkv), gd = rows_of(gate, d, wq),
              dod = rows_of(dout, d, wq);
    Vec od(qd.size()), dqd(qd.size()), dkd(kd.size()), dvd(vd.size()), dgd(qd.size());
    reference::gated_attention_forward(one, qd.data(), kd.data(), vd.data(), gd.data(), od.data());
    reference::gated_attention_backward(one, qd.data(), kd.data(), vd.data(), gd.data(), dod.data(), dqd.data(),
                                        dkd.data(), dvd.data(), dgd.data());
    const std::string what = "document at " + std::to_string(d.start) + " of sequence " + std::to_string(d.b);
    const Vec got = widen(rows_of(out, d, wq));
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], od[i], 2e-5 + (kF32 ? 0.0 : 1.0 / 256) * std::abs(od[i])) << what << " out " << i;
    const double tol = kF32 ? 1e-5 : 1e-2;
    if (d.len > 1) {  // one token: dq = dk = 0 exactly (its softmax is constant)
      EXPECT_LT(rel_rms(widen(rows_of(dq, d, wq)), dqd), tol) << what << " dq";
      EXPECT_LT(rel_rms(widen(rows_of(dk, d, wkv)), dkd), tol) << what << " dk";
    }
    EXPECT_LT(rel_rms(widen(rows_of(dv, d, wkv)), dvd), tol) << what << " dv";
    EXPECT_LT(rel_rms(widen(rows_of(dgate, d, wq)), dgd), tol) << what << " dgate";
  }
}

TEST(PackedKernels, AttentionEqualsEachDocumentAloneFp32) { attention_case<float>(); }
TEST(PackedKernels, AttentionEqualsEachDocumentAloneBf16) { attention_case<bf16>(); }

TEST(PackedKernels, PositionsThatDoNotRestartOrCountAreRefused) {
  std::vector<int32_t> pos = {0, 1, 2, 0, 1, 3};
  EXPECT_THROW(check_positions(pos.data(), 1, 6, "test"), std::invalid_argument);
  pos = {1, 2, 3, 4, 5, 6};
  EXPECT_THROW(check_positions(pos.data(), 1, 6, "test"), std::invalid_argument);
  pos = {0, 1, 0, 0, 1, 2};
  EXPECT_NO_THROW(check_positions(pos.data(), 1, 6, "test"));
}

}  // namespace
}  // namespace hs::kernels
