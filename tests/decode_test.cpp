// Incremental decoding (src/infer) against the full-sequence forward of the training schedule, against itself
// batched, and against transformers' greedy `generate` (fixtures from scripts/make_generate_fixtures.py on the
// random checkpoints of tests/fixtures/parity).
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "checkpoint/hf_io.h"
#include "infer/decoder.h"
#include "infer/fused_step.h"
#include "infer/generate.h"
#include "kernels/matmul.h"
#include "train/schedule.h"
#include "test_util.h"

namespace hs::infer {
namespace {

const std::string kParity = hs::test::source_dir() + "/tests/fixtures/parity/";
const std::string kGenerate = hs::test::source_dir() + "/tests/fixtures/generate/";

struct Model {
  MemoryAccountant mem;
  std::unique_ptr<model::ParamSet> params;
  const model::ModelConfig& cfg() const { return params->config(); }
};

std::unique_ptr<Model> load(const std::string& name, DType dtype) {
  auto m = std::make_unique<Model>();
  model::ModelConfig cfg = model::load_config(kParity + name);
  m->params = std::make_unique<model::ParamSet>(cfg, dtype, m->mem, MemCategory::Parameters, false);
  checkpoint::load_hf_params(checkpoint::CheckpointReader(kParity + name + "/model.safetensors"), *m->params);
  return m;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& x : ids) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return ids;
}

// The full-sequence forward's logits [T, V] (the training schedule, no caches).
std::vector<float> full_logits(Model& m, const std::vector<int32_t>& ids, DType compute) {
  const int64_t T = static_cast<int64_t>(ids.size());
  std::vector<int32_t> targets(ids.size(), -1);
  std::vector<float> logits(static_cast<size_t>(T * m.cfg().vocab));
  train::Batch b{ids.data(), targets.data(), 1, T};
  train::forward_only(*m.params, b, compute, m.mem, logits.data());
  return logits;
}

// The largest relative error of one position's logits, ||a_t - b_t|| / ||b_t||, over the positions.
double worst_position(const std::vector<float>& a, const std::vector<float>& b, int64_t V) {
  double worst = 0;
  for (size_t t = 0; t * V < b.size(); ++t) {
    double num = 0, den = 0;
    for (int64_t j = 0; j < V; ++j) {
      const double d = double(a[t * V + j]) - b[t * V + j];
      num += d * d;
      den += double(b[t * V + j]) * b[t * V + j];
    }
    worst = std::max(worst, std::sqrt(num / den));
  }
  return worst;
}

// Logits at every position two ways: the first token prefilled and every later one decoded as a single token
// (the step kernels, attention against the cache), and the whole prompt prefilled in pieces of `piece` tokens (the
// chunked kernels with carried state).
struct Incremental {
  std::vector<float> stepped, pieces;
};
Incremental incremental_logits(Model& m, const std::vector<int32_t>& ids, DType compute, int64_t piece) {
  const int64_t T = static_cast<int64_t>(ids.size()), V = m.cfg().vocab;
  Incremental r{std::vector<float>(static_cast<size_t>(T * V)), std::vector<float>(static_cast<size_t>(T * V))};
  Decoder dec(*m.params, compute, 1, T, m.mem, piece);
  dec.prefill(0, std::span(ids.data(), 1), r.stepped.data());
  const int32_t slot = 0;
  for (int64_t t = 1; t < T; ++t) dec.step(std::span(&slot, 1), std::span(ids.data() + t, 1), r.stepped.data() + t * V);
  dec.reset(0);
  dec.prefill(0, ids, r.pieces.data(), /*all_logits=*/true);
  EXPECT_EQ(dec.length(0), T);
  return r;
}

// fp32: both sides compute in fp32 and differ in operation order only (the recurrent step against the chunked
// delta rule, pieces of 40 against chunks of 64, attention over the cache against the flash kernel, one-row
// against many-row matmuls). The parity fixture generator measured fp32-vs-fp64 logits at 6.6e-6 relative RMS on
// these models; measured here: at most 1.0e-5 (stepped) and 1.5e-5 (pieces, 300 tokens) at the worst position. The
// bound is the parity test's 5e-5; a state lost at a piece boundary moves logits by 0.8-1.0 (the bf16 test below).
void expect_fp32_equal(const char* name, std::initializer_list<int64_t> lengths) {
  auto m = load(name, DType::F32);
  for (int64_t T : lengths) {
    const auto ids = random_ids(T, m->cfg().vocab, static_cast<uint32_t>(T));
    const auto full = full_logits(*m, ids, DType::F32);
    const Incremental inc = incremental_logits(*m, ids, DType::F32, 40);
    EXPECT_LT(worst_position(inc.stepped, full, m->cfg().vocab), 5e-5) << name << " T=" << T << " stepped";
    EXPECT_LT(worst_position(inc.pieces, full, m->cfg().vocab), 5e-5) << name << " T=" << T << " pieces";
  }
}
// L4: whole periods; L5 and L7: a remainder of 1 and 3 linear-attention layers.
TEST(Decode, LogitsEqualTheFullForwardAtEveryPositionFp32) {
  for (const char* name : {"qwen3_next_L4", "qwen3_next_L5", "qwen3_5_L7"}) expect_fp32_equal(name, {1, 63, 64, 65});
}
TEST(Decode, SlowLogitsEqualTheFullForwardAtEveryPositionFp32Of300Tokens) {
  for (const char* name : {"qwen3_next_L4", "qwen3_next_L5", "qwen3_5_L7"}) expect_fp32_equal(name, {300});
}

// A model of the fixtures' shape with the engine's own initialisation (matrices N(0, 0.02)), in `dtype`.
std::unique_ptr<Model> init(const std::string& name, DType dtype, uint64_t seed) {
  auto m = std::make_unique<Model>();
  m->params = std::make_unique<model::ParamSet>(model::load_config(kParity + name), dtype, m->mem,
                                                MemCategory::Parameters, false);
  model::init_params(*m->params, seed);
  return m;
}

// bf16 weights and activations on both sides. Every intermediate is rounded to bf16 (relative step 2^-8) on both
// sides; where the fp32 values before a rounding differ by round-off (recurrent vs chunked delta rule, cache vs flash
// attention) they land a step apart now and then, and such flips grow through the layers like any other bf16
// rounding. So the tolerance is the bf16 forward's own error, measured against the fp32 forward on the same
// weights (E, 1-9% per position here): incremental decoding must differ from the bf16 forward by less than E
// (measured: at most 0.46 E), and be no further from fp32 than 1.3 E (measured: 1.14 E). The fixtures' weights
// are drawn for sensitivity and turn one flipped rounding into O(1) by 300 tokens (E = 0.66-0.78 there), so
// these run on the engine's own initialisation (matrices N(0, 0.02)). A sequence whose state is lost half-way
// (a reset slot continuing the prompt) is off by 0.8-1.0, which the last check shows the test would see.
void expect_bf16_close(std::initializer_list<int64_t> lengths) {
  for (const char* name : {"qwen3_next_L5", "qwen3_5_L7"}) {
    auto m = init(name, DType::BF16, 5), m32 = init(name, DType::F32, 5);
    const int64_t V = m->cfg().vocab;
    for (int64_t T : lengths) {
      const auto ids = random_ids(T, V, static_cast<uint32_t>(T));
      const auto full = full_logits(*m, ids, DType::BF16), fp32 = full_logits(*m32, ids, DType::F32);
      const double E = worst_position(full, fp32, V);
      const Incremental inc = incremental_logits(*m, ids, DType::BF16, 64);
      for (const auto* got : {&inc.stepped, &inc.pieces}) {
        const char* how = got == &inc.stepped ? " stepped" : " pieces";
        EXPECT_LT(worst_position(*got, full, V), E) << name << " T=" << T << how;
        EXPECT_LT(worst_position(*got, fp32, V), 1.3 * E) << name << " T=" << T << how;
      }
      if (T < 300) continue;
      Decoder lost(*m->params, DType::BF16, 1, T, m->mem);
      std::vector<float> half(static_cast<size_t>(T * V));
      lost.prefill(0, std::span(ids.data(), 150), half.data(), true);
      lost.reset(0);
      lost.prefill(0, std::span(ids.data() + 150, 150), half.data() + 150 * V, true);
      EXPECT_GT(worst_position(half, full, V), 5 * E) << name;
    }
  }
}
TEST(Decode, LogitsEqualTheFullForwardAtEveryPositionBf16) { expect_bf16_close({1, 65}); }
TEST(Decode, SlowLogitsEqualTheFullForwardAtEveryPositionBf16Of300Tokens) { expect_bf16_close({300}); }

// Several sequences of different lengths decoded together give each one's logits alone: rows of a step are
// independent (1e-6: only the matmul's blocking over rows can differ), and a sequence that stops leaves the others
// untouched.
TEST(Decode, BatchedGenerationEqualsEachPromptAlone) {
  auto m = load("qwen3_5_L7", DType::F32);
  const int64_t V = m->cfg().vocab;
  const std::vector<std::vector<int32_t>> prompts = {random_ids(5, V, 1), random_ids(70, V, 2), random_ids(17, V, 3)};
  GenerateOptions opt;
  opt.max_new_tokens = 24;
  std::vector<std::vector<int32_t>> alone;
  for (const auto& p : prompts) alone.push_back(generate(*m->params, {p}, opt, m->mem).tokens[0]);
  // Sequence 1 ends on a stop condition of its own after 6 tokens.
  const GenerateResult together = generate(*m->params, prompts, opt, m->mem, [](size_t i, int32_t) {
    static int seen = 0;
    return i != 1 || ++seen < 6;
  });
  EXPECT_EQ(together.tokens[0], alone[0]);
  EXPECT_EQ(together.tokens[2], alone[2]);
  EXPECT_EQ(together.tokens[1], std::vector<int32_t>(alone[1].begin(), alone[1].begin() + 6));
  EXPECT_EQ(together.decode_tokens, 23 + 5 + 23);

  // Logits of a batched step against single steps.
  Decoder batch(*m->params, DType::F32, 3, 100, m->mem), one(*m->params, DType::F32, 1, 100, m->mem);
  std::vector<float> lb(3 * V), l1(V);
  for (int64_t i = 0; i < 3; ++i) batch.prefill(i, prompts[i], lb.data());
  const std::vector<int32_t> slots = {0, 1, 2}, next = {alone[0][0], alone[1][0], alone[2][0]};
  batch.step(slots, next, lb.data());
  for (int64_t i = 0; i < 3; ++i) {
    one.reset(0);
    one.prefill(0, prompts[i], l1.data());
    const int32_t s0 = 0;
    one.step(std::span(&s0, 1), std::span(&next[i], 1), l1.data());
    EXPECT_LT(worst_position(std::vector<float>(lb.begin() + i * V, lb.begin() + (i + 1) * V), l1, V), 1e-6) << i;
  }
}

// The fused step (one parallel region per step, infer/fused_step.h) computes every element with the layered path's
// kernels in the same order, so its logits equal the layered path's bit for bit, at 1 and 2 threads, for both
// families (MoE) and a dense feed-forward, fp32 and bf16, one row and several (distinct positions and slots), over 16 steps (the caches it advances
// feed the later steps, so a state written differently would show).
// The fused step's phase timing (fused_step_timing, for bench/decode_step_bench): on, each step records every phase
// it ran under its name (per layer of a kind, once per step for the rest), with times that add up to no more than the
// steps' wall time; it changes no logit; off, nothing is recorded.
TEST(Decode, FusedStepPhaseTimingCountsEveryPhaseAndChangesNoBit) {
  auto m = init("qwen3_5_L7", DType::BF16, 3);
  const int64_t V = m->cfg().vocab, B = 2, steps = 5;
  int64_t gdn = 0, attn = 0;
  for (int64_t i = 0; i < m->cfg().layers; ++i)
    (model::slot_of_layer(m->cfg(), i).kind() == model::LayerKind::LinearAttention ? gdn : attn) += 1;
  ASSERT_GT(gdn, 0);
  ASSERT_GT(attn, 0);
  auto run = [&](bool timing, double* wall) {
    Decoder dec(*m->params, DType::BF16, B, 64, m->mem);
    EXPECT_TRUE(dec.fused());
    std::vector<float> logits(static_cast<size_t>(B * V)), out;
    for (int64_t b = 0; b < B; ++b) dec.prefill(b, random_ids(9 + b, V, 4 + b), logits.data());
    std::vector<int32_t> slots = {0, 1}, ids = {3, 5};
    infer::fused_step_timing(timing);
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t t = 0; t < steps; ++t) {
      dec.step(slots, ids, logits.data());
      out.insert(out.end(), logits.begin(), logits.end());
    }
    if (wall) *wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
  };
  double wall = 0;
  const std::vector<float> timed = run(true, &wall);
  const auto times = infer::fused_step_phase_times();
  infer::fused_step_timing(false);
  std::map<std::string, int64_t> count;
  double sum = 0;
  for (const auto& t : times) {
    count[t.name] = t.count;
    sum += t.seconds;
    EXPECT_GE(t.seconds, 0) << t.name;
  }
  EXPECT_EQ(count["embedding_norm"], steps);
  EXPECT_EQ(count["lm_head"], steps);
  for (const char* n : {"gdn.in_proj", "gdn.conv_norms_gates", "gdn.delta_step_norm", "gdn.out_proj"})
    EXPECT_EQ(count[n], steps * gdn) << n;
  for (const char* n : {"attn.qkv_proj", "attn.norms_rope_cache", "attn.cached", "attn.o_proj"})
    EXPECT_EQ(count[n], steps * attn) << n;
  for (const char* n : {"ffn.add_norm_route", "moe.gate_up", "moe.swiglu", "moe.down", "ffn.combine_add_norm"})
    EXPECT_EQ(count[n], steps * (gdn + attn)) << n;
  EXPECT_GT(sum, 0);
  EXPECT_LE(sum, wall);
  EXPECT_TRUE(infer::fused_step_phase_times().empty());  // turning it off cleared them
  const std::vector<float> plain = run(false, nullptr);
  EXPECT_TRUE(infer::fused_step_phase_times().empty());  // off: nothing recorded
  ASSERT_EQ(plain.size(), timed.size());
  EXPECT_EQ(0, std::memcmp(plain.data(), timed.data(), plain.size() * sizeof(float)));
}

