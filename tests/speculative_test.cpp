// Speculative decoding with the MTP layer (src/infer/speculative.h): verification computes every position as a plain
// decode step does (logits to the bit), greedy output is plain decoding's, the rejection rule keeps the target's
// distribution, and bad input is refused.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <nlohmann/json.hpp>

#include "infer/decoder.h"
#include "infer/generate.h"
#include "infer/speculative.h"
#include "model/params.h"
#include "planner/plan.h"
#include "test_util.h"

namespace hs::infer {
namespace {

using model::ModelConfig;
using model::ParamSet;

// The families' tiny models with an MTP layer (vocabulary 256): Qwen3-Next (sparse MoE), Qwen3.5 with the same
// body, and a dense Qwen3.5 (the MTP layer then has the dense MLP).
ModelConfig family(const std::string& name) {
  ModelConfig c = model::preset("tiny+mtp");
  if (name == "qwen3.5" || name == "qwen3.5-dense") c.family = model::Family::Qwen3_5;
  if (name == "qwen3.5-dense") {
    c.experts = c.top_k = c.expert_inter = c.shared_inter = 0;
    c.intermediate = 96;
  }
  c.name = name;
  c.validate();
  return c;
}

std::vector<std::vector<int32_t>> prompts() {
  return {{1, 2, 3, 4, 5, 6, 7}, {200, 17, 33}, {9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 42, 101}};
}

// Decoder::verify against plain steps: several slots fed n = 1..4 ids at once, the first m of them the ids plain
// greedy decoding chose (the rest wrong, so they are rolled back), accept(m): every kept position's logits equal
// the plain step's to the bit, and decoding continues from the rolled-back state exactly (the later positions too).
// 5 slots of 4 positions are 20 rows: two fused steps.
TEST(Speculative, VerifiedLogitsEqualPlainDecodeStepsToTheBit) {
  for (const std::string fam : {"qwen3_next", "qwen3.5", "qwen3.5-dense"}) {
    SCOPED_TRACE(fam);
    MemoryAccountant mem;
    ParamSet ps(family(fam), DType::F32, mem, MemCategory::Parameters, false);
    model::init_params(ps, 11);
    const int64_t V = ps.config().vocab, B = 5, steps = 30;
    std::vector<std::vector<int32_t>> ps_ = prompts();
    ps_.push_back({5});
    ps_.push_back({77, 78, 79, 80});
    // Plain: the greedy ids and each step's logits.
    std::vector<std::vector<int32_t>> ids(B);
    std::vector<std::vector<float>> plain(B);
    {
      Decoder dec(ps, DType::F32, B, 64, mem);
      std::vector<float> lg(static_cast<size_t>(B * V));
      std::mt19937_64 rng;
      std::vector<std::pair<float, int32_t>> scratch;
      for (int64_t b = 0; b < B; ++b) {
        dec.prefill(b, ps_[static_cast<size_t>(b)], lg.data());
        ids[b].push_back(sample_token(lg.data(), V, {}, rng, scratch));
      }
      std::vector<int32_t> slots(B), next(B);
      for (int64_t t = 0; t < steps; ++t) {
        for (int64_t b = 0; b < B; ++b) {
          slots[b] = static_cast<int32_t>(b);
          next[b] = ids[b].back();
        }
        dec.step(slots, next, lg.data());
        for (int64_t b = 0; b < B; ++b) {
          plain[b].insert(plain[b].end(), lg.begin() + b * V, lg.begin() + (b + 1) * V);
          ids[b].push_back(sample_token(lg.data() + b * V, V, {}, rng, scratch));
        }
      }
    }
    Decoder dec(ps, DType::F32, B, 64 + 3, mem, 512, nullptr, 3);
    ASSERT_TRUE(dec.fused());
    std::vector<float> lg(static_cast<size_t>(B * 4 * V));
    for (int64_t b = 0; b < B; ++b) dec.prefill(b, ps_[static_cast<size_t>(b)], lg.data());
    std::vector<int64_t> done(B, 0);  // positions of ids[b] fed so far
    std::mt19937_64 pick(5);
    int64_t kept_more_than_one = 0, rolled_back = 0;
    while (true) {
      std::vector<int32_t> slots, feed;
      const int64_t n = 1 + static_cast<int64_t>(pick() % 4);
      std::vector<int64_t> m_of;
      for (int64_t b = 0; b < B; ++b)
        if (done[b] + n <= steps) slots.push_back(static_cast<int32_t>(b));
      if (slots.empty()) break;
      for (int32_t b : slots) {
        const int64_t m = 1 + static_cast<int64_t>(pick() % static_cast<uint64_t>(n));
        m_of.push_back(m);
        for (int64_t j = 0; j < n; ++j)  // ids past the m kept ones are wrong
          feed.push_back(j < m ? ids[b][static_cast<size_t>(done[b] + j)] : (ids[b][static_cast<size_t>(done[b] + j)] + 1) % V);
      }
      dec.verify(slots, n, feed, lg.data());
      for (size_t i = 0; i < slots.size(); ++i) {
        const int32_t b = slots[i];
        const int64_t m = m_of[i];
        for (int64_t j = 0; j < m; ++j)
          ASSERT_EQ(std::memcmp(lg.data() + (static_cast<int64_t>(i) * n + j) * V,
                                plain[b].data() + (done[b] + j) * V, static_cast<size_t>(V) * sizeof(float)), 0)
              << "slot " << b << " position " << done[b] + j << " (n " << n << ", m " << m << ")";
        dec.accept(b, m);
        done[b] += m;
        kept_more_than_one += m > 1;
        rolled_back += m < n;
      }
    }
    EXPECT_GT(kept_more_than_one, 5);
    EXPECT_GT(rolled_back, 5);
    EXPECT_THROW(dec.verify(std::vector<int32_t>{0}, 5, std::vector<int32_t>(5, 1), lg.data()), std::invalid_argument);
    dec.verify(std::vector<int32_t>{0}, 2, std::vector<int32_t>{1, 2}, lg.data());
    EXPECT_THROW(dec.accept(0, 3), std::invalid_argument);
    EXPECT_THROW(dec.step(std::vector<int32_t>{0}, std::vector<int32_t>{1}, lg.data()), std::logic_error);
  }
}

// Greedy speculative generation equals plain greedy generation token for token, at every draft depth, in both
// families, for a batch of prompts of different lengths. The MTP layer is untrained (random): it is mostly wrong,
// so most steps roll back.
TEST(Speculative, GreedyEqualsPlainDecodingAtEveryDepthInBothFamilies) {
  for (const std::string fam : {"qwen3_next", "qwen3.5", "qwen3.5-dense"}) {
    MemoryAccountant mem;
    ParamSet ps(family(fam), DType::F32, mem, MemCategory::Parameters, false);
    model::init_params(ps, 7);
    GenerateOptions opt;
    opt.max_new_tokens = 40;
    const GenerateResult plain = generate(ps, prompts(), opt, mem);
    for (int64_t n = 1; n <= kMaxDraft; ++n) {
      SCOPED_TRACE(fam + " draft " + std::to_string(n));
      SpeculativeStats st;
      std::vector<int32_t> seen;
      const GenerateResult r = generate_speculative(ps, prompts(), opt, n, mem,
                                                    [&](size_t i, int32_t id) {
                                                      if (i == 1) seen.push_back(id);
                                                      return true;
                                                    },
                                                    &st);
      EXPECT_EQ(r.tokens, plain.tokens);
      EXPECT_EQ(seen, plain.tokens[1]);
      ASSERT_EQ(st.accepted.size(), static_cast<size_t>(n));
      EXPECT_GT(st.steps, 0);
      EXPECT_LT(st.accepted[0], st.steps);  // rejections happened: rolled back
      EXPECT_EQ(st.emitted + 3, 3 * opt.max_new_tokens);
    }
    // Stop ids and a callback that ends a sequence end it mid-step, as in plain decoding.
    opt.stop_ids = {plain.tokens[0][5]};
    const GenerateResult ps_stop = generate(ps, prompts(), opt, mem);
    const GenerateResult sp_stop = generate_speculative(ps, prompts(), opt, 3, mem);
    EXPECT_EQ(sp_stop.tokens, ps_stop.tokens);
  }
}

// The rejection rule keeps the target's distribution: the first token of a step follows p[0] whatever q is, and
// given that the first draft was kept the second follows p[1]. Chi-square at fixed seeds (critical values at
// 0.001). Drawing the replacement from p instead of the residual shifts the distribution, and the test sees it.
double chi_square(const std::vector<int64_t>& count, const std::vector<double>& p) {
  int64_t n = 0;
  for (int64_t c : count) n += c;
  double x = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double e = p[i] * double(n);
    if (e > 0) x += (double(count[i]) - e) * (double(count[i]) - e) / e;
    else if (count[i] > 0) return 1e9;
  }
  return x;
}

TEST(SpeculativeRule, RejectionSamplingKeepsTheTargetDistribution) {
  const std::vector<std::vector<double>> p = {{0.30, 0.05, 0.25, 0.10, 0.20, 0.10},
                                              {0.02, 0.48, 0.10, 0.10, 0.10, 0.20},
                                              {0.1, 0.1, 0.2, 0.2, 0.2, 0.2}};
  const std::vector<std::vector<double>> q = {{0.05, 0.40, 0.05, 0.30, 0.10, 0.10},
                                              {0.30, 0.10, 0.30, 0.00, 0.20, 0.10}};
  const double critical5 = 20.52;  // chi-square, 5 degrees of freedom, p = 0.001
  for (const bool residual : {true, false}) {
    std::mt19937_64 rng(2024);
    std::vector<int64_t> first(6, 0), second(6, 0);
    std::vector<int32_t> out;
    for (int trial = 0; trial < 40000; ++trial) {
      int32_t d[2];
      for (int j = 0; j < 2; ++j)
        d[j] = static_cast<int32_t>(std::discrete_distribution<int>(q[static_cast<size_t>(j)].begin(),
                                                                     q[static_cast<size_t>(j)].end())(rng));
      out.clear();
      const int64_t kept = speculative_accept(p, q, d, 2, rng, out, residual);
      ASSERT_EQ(out.size(), static_cast<size_t>(kept + 1));
      ++first[static_cast<size_t>(out[0])];
      if (kept >= 1) ++second[static_cast<size_t>(out[1])];
    }
    if (residual) {
      EXPECT_LT(chi_square(first, p[0]), critical5);
      EXPECT_LT(chi_square(second, p[1]), critical5);
    } else {
      EXPECT_GT(chi_square(first, p[0]), 10 * critical5);  // the rule without the residual is detectably wrong
    }
  }
}

// One OpenMP thread while it lives.
struct OneThread {
  int saved = omp_get_max_threads();
  OneThread() { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved); }
};