TEST(Decode, FusedStepIsBitIdenticalToTheLayeredPath) {
  for (const char* name : {"qwen3_next_L5", "qwen3_5_L7", "dense"})
    for (DType dt : {DType::F32, DType::BF16}) {
      std::unique_ptr<Model> m;
      if (std::string(name) == "dense") {  // the Qwen3.5 body with a dense SwiGLU feed-forward
        m = std::make_unique<Model>();
        model::ModelConfig c = model::load_config(kParity + "qwen3_5_L5");
        c.experts = 0;
        c.top_k = 0;
        c.intermediate = 48;
        c.validate();
        m->params = std::make_unique<model::ParamSet>(c, dt, m->mem, MemCategory::Parameters, false);
        model::init_params(*m->params, 3);
      } else {
        m = init(name, dt, 3);
      }
      const int64_t V = m->cfg().vocab;
      const std::vector<std::vector<int32_t>> prompts = {random_ids(5, V, 1), random_ids(70, V, 2),
                                                         random_ids(17, V, 3)};
      for (int64_t B : {1, 3, 6}) {  // 6: the gemv's blocks of several rows
        std::vector<std::vector<float>> runs;
        for (int variant = 0; variant < 3; ++variant) {  // layered; fused at 2 threads; fused at 1 thread
          const int threads = omp_get_max_threads();
          // 2 threads even on a 1-core runner; the prefill and the steps at that count (products keep their bits
          // for any thread count at every level, kernels/matmul.h).
          const int step_threads = variant == 2 ? 1 : 2;
          omp_set_num_threads(step_threads);
          Decoder dec(*m->params, dt, B, 100, m->mem);
          dec.set_fused(variant > 0);
          EXPECT_EQ(dec.fused(), variant > 0) << name;
          std::vector<float> out, logits(static_cast<size_t>(B * V));
          std::vector<int32_t> slots, ids;
          for (int64_t b = 0; b < B; ++b) {
            dec.prefill(b, prompts[static_cast<size_t>(b % 3)], logits.data());
            slots.push_back(static_cast<int32_t>(B - 1 - b));  // rows not in slot order
            ids.push_back(static_cast<int32_t>((7 * b + 3) % V));
          }
          omp_set_num_threads(step_threads);
          for (int t = 0; t < 16; ++t) {
            dec.step(slots, ids, logits.data());
            out.insert(out.end(), logits.begin(), logits.end());
            for (int64_t b = 0; b < B; ++b)  // feed back the argmax, so the runs follow the same tokens
              ids[static_cast<size_t>(b)] = static_cast<int32_t>(
                  std::max_element(logits.begin() + b * V, logits.begin() + (b + 1) * V) - (logits.begin() + b * V));
          }
          omp_set_num_threads(threads);
          runs.push_back(std::move(out));
        }
        for (int variant = 1; variant < 3; ++variant) {
          ASSERT_EQ(runs[variant].size(), runs[0].size());
          size_t differ = 0;
          for (size_t i = 0; i < runs[0].size(); ++i)
            differ += std::memcmp(&runs[variant][i], &runs[0][i], sizeof(float)) != 0;
          EXPECT_EQ(differ, 0u) << name << " " << dtype_name(dt) << " B=" << B << " variant " << variant;
        }
      }
    }
}

// transformers' greedy generate (its own KV cache and recurrent state) on the random checkpoints: the same 40 tokens
// from prompts of 1, 7 and 70 tokens, and the logits of every step at the parity tolerance (5e-5 relative, see
// parity_test.cpp). The fixtures record the smallest best-vs-second logit gap (>= 2.2e-3), far above fp32 noise, so
// the greedy choices are unambiguous.
TEST(Decode, GreedyGenerationEqualsTransformers) {
  for (const char* name : {"qwen3_next_L4", "qwen3_next_L5", "qwen3_5_L4", "qwen3_5_L7"}) {
    auto m = load(name, DType::F32);
    const int64_t V = m->cfg().vocab;
    checkpoint::CheckpointReader fx(kGenerate + name + ".safetensors");
    for (int i = 0; fx.contains("prompt." + std::to_string(i)); ++i) {
      auto ints = [&](const std::string& n) {
        auto bytes = fx.bytes(n);
        std::vector<int32_t> v(bytes.size() / 4);
        std::memcpy(v.data(), bytes.data(), bytes.size());
        return v;
      };
      const auto prompt = ints("prompt." + std::to_string(i)), want = ints("tokens." + std::to_string(i));
      std::vector<float> scores(want.size() * V);
      fx.read_f32("scores." + std::to_string(i), scores);
      ASSERT_GE(want.size(), 32u);
      GenerateOptions opt;
      opt.max_new_tokens = static_cast<int64_t>(want.size());
      EXPECT_EQ(generate(*m->params, {prompt}, opt, m->mem).tokens[0], want) << name << " prompt " << i;

      Decoder dec(*m->params, DType::F32, 1, static_cast<int64_t>(prompt.size() + want.size()), m->mem);
      std::vector<float> ours(scores.size());
      dec.prefill(0, prompt, ours.data());
      const int32_t s0 = 0;
      for (size_t t = 1; t < want.size(); ++t) dec.step(std::span(&s0, 1), std::span(&want[t - 1], 1), ours.data() + t * V);
      EXPECT_LT(worst_position(ours, scores, V), 5e-5) << name << " prompt " << i;
    }
  }
}