// Turns ps into a bigram model with a known draft: the decoder layers (the MTP layer's too) are zeroed, so their
// residuals add nothing and p(x_{t+2}) = f(x_{t+1}); fc = [I | w I], so the MTP layer drafts f of x_{t+1}'s embedding
// plus w times x_t's (w = 0: exactly the model's distribution); the LM head is scaled by 30 so that the
// distributions are not flat.
void make_bigram(ParamSet& ps, float w) {
  const int64_t H = ps.config().hidden;
  for (model::StackedParam& p : ps.all())
    if (p.name.rfind("mtp.layers.", 0) == 0 || p.name.rfind("local.", 0) == 0 || p.name.rfind("global.", 0) == 0 ||
        p.name.rfind("remainder.", 0) == 0)
      std::memset(p.tensor.data(), 0, p.tensor.view().nbytes());
  float* fc = static_cast<float*>(ps.all()[ps.mtp_index(model::g::kMtpFc)].tensor.data());
  std::fill_n(fc, H * 2 * H, 0.0f);
  for (int64_t i = 0; i < H; ++i) {
    fc[i * 2 * H + i] = 1;
    fc[i * 2 * H + H + i] = w;
  }
  const TensorView& head = ps.global(model::g::kLmHead);
  for (int64_t i = 0; i < head.numel(); ++i) static_cast<float*>(head.data)[i] *= 30;
}