// The caches are made once, at the size the spec gives (per sequence: each GDN layer Hv dk dv fp32 + (K-1) conv_dim
// in the cache dtype, each attention layer 2 nKV hd per position); a decoded token allocates nothing that outlives
// it, and its workspace does not grow with the position: live bytes, the peak and the accountant's allocations per
// step stay the same from the second step to the last.
TEST(Decode, DecodingAllocatesNothingPerTokenBeyondTheCaches) {
  auto m = load("qwen3_next_L5", DType::F32);
  const model::ModelConfig& c = m->cfg();
  const int64_t slots = 2, cap = 120, gdn = 4, attn = 1;
  const size_t before = m->mem.live_total();
  Decoder dec(*m->params, DType::F32, slots, cap, m->mem);
  const size_t per_slot = gdn * (c.v_heads * c.dk * c.dv * 4 + (c.conv_width - 1) * c.conv_dim() * 4) +
                          attn * 2 * c.kv_heads * c.head_dim * cap * 4;
  EXPECT_EQ(m->mem.live_total() - before, slots * per_slot);
  std::vector<float> logits(slots * c.vocab);
  dec.prefill(0, random_ids(30, c.vocab, 1), logits.data());
  dec.prefill(1, random_ids(3, c.vocab, 2), logits.data());
  const std::vector<int32_t> both = {0, 1}, ids = {7, 9};
  dec.step(both, ids, logits.data());
  const size_t live = m->mem.live_total();
  m->mem.reset_peak();
  dec.step(both, ids, logits.data());
  const size_t peak = m->mem.peak_total(), allocs = m->mem.allocations();
  dec.step(both, ids, logits.data());
  const size_t per_step = m->mem.allocations() - allocs;
  for (int t = 0; t < 80; ++t) {
    const size_t a = m->mem.allocations();
    dec.step(both, ids, logits.data());
    EXPECT_EQ(m->mem.live_total(), live);
    EXPECT_EQ(m->mem.allocations() - a, per_step);
  }
  EXPECT_EQ(m->mem.peak_total(), peak);
}

TEST(Decode, BadInputIsRefused) {
  auto m = load("qwen3_5_L4", DType::F32);
  Decoder dec(*m->params, DType::F32, 1, 10, m->mem);
  std::vector<float> logits(m->cfg().vocab);
  EXPECT_THROW(dec.prefill(0, random_ids(11, m->cfg().vocab, 1), logits.data()), std::out_of_range);
  const std::vector<int32_t> bad = {1, static_cast<int32_t>(m->cfg().vocab)};
  EXPECT_THROW(dec.prefill(0, bad, logits.data()), std::out_of_range);
  EXPECT_THROW(dec.prefill(1, bad, logits.data()), std::out_of_range);
  // A step refuses an id outside the vocabulary and a slot given twice before it starts (fused or not).
  Decoder two(*m->params, DType::F32, 2, 10, m->mem);
  std::vector<float> two_logits(2 * m->cfg().vocab);
  two.prefill(0, std::vector<int32_t>{1}, two_logits.data());
  two.prefill(1, std::vector<int32_t>{2}, two_logits.data());
  const std::vector<int32_t> slot0 = {0}, both = {0, 1}, twice = {1, 1}, out_id = {static_cast<int32_t>(m->cfg().vocab)};
  EXPECT_THROW(two.step(slot0, out_id, two_logits.data()), std::out_of_range);
  EXPECT_THROW(two.step(twice, both, two_logits.data()), std::invalid_argument);
  EXPECT_EQ(two.length(0), 1);
  two.step(both, both, two_logits.data());
  EXPECT_EQ(two.length(1), 2);
  GenerateOptions opt;
  opt.max_new_tokens = 0;
  EXPECT_THROW(generate(*m->params, {{1, 2}}, opt, m->mem), std::invalid_argument);
  opt.max_new_tokens = 3;
  EXPECT_THROW(generate(*m->params, {{}}, opt, m->mem), std::invalid_argument);
}