// End to end, sampled (temperature 2 over a sharpened head) on a random model with a random MTP layer: the second new token,
// which always comes out of a verification, follows the target's marginal sum_x1 p(x1) p(x2 | x1), computed from
// plain decode logits. 16 prompts per call draw with seeds seed + i. One thread (the same bits at any count): 1,200
// short generations stay fast on a loaded machine.
TEST(Speculative, SampledTokensFollowTheTargetDistribution) {
  const OneThread one_thread;
  MemoryAccountant mem;
  ParamSet ps(family("qwen3_next"), DType::F32, mem, MemCategory::Parameters, false);
  model::init_params(ps, 3);
  // A draft that overlaps the target without being it, so drafts are kept often and rejected often and the
  // residual draw matters (a random MTP layer drafts other ids than the model's: rejected drafts are then replaced
  // from p either way, and the test could not tell the rule from one without the residual): q = f of a blend of
  // x_{t+1}'s and x_t's embeddings.
  make_bigram(ps, 2.0f);
  const int64_t V = ps.config().vocab;
  const std::vector<int32_t> prompt = {10, 20, 30, 40};
  Sampling s;
  s.temperature = 2.0;
  std::vector<double> want(static_cast<size_t>(V), 0.0), p1, p2;
  {
    Decoder dec(ps, DType::F32, 1, 16, mem);
    std::vector<float> lg(static_cast<size_t>(V));
    dec.prefill(0, prompt, lg.data());
    sampling_probs(lg.data(), V, s, p1);
    for (int32_t x1 = 0; x1 < V; ++x1) {
      if (p1[static_cast<size_t>(x1)] == 0) continue;
      std::vector<int32_t> full = prompt;
      full.push_back(x1);
      Decoder d2(ps, DType::F32, 1, 16, mem);
      d2.prefill(0, full, lg.data());
      sampling_probs(lg.data(), V, s, p2);
      for (int64_t v = 0; v < V; ++v) want[static_cast<size_t>(v)] += p1[static_cast<size_t>(x1)] * p2[static_cast<size_t>(v)];
    }
  }
  std::vector<int64_t> count(static_cast<size_t>(V), 0);
  GenerateOptions opt;
  opt.max_new_tokens = 2;
  opt.sampling = s;
  SpeculativeStats st;
  int64_t kept = 0, steps = 0;
  for (int call = 0; call < 75; ++call) {
    opt.sampling.seed = static_cast<uint64_t>(call) * 16;
    const GenerateResult r = generate_speculative(ps, std::vector<std::vector<int32_t>>(16, prompt), opt, 1, mem, {}, &st);
    for (const auto& t : r.tokens) ++count[static_cast<size_t>(t.at(1))];
    kept += st.accepted[0];
    steps += st.steps;
  }
  // Bins: the ids of probability >= 1% each, the rest together; chi-square's 0.001 critical value by Wilson-Hilferty.
  std::vector<int64_t> binned;
  std::vector<double> pb;
  int64_t rest_count = 0;
  double rest_p = 0;
  for (int64_t v = 0; v < V; ++v) {
    if (want[static_cast<size_t>(v)] >= 0.01) {
      binned.push_back(count[static_cast<size_t>(v)]);
      pb.push_back(want[static_cast<size_t>(v)]);
    } else {
      rest_count += count[static_cast<size_t>(v)];
      rest_p += want[static_cast<size_t>(v)];
    }
  }
  binned.push_back(rest_count);
  pb.push_back(rest_p);
  const double k = double(pb.size() - 1), z = 3.09;
  const double critical = k * std::pow(1 - 2 / (9 * k) + z * std::sqrt(2 / (9 * k)), 3);
  const double x = chi_square(binned, pb);
  std::printf("chi-square %.2f (critical %.2f, %zu bins), kept %lld of %lld\n", x, critical, pb.size(), (long long)kept,
              (long long)steps);
  EXPECT_GE(pb.size(), 4u);
  EXPECT_LT(x, critical) << "drafts kept in " << kept << " of " << steps << " steps";
  EXPECT_GT(kept, steps / 10);  // the draft overlaps: kept often, rejected often
  EXPECT_LT(kept, steps - steps / 10);
}

TEST(Speculative, BadInputIsRefused) {
  MemoryAccountant mem;
  ParamSet with(family("qwen3_next"), DType::F32, mem, MemCategory::Parameters, false);
  ParamSet without(model::preset("tiny"), DType::F32, mem, MemCategory::Parameters, false);
  model::init_params(with, 1);
  model::init_params(without, 1);
  GenerateOptions opt;
  opt.max_new_tokens = 4;
  auto message = [&](const ParamSet& ps, int64_t draft) {
    try {
      generate_speculative(ps, prompts(), opt, draft, mem);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(with, 0).find("--draft must be in [1, 3]"), std::string::npos);
  EXPECT_NE(message(with, 4).find("--draft must be in [1, 3]"), std::string::npos);
  EXPECT_NE(message(without, 1).find("no multi-token-prediction layer"), std::string::npos);
  EXPECT_THROW(MtpDrafter(without, DType::F32, 1, 8, mem), std::invalid_argument);
}

// MtpDrafter::save_kv / load_kv (serve --speculative's prefix cache): a slot's MTP keys and values of [0, n), copied
// into another slot in two ranges, make the next MTP step there give the first slot's logits and output to the bit,
// in fp32 and bf16. Without the copy (or with a range short by a row) they differ.
TEST(Speculative, DrafterKeysAndValuesSavedAndLoadedContinueToTheSameBits) {
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dt));
    MemoryAccountant mem;
    ParamSet ps(family("qwen3_next"), dt, mem, MemCategory::Parameters, false);
    model::init_params(ps, 5);
    const int64_t H = ps.config().hidden, V = ps.config().vocab, n = 40, cap = 64;
    const size_t hb = static_cast<size_t>(H) * dtype_size(dt);
    Decoder dec(ps, dt, 1, cap, mem, 64);
    MtpDrafter mtp(ps, dt, 3, cap, mem, 64);
    std::vector<int32_t> prompt(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) prompt[static_cast<size_t>(i)] = static_cast<int32_t>((i * 37 + 11) % V);
    std::vector<float> logits(static_cast<size_t>(V));
    std::vector<char> hid(static_cast<size_t>(n) * hb);
    dec.prefill(0, prompt, logits.data(), false, hid.data());
    std::vector<int32_t> next(prompt.begin() + 1, prompt.end());
    next.push_back(7);
    mtp.prefill(0, 0, hid.data(), next.data(), n - 1, nullptr, nullptr, false);  // the last position: below
    EXPECT_EQ(mtp.kv_bytes_per_position(), size_t(2 * ps.config().kv_heads * ps.config().head_dim) * dtype_size(dt));
    std::vector<char> a(static_cast<size_t>(n) * mtp.kv_bytes_per_position()), b(a.size());
    mtp.save_kv(0, 0, 25, a.data());
    mtp.save_kv(0, 25, n - 1, b.data());
    mtp.load_kv(1, 0, 25, a.data());
    mtp.load_kv(1, 25, n - 1, b.data());
    mtp.load_kv(2, 0, 25, a.data());  // slot 2: the rows of [25, n - 1) left out
    // Position n - 1 of each slot (h_{n-1}, the next token) in one step: every row attends to its own slot's rows.
    const std::vector<int32_t> slots{0, 1, 2}, pos(3, static_cast<int32_t>(n - 1)), ids(3, next.back());
    std::vector<char> h(3 * hb);
    for (size_t r = 0; r < 3; ++r) std::memcpy(h.data() + r * hb, hid.data() + static_cast<size_t>(n - 1) * hb, hb);
    std::vector<float> out(static_cast<size_t>(3 * V));
    std::vector<char> mh(3 * hb);
    mtp.step(3, slots.data(), pos.data(), h.data(), ids.data(), out.data(), mh.data());
    EXPECT_EQ(std::memcmp(out.data(), out.data() + V, static_cast<size_t>(V) * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(mh.data(), mh.data() + hb, hb), 0);
    EXPECT_NE(std::memcmp(out.data(), out.data() + 2 * V, static_cast<size_t>(V) * sizeof(float)), 0);
    EXPECT_THROW(mtp.save_kv(0, 0, cap + 1, a.data()), std::out_of_range);
    EXPECT_THROW(mtp.load_kv(3, 0, 1, a.data()), std::out_of_range);
  }
}