// The sampler as it was before it stopped sorting the vocabulary (a full partial_sort of all V ids): the reference
// the selection-based sampler must equal id for id and draw for draw.
int32_t full_sort_sample(const float* logits, int64_t vocab, const Sampling& s, std::mt19937_64& rng) {
  std::vector<std::pair<float, int32_t>> scratch(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) scratch[static_cast<size_t>(i)] = {logits[i], static_cast<int32_t>(i)};
  auto more_likely = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const int64_t k = s.top_k > 0 ? std::min(s.top_k, vocab) : vocab;
  std::partial_sort(scratch.begin(), scratch.begin() + k, scratch.end(), more_likely);
  const double mx = scratch[0].first, inv_t = 1.0 / s.temperature;
  double total = 0;
  for (int64_t i = 0; i < k; ++i) {
    auto& c = scratch[static_cast<size_t>(i)];
    c.first = static_cast<float>(std::exp((c.first - mx) * inv_t));
    total += c.first;
  }
  int64_t n = k;
  if (s.top_p < 1) {
    double acc = 0;
    for (n = 0; n < k;) {
      acc += scratch[static_cast<size_t>(n++)].first;
      if (acc >= s.top_p * total) break;
    }
    total = acc;
  }
  const double u = std::uniform_real_distribution<double>(0, total)(rng);
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    acc += scratch[static_cast<size_t>(i)].first;
    if (u < acc) return scratch[static_cast<size_t>(i)].second;
  }
  return scratch[static_cast<size_t>(n - 1)].second;
}

// On random logits (narrow: every id a candidate; wide: a few hundred weigh; integer-rounded: many ties, +-0), every
// temperature / top_k / top_p combination picks the ids the full sort picks, from generators left in the same state.
TEST(Decode, SamplerEqualsTheFullSortSampler) {
  std::mt19937 gen(11);
  std::vector<std::pair<float, int32_t>> scratch;
  int64_t cases = 0, differ = 0, wide_tails = 0;
  for (int64_t V : {int64_t{7}, int64_t{1000}, int64_t{248320}}) {
    for (int kind = 0; kind < 3; ++kind) {
      std::vector<float> logits(static_cast<size_t>(V));
      std::normal_distribution<float> nd(0.0f, kind == 0 ? 0.1f : 12.0f);
      for (float& l : logits) l = kind == 2 ? std::round(nd(gen) / 6.0f) * (gen() % 2 ? 1.0f : -1.0f) : nd(gen);
      for (double T : {0.3, 1.0, 2.5})
        for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{50}, V, V + 10})
          for (double top_p : {1.0, 0.9, 0.5, 0.01}) {
            if (V == 248320 && (T != 1.0 || (k != 0 && k != 50) || top_p == 0.5 || top_p == 0.01))
              continue;  // the big vocabulary: a few full reference sorts
            const Sampling sp{T, k, top_p, 0};
            std::mt19937_64 a(static_cast<uint64_t>(cases)), b(static_cast<uint64_t>(cases));
            for (int draw = 0; draw < (V == 248320 ? 2 : 20); ++draw) {
              differ += sample_token(logits.data(), V, sp, a, scratch) != full_sort_sample(logits.data(), V, sp, b);
              ++cases;
            }
            differ += a() != b();
            if (kind == 1 && (k == 0 || k > 1000)) ++wide_tails;
          }
    }
  }
  EXPECT_EQ(differ, 0) << "of " << cases << " draws";
  EXPECT_GT(wide_tails, 0);
}