// plan --generate --speculative: the planner runs generate_speculative's own allocations over shapes
// (speculative_over_shapes), so its total is the accountant's peak of a real speculative run whose prompts fill two
// prefill pieces, to the byte: draft 1 to 3, both families (and the dense Qwen3.5), fp32 and bf16, batch 1 and 2.
// The caches are the formulas' (N more recurrent-state slots per sequence, N more positions; the MTP layer's keys
// and values), and shorter prompts in the same context need no more than the plan.
TEST(Speculative, PlanEqualsWhatGenerateMeasuresToTheByte) {
  const int64_t piece = 16, max_new = 9;
  for (const std::string fam : {"qwen3_next", "qwen3.5", "qwen3.5-dense"})
    for (DType dt : {DType::F32, DType::BF16}) {
      if (dt == DType::BF16 && fam != "qwen3.5") continue;  // bf16 storage and compute: one family is enough
      const ModelConfig cfg = family(fam);
      MemoryAccountant mem;
      ParamSet ps(cfg, dt, mem, MemCategory::Parameters, false);
      model::init_params(ps, 5);
      for (int64_t B : {1, 2})
        for (int64_t n = 1; n <= kMaxDraft; ++n) {
          SCOPED_TRACE(fam + " " + std::string(dtype_name(dt)) + " batch " + std::to_string(B) + " draft " +
                       std::to_string(n));
          std::vector<std::vector<int32_t>> full, shorter;
          for (int64_t i = 0; i < B; ++i) {
            full.emplace_back(static_cast<size_t>(2 * piece - 3 * i));  // the first fills two pieces
            for (size_t j = 0; j < full.back().size(); ++j) full.back()[j] = static_cast<int32_t>((7 * j + 3 * i) % 256);
            shorter.push_back({static_cast<int32_t>(1 + i), 2, 3});
          }
          GenerateOptions opt;
          opt.max_new_tokens = max_new;
          opt.compute = dt;
          opt.piece = piece;
          const GenerateResult g = generate_speculative(ps, full, opt, n, mem);
          planner::GeneratePlanRequest r;
          r.model = cfg;
          r.context = 2 * piece + max_new - 1;
          r.batch = B;
          r.piece = piece;
          r.weight_dtype = dt;
          r.draft = n;
          const planner::GeneratePlan p = planner::plan_generate(r);
          EXPECT_EQ(p.total, g.peak_bytes);
          EXPECT_EQ(p.kv_cache, g.kv_cache_bytes);
          EXPECT_EQ(p.recurrent_state, g.recurrent_state_bytes);
          EXPECT_EQ(p.weights, ps.nbytes());
          EXPECT_GT(p.workspace, 0u);
          const size_t b = dtype_size(dt), L_attn = size_t(cfg.layers / cfg.cycle), L_gdn = size_t(cfg.layers) - L_attn;
          const size_t positions = size_t(r.context + n);
          EXPECT_EQ(p.recurrent_state, size_t(B * (1 + n)) * L_gdn *
                                           (cfg.v_heads * cfg.dk * cfg.dv * 4 + (cfg.conv_width - 1) * cfg.conv_dim() * b));
          EXPECT_EQ(p.kv_cache, size_t(B) * L_attn * 2 * cfg.kv_heads * cfg.head_dim * positions * b);
          EXPECT_EQ(p.mtp_kv_cache, size_t(B) * 2 * cfg.kv_heads * cfg.head_dim * positions * b);
          // The plan is above plain decoding's by at least the extra caches.
          r.draft = 0;
          const planner::GeneratePlan plain = planner::plan_generate(r);
          EXPECT_GE(p.total, plain.total + p.mtp_kv_cache + (p.recurrent_state - plain.recurrent_state));
          opt.max_new_tokens = r.context - 3 + 1;  // the same context, 3-token prompts
          EXPECT_LE(generate_speculative(ps, shorter, opt, n, mem).peak_bytes, p.total);
        }
    }
}

// The decode step's side of the plan: a model whose MTP layer drafts exactly the target's greedy choice (decoder
// layers zeroed: a bigram model; the MTP layer's zeroed too and fc = [I | 0], so the draft is the same function of
// the same token), so every draft is kept and every step catches up on all draft + 1 positions, the widest step the
// plan counts. Prefill pieces of 1 token and one thread keep the prompt's workspace below the step's at batch 4 (and
// at batch 2, draft 3): the peak is then the decode step's (drafts, the verification of batch (draft + 1) rows, the
// catch-up), and the plan equals it to the byte (at every batch and depth).
TEST(Speculative, PlanEqualsTheWidestDecodeStepToTheByte) {
  const OneThread one_thread;  // (the attention tiles of a prefill piece grow with the threads)
  for (const std::string fam : {"qwen3_next", "qwen3.5"}) {
    MemoryAccountant mem;
    ParamSet ps(family(fam), DType::F32, mem, MemCategory::Parameters, false);
    model::init_params(ps, 3);
    make_bigram(ps, 0.0f);  // the draft is the model's own next-token distribution: every draft kept
    for (int64_t B : {1, 2, 4})
      for (int64_t n = 1; n <= kMaxDraft; ++n) {
        SCOPED_TRACE(fam + " batch " + std::to_string(B) + " draft " + std::to_string(n));
        std::vector<std::vector<int32_t>> prompts;
        for (int64_t i = 0; i < B; ++i) prompts.push_back({static_cast<int32_t>(10 + i), static_cast<int32_t>(77 + i)});
        GenerateOptions opt;
        opt.max_new_tokens = 12;
        opt.piece = 1;
        SpeculativeStats st;
        const GenerateResult g = generate_speculative(ps, prompts, opt, n, mem, {}, &st);
        ASSERT_GT(st.steps, 0);
        if (B == 4) {  // the peak is a step's: its workspace is live there
          bool step = false;
          for (const auto& b : mem.at_peak().largest) step = step || b.tag == "fused_step.workspace";
          EXPECT_TRUE(step);
        }
        for (int64_t k = 0; k < n; ++k) EXPECT_EQ(st.accepted[static_cast<size_t>(k)], st.steps) << "draft " << k + 1;
        planner::GeneratePlanRequest r;
        r.model = ps.config();
        r.context = 2 + opt.max_new_tokens - 1;
        r.batch = B;
        r.piece = 1;
        r.weight_dtype = DType::F32;
        r.draft = n;
        EXPECT_EQ(planner::plan_generate(r).total, g.peak_bytes);
      }
  }
}