// Logits that are not finite (a diverged model) never crash the sampler or give an id outside the vocabulary: NaN
// ids are never drawn, a +inf logit (the lowest id holding one) is certain, all -inf / all NaN gives id 0.
TEST(Decode, SamplerWithNonFiniteLogits) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::pair<float, int32_t>> scratch;
  std::mt19937_64 rng(5);
  for (const Sampling& sp : {Sampling{0.8, 0, 0.9, 0}, Sampling{0.8, 0, 1.0, 0}, Sampling{1.0, 3, 0.5, 0}}) {
    const std::vector<float> up = {nan, 1.0f, inf, 2.0f, inf}, down(6, -inf), nans(4, nan);
    const std::vector<float> some_nan = {nan, 0.0f, nan, std::log(3.0f), nan};
    for (int i = 0; i < 50; ++i) {
      EXPECT_EQ(sample_token(up.data(), 5, sp, rng, scratch), 2);
      EXPECT_EQ(sample_token(down.data(), 6, sp, rng, scratch), 0);
      EXPECT_EQ(sample_token(nans.data(), 4, sp, rng, scratch), 0);
      const int32_t t = sample_token(some_nan.data(), 5, sp, rng, scratch);
      EXPECT_TRUE(t == 1 || t == 3) << t;
    }
  }
}

// Sampling: temperature 0 and top_k 1 are the argmax; a seed reproduces a draw; draws follow softmax(l / T) over
// the top-k / top-p candidates (20000 draws: a frequency's standard error is below 0.0036, bounds at ~4 sigma).
TEST(Decode, SamplingFollowsTemperatureTopKAndTopP) {
  const std::vector<float> logits = {0.0f, std::log(2.0f), std::log(4.0f), std::log(1.0f), std::log(2.0f)};
  std::vector<std::pair<float, int32_t>> scratch;
  std::mt19937_64 rng(1);
  EXPECT_EQ(sample_token(logits.data(), 5, {0, 0, 1, 0}, rng, scratch), 2);
  EXPECT_EQ(sample_token(logits.data(), 5, {1.0, 1, 1, 0}, rng, scratch), 2);
  auto freq = [&](const Sampling& s) {
    std::vector<double> f(5);
    std::mt19937_64 g(s.seed);
    for (int i = 0; i < 20000; ++i) f[sample_token(logits.data(), 5, s, g, scratch)] += 1.0 / 20000;
    return f;
  };
  const auto all = freq({1.0, 0, 1, 3});  // weights 1, 2, 4, 1, 2 of 10
  const double want[] = {0.1, 0.2, 0.4, 0.1, 0.2};
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(all[i], want[i], 0.015) << i;
  const auto k2 = freq({1.0, 3, 1, 4});  // ids 2, 1, 4 (the lower id of the tie first): 4, 2, 2 of 8
  EXPECT_EQ(k2[0] + k2[3], 0.0);
  EXPECT_NEAR(k2[2], 0.5, 0.015);
  const auto p = freq({1.0, 0, 0.5, 5});  // the top id alone reaches 0.4 < 0.5: ids 2 and 1 (4 and 2 of 6)
  EXPECT_NEAR(p[2], 4.0 / 6, 0.015);
  EXPECT_NEAR(p[1], 2.0 / 6, 0.015);
  EXPECT_EQ(p[0] + p[3] + p[4], 0.0);
  EXPECT_EQ(freq({0.7, 0, 0.9, 9}), freq({0.7, 0, 0.9, 9}));
}

}  // namespace
}  // namespace hs::infer