struct Outcome {
  int status;
  std::string out, err;
};
Outcome run(const std::string& args) {
  test::TempDir dir;
  const std::string cmd = test::binary() + " " + args + " >" + (dir / "out").string() + " 2>" + (dir / "err").string();
  const int status = std::system(cmd.c_str());
  auto slurp = [&](const char* n) {
    const auto b = test::read_bytes(dir / n);
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  };
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp("out"), slurp("err")};
}

// The command: a checkpoint trained for one step from tiny+mtp decodes with --speculative mtp to plain decoding's
// tokens (--compare-plain says so), and bad flags are refused with the fix.
TEST(Speculative, CommandDecodesAsPlainAndRefusesBadFlags) {
  test::TempDir dir;
  const std::string ck = (dir / "run").string();
  const Outcome t = run("train --preset tiny+mtp --synthetic --steps 1 --batch 2 --seq 16 --threads 1 --out " + ck);
  ASSERT_EQ(t.status, 0) << t.err;
  const std::string model = ck + "/checkpoint-1";
  const std::string base = "generate --checkpoint " + model + " --prompt-ids 1,2,3 --max-new-tokens 12 --threads 1";
  const Outcome ok = run(base + " --speculative mtp --draft 2 --compare-plain");
  ASSERT_EQ(ok.status, 0) << ok.err;
  EXPECT_NE(ok.err.find("speculative: mtp, draft 2:"), std::string::npos) << ok.err;
  EXPECT_NE(ok.err.find("tokens equal plain decoding's"), std::string::npos) << ok.err;
  const std::string fixture = test::source_dir() + "/tests/fixtures/parity/qwen3_next_L5";  // no MTP layer
  const std::pair<std::string, std::string> bad[] = {
      {base + " --speculative mtp --draft 0", "--draft must be in [1, 3] (got 0)"},
      {base + " --speculative mtp --draft 4", "--draft must be in [1, 3] (got 4)"},
      {base + " --speculative eagle", "--speculative 'eagle' is not known"},
      {base + " --draft 2", "--draft needs --speculative mtp"},
      {"generate --checkpoint " + fixture + " --prompt-ids 1,2 --speculative mtp", "has no multi-token-prediction"},
  };
  for (const auto& [args, want] : bad) {
    const Outcome r = run(args);
    EXPECT_EQ(r.status, 1) << args;
    EXPECT_NE(r.err.find(want), std::string::npos) << args << "\n" << r.err;
  }
}

// The command line: plan --generate --speculative mtp --draft 2 reports what generate --speculative mtp --draft 2
// --json measures (accounted peak + weights used in place from the mapped file) for a prompt of two 512-token
// pieces, to the byte, with the same caches; a shorter prompt in the same context needs less.
TEST(Speculative, PlanCommandAgreesWithGenerateCommand) {
  test::TempDir dir;
  const std::string ck = (dir / "run").string();
  const Outcome t = run("train --preset tiny+mtp --synthetic --steps 1 --batch 2 --seq 16 --threads 1 --out " + ck);
  ASSERT_EQ(t.status, 0) << t.err;
  const std::string model = ck + "/checkpoint-1";
  auto last_json = [](const Outcome& o) {
    const size_t end = o.out.find_last_not_of('\n'), start = o.out.rfind('\n', end);
    return nlohmann::json::parse(o.out.substr(start == std::string::npos ? 0 : start + 1, end - start));
  };
  auto ids = [](int64_t n) {
    std::string s;
    for (int64_t i = 0; i < n; ++i) s += (i ? "," : "") + std::to_string((7 * i) % 256);
    return s;
  };
  const std::string flags = " --speculative mtp --draft 2 --threads 1";
  const Outcome g = run("generate --checkpoint " + model + " --prompt-ids " + ids(1024) +
                        " --max-new-tokens 5 --ignore-eos --json" + flags);
  ASSERT_EQ(g.status, 0) << g.err;
  const Outcome p = run("plan --generate --model " + model + "/config.json --context 1028 --batch 1 --weight-dtype fp32 --json" + flags);
  ASSERT_EQ(p.status, 0) << p.err;
  const auto gj = last_json(g), pj = last_json(p);
  EXPECT_EQ(gj["accounted_peak_bytes"].get<size_t>() + gj["weights_mapped_bytes"].get<size_t>(),
            pj["total_bytes"].get<size_t>());
  EXPECT_EQ(gj["kv_cache_bytes"], pj["kv_cache_bytes"]);
  EXPECT_EQ(gj["recurrent_state_bytes"], pj["recurrent_state_bytes"]);
  EXPECT_EQ(pj["draft"], 2);
  EXPECT_GT(pj["mtp_kv_cache_bytes"].get<size_t>(), 0u);
  const Outcome shorter = run("generate --checkpoint " + model + " --prompt-ids " + ids(300) +
                              " --max-new-tokens 729 --ignore-eos --json" + flags);
  ASSERT_EQ(shorter.status, 0) << shorter.err;
  EXPECT_LT(last_json(shorter)["accounted_peak_bytes"].get<size_t>() + last_json(shorter)["weights_mapped_bytes"].get<size_t>(),
            pj["total_bytes"].get<size_t>());
  // The flags and their checks are generate's.
  const std::pair<std::string, std::string> bad[] = {
      {" --speculative mtp --draft 4", "--draft must be in [1, 3] (got 4)"},
      {" --speculative eagle", "--speculative 'eagle' is not known"},
      {" --draft 2", "--draft needs --speculative mtp"},
  };
  for (const auto& [args, want] : bad) {
    const Outcome r = run("plan --generate --model tiny+mtp" + args);
    EXPECT_EQ(r.status, 1) << args;
    EXPECT_NE(r.err.find(want), std::string::npos) << args << "\n" << r.err;
  }
  const Outcome no_mtp = run("plan --generate --model tiny --speculative mtp");
  EXPECT_EQ(no_mtp.status, 1);
  EXPECT_NE(no_mtp.err.find("has no multi-token-prediction layer"), std::string::npos) << no_mtp.err;
  const Outcome training = run("plan --model tiny+mtp --speculative mtp");
  EXPECT_EQ(training.status, 1);
  EXPECT_NE(training.err.find("are for plan --generate"), std::string::npos) << training.err;
}

}  // namespace
}  // namespace hs::infer
