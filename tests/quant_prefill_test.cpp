// The prefill of a GGUF model read quantized (Decoder::prefill through infer/quant_prefill.h: pieces, layer by layer,
// batched products on the blocks by kernels::quant_matmul) against the two paths it must agree with:
//  * QuantPrefill.OneTokenPiecesGiveTheStepsBits: pieces of one token run the recurrent kernels and products of one
//    row (quant_matmul's int8 way: quant_gemv_rows' arithmetic), which must give the token-by-token fused steps'
//    logits bit for bit, at every position, and leave the same caches (the steps after it agree to the bit too). A
//    matrix read from the wrong part or rows, a missed V-head permutation, a conv window or state left wrong moves
//    the logits by far more than a bit.
//  * QuantPrefill.DequantizedProductsGiveTheDequantizedFilesLogits: with quant_matmul's dequantized way forced for
//    every type (weight tiles dequantized to fp32, then kernels::matmul: no activation rounding), pieces of 24 tokens
//    (the flash kernel, then pieces against the cache, and a last short one) equal the plain fp32 decoder on the same
//    file dequantized at load, in the same pieces, within fp32 rounding: (2 L + 1) 2 Kmax 2^-24 of the largest logit
//    (fp32 sums of at most Kmax products through the 2 L + 1 products of the longest path, as QuantDecode states it).
//  * QuantPrefill.ChunkedPrefillIsAsCloseToExactAsTokenByToken: the default (one 40-token piece, Auto products:
//    weights dequantized, inputs rounded to bf16 where the CPU has bf16 products, fp32 elsewhere) against a fused step
//    per token. Their difference is not a rounding bound: the chunked delta rule and flash attention sum in another
//    order (~1e-7 relative), and every product's input is rounded to Q8 (one quantum = 1/127 of its block's largest)
//    by the token-by-token path (to bf16 by the chunked one) -- an element ~1e-7 from a rounding edge lands a quantum
//    apart, and the logits then differ by ~1e-2 of the largest (tests/quant_decode_test.cpp measures this). So the
//    check is: the largest difference stays under kChaos = 0.1 of the largest logit (a wrong product or cache moves
//    them by O(1)), and the greedy token agrees wherever the reference's top-2 margin exceeds twice the difference
//    seen, at the prompt's end and over 6 steps fed the reference's tokens. Figures are printed.
//  * QuantPrefill.PlanEqualsWhatGenerateMeasures: planner::plan_generate_gguf (two 8-token pieces and a step)
//    against generate() of a 16-token prompt in 8-token pieces, to the byte.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "checkpoint/convert.h"
#include "gguf/export.h"
#include "gguf/gguf_file.h"
#include "gguf/import.h"
#include "infer/decoder.h"
#include "infer/generate.h"
#include "infer/weights.h"
#include "kernels/quant_gemv.h"
#include "model/params.h"
#include "planner/plan.h"
#include "gguf_files.h"
#include "test_util.h"

namespace hs::infer {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

using test::qwen35_q8;
using test::small_gguf;
std::string fixture(const std::string& name) { return test::gguf_fixture(name); }
// Qwen3-Next (MoE, ssm_ba kept in fp32), small Q8_0 and Q4_K (dense), Qwen3.5 with the V-head reorder.
std::vector<std::string> files(const TempDir& t) {
  return {fixture("qwen3_next_L5.q8_0"), small_gguf(t, gguf::QuantScheme::Q8_0), small_gguf(t, gguf::QuantScheme::Q4_K),
          qwen35_q8(t)};
}
std::vector<int32_t> prompt(int64_t n, int64_t vocab) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[static_cast<size_t>(i)] = static_cast<int32_t>((i * 37 + 11) % vocab);
  return p;
}
double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::abs(x)));
  return m;
}
int32_t argmax(const float* l, int64_t V) { return static_cast<int32_t>(std::max_element(l, l + V) - l); }
double top2_margin(const float* l, int64_t V) {
  std::vector<float> c(l, l + V);
  std::partial_sort(c.begin(), c.begin() + 2, c.end(), std::greater<float>());
  return double(c[0]) - c[1];
}

TEST(QuantPrefill, OneTokenPiecesGiveTheStepsBits) {
  TempDir t;
  for (const std::string& f : files(t)) {
    MemoryAccountant mem;
    auto w = load_gguf_weights(f, mem);
    const int64_t V = w->params->config().vocab, n = 9;
    Decoder chunked(*w->params, DType::F32, 1, 32, mem, /*piece=*/1, w->quant.get());
    Decoder steps(*w->params, DType::F32, 1, 32, mem, 512, w->quant.get());
    steps.set_quant_prefill(Decoder::QuantPrefill::TokenByToken);
    const std::vector<int32_t> ids = prompt(n, V);
    std::vector<float> a(static_cast<size_t>(n * V)), b(a.size());
    chunked.prefill(0, ids, a.data(), /*all_logits=*/true);
    steps.prefill(0, ids, b.data(), true);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(0, std::memcmp(a.data() + i * V, b.data() + i * V, static_cast<size_t>(V) * sizeof(float)))
          << fs::path(f).filename() << " position " << i << ": largest difference "
          << [&] {
               double d = 0;
               for (int64_t v = 0; v < V; ++v) d = std::max(d, double(std::abs(a[i * V + v] - b[i * V + v])));
               return d;
             }();
    // The caches it leaves: two steps after it, still the same bits.
    const int32_t slot = 0;
    for (int s = 0; s < 2; ++s) {
      const int32_t tok = argmax(b.data(), V);
      chunked.step({&slot, 1}, {&tok, 1}, a.data());
      steps.step({&slot, 1}, {&tok, 1}, b.data());
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), static_cast<size_t>(V) * sizeof(float)))
          << fs::path(f).filename() << " step " << s;
    }
    std::printf("%s: %lld one-token pieces and 2 steps, bit-identical to the token-by-token prefill\n",
                fs::path(f).filename().c_str(), static_cast<long long>(n));
  }
}

constexpr double kNoWorse = 1.25;

double fp32_bound(const std::string& file) {
  const gguf::GgufReader r(file);
  const model::ModelConfig c = gguf::config_from_gguf(r);
  const int64_t kmax =
      std::max({c.hidden, c.moe() ? c.expert_inter : c.intermediate, c.value_dim(), c.q_heads * c.head_dim});
  return (2.0 * c.layers + 1) * 2.0 * double(kmax) * std::ldexp(1.0, -24);
}

TEST(QuantPrefill, DequantizedProductsGiveTheDequantizedFilesLogits) {
  TempDir t;
  for (const std::string& f : files(t)) {
    MemoryAccountant mem_q, mem_r;
    auto wq = load_gguf_weights(f, mem_q);
    gguf::CheckpointPath src(f);
    auto wr = load_weights(checkpoint::open_checkpoint_dir(src.path()), DType::F32, mem_r);
    const int64_t V = wq->params->config().vocab, n = 50, piece = 24;
    Decoder q(*wq->params, DType::F32, 1, 64, mem_q, piece, wq->quant.get());
    q.set_quant_prefill(Decoder::QuantPrefill::Chunked, kernels::QuantMatmul::Dequantized);
    Decoder ref(*wr->params, DType::F32, 1, 64, mem_r, piece);
    const std::vector<int32_t> ids = prompt(n, V);
    std::vector<float> a(static_cast<size_t>(n * V)), b(a.size());
    q.prefill(0, ids, a.data(), true);
    ref.prefill(0, ids, b.data(), true);
    const double bound = fp32_bound(f);
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      const std::vector<float> row(b.begin() + i * V, b.begin() + (i + 1) * V);
      const double amax = max_abs(row);
      double d = 0;
      for (int64_t v = 0; v < V; ++v) d = std::max(d, double(std::abs(a[i * V + v] - b[i * V + v])));
      worst = std::max(worst, d / amax);
      EXPECT_LE(d, bound * amax) << fs::path(f).filename() << " position " << i;
    }
    std::printf("%s: %lld positions in pieces of %lld: largest |difference| / max |logit| %.3g (bound %.3g)\n",
                fs::path(f).filename().c_str(), static_cast<long long>(n), static_cast<long long>(piece), worst, bound);
  }
}

TEST(QuantPrefill, ChunkedPrefillIsAsCloseToExactAsTokenByToken) {
  TempDir t;
  for (const std::string& f : files(t)) {
    MemoryAccountant mem, mem_r;
    auto w = load_gguf_weights(f, mem);
    gguf::CheckpointPath src(f);
    auto wr = load_weights(checkpoint::open_checkpoint_dir(src.path()), DType::F32, mem_r);
    const int64_t V = w->params->config().vocab, n = 40;
    Decoder chunked(*w->params, DType::F32, 1, 64, mem, 512, w->quant.get());
    Decoder steps(*w->params, DType::F32, 1, 64, mem, 512, w->quant.get());
    steps.set_quant_prefill(Decoder::QuantPrefill::TokenByToken);
    Decoder exact(*wr->params, DType::F32, 1, 64, mem_r, 512);
    const std::vector<int32_t> ids = prompt(n, V);
    std::vector<float> c(static_cast<size_t>(n * V)), s(c.size()), e(c.size());
    chunked.prefill(0, ids, c.data(), true);
    steps.prefill(0, ids, s.data(), true);
    exact.prefill(0, ids, e.data(), true);
    double sc = 0, ss = 0, worst_cs = 0;  // squared relative errors against exact, summed over positions
    int agree = 0, checked = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float *ci = c.data() + i * V, *si = s.data() + i * V, *ei = e.data() + i * V;
      double amax = 0, dc = 0, ds = 0, dcs = 0;
      for (int64_t v = 0; v < V; ++v) {
        amax = std::max(amax, double(std::abs(ei[v])));
        dc = std::max(dc, double(std::abs(ci[v] - ei[v])));
        ds = std::max(ds, double(std::abs(si[v] - ei[v])));
        dcs = std::max(dcs, double(std::abs(ci[v] - si[v])));
      }
      sc += (dc / amax) * (dc / amax);
      ss += (ds / amax) * (ds / amax);
      worst_cs = std::max(worst_cs, dcs / amax);
      agree += argmax(ci, V) == argmax(si, V);
      if (top2_margin(ei, V) > 2 * std::max(dc, ds)) {  // both within half the margin: both must pick exact's token
        ++checked;
        EXPECT_EQ(argmax(ci, V), argmax(ei, V)) << fs::path(f).filename() << " position " << i;
        EXPECT_EQ(argmax(si, V), argmax(ei, V)) << fs::path(f).filename() << " position " << i;
      }
    }
    const double rc = std::sqrt(sc / double(n)), rs = std::sqrt(ss / double(n));
    EXPECT_LE(rc, kNoWorse * rs + fp32_bound(f)) << fs::path(f).filename();
    EXPECT_GT(checked, 0) << fs::path(f).filename() << ": no position with a margin to check the token at";
    std::printf("%s, %lld positions: RMS over positions of max |logit - exact| / max |exact|: chunked %.3g, "
                "token-by-token %.3g; chunked vs token-by-token up to %.3g; greedy tokens agree at %d of %lld "
                "(%d positions with a margin, checked against exact)\n",
                fs::path(f).filename().c_str(), static_cast<long long>(n), rc, rs, worst_cs, agree,
                static_cast<long long>(n), checked);
  }
}

TEST(QuantPrefill, PlanEqualsWhatGenerateMeasures) {
  TempDir t;
  for (const std::string& f : files(t)) {
    planner::GeneratePlanRequest req;
    req.context = 16 + 6 - 1;  // generate's capacity: the longest prompt + new tokens - 1
    req.batch = 2;
    req.piece = 8;  // the plan's prompt: two pieces, as the 16-token prompt fills
    const planner::QuantizedGeneratePlan plan = planner::plan_generate_gguf(f, req);
    MemoryAccountant mem;
    auto w = load_gguf_weights(f, mem);
    GenerateOptions opt;
    opt.max_new_tokens = 6;
    opt.piece = 8;
    opt.quant = w->quant.get();
    const GenerateResult res = generate(*w->params, {prompt(16, 64), {5, 6, 7}}, opt, mem);
    EXPECT_EQ(res.peak_bytes + w->quant->bytes, plan.plan.total) << f;
    EXPECT_EQ(res.kv_cache_bytes, plan.plan.kv_cache) << f;
    std::printf("%s: plan total %zu = measured peak %zu + quantized blocks %llu\n", fs::path(f).filename().c_str(),
                plan.plan.total, res.peak_bytes, static_cast<unsigned long long>(w->quant->bytes));
  }
}

// The command line: plan --generate and generate --json of a .gguf (from its blocks, the default) report the same
// bytes (the accounted peak plus the quantized blocks used in place) for a 16-token prompt in pieces of 8, and the
// same caches.
TEST(QuantPrefill, PlanCommandEqualsGenerateCommand) {
  TempDir dir;
  const std::string f = fixture("qwen3_next_L5.q8_0");
  auto run = [&](const std::string& args) {
    const std::string out = (dir / "out").string();
    EXPECT_EQ(std::system((test::binary() + " " + args + " >" + out + " 2>/dev/null").c_str()), 0) << args;
    const auto bytes = test::read_bytes(out);
    std::string s(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    const size_t end = s.find_last_not_of('\n'), start = s.rfind('\n', end);
    return nlohmann::json::parse(s.substr(start == std::string::npos ? 0 : start + 1, end - start));
  };
  const auto g = run("generate --checkpoint " + f +
                     " --prompt-ids 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16 --max-new-tokens 5 "
                     "--prefill-piece 8 --ignore-eos --json");
  const auto p = run("plan --generate --model " + f + " --context 20 --batch 1 --prefill-piece 8 --json");
  EXPECT_EQ(p["weights_run_as"], "gguf blocks");
  EXPECT_EQ(g["accounted_peak_bytes"].get<size_t>() + g["weights_mapped_bytes"].get<size_t>(),
            p["total_bytes"].get<size_t>());
  EXPECT_EQ(g["weights_mapped_bytes"], p["quantized_weights_bytes"]);
  EXPECT_EQ(g["kv_cache_bytes"], p["kv_cache_bytes"]);
  EXPECT_EQ(g["recurrent_state_bytes"], p["recurrent_state_bytes"]);
  EXPECT_EQ(g["tokens"][0].size(), 5u);
  std::printf("generate: accounted peak %zu + blocks %zu = plan --generate %zu\n",
              g["accounted_peak_bytes"].get<size_t>(), g["weights_mapped_bytes"].get<size_t>(),
              p["total_bytes"].get<size_t>());
}

// eval --gguf-blocks (each window prefilled on the quantized blocks) against eval on the file dequantized at load:
// the same windows and tokens, and a cross-entropy near it (relative). Products of more than 16 rows run on dequantized
// weights (only the experts' few-row products round their activations to Q8): in fp32 where this CPU has no bf16
// products (measured 6e-5 for Q8_0, 9e-5 for Q4_K under HS_MAX_ISA=avx2): 1e-3; with inputs rounded to bf16 where it
// has them (quant_matmul's DequantizedBf16: measured 1.2e-3 and 2.7e-4 on AMX): 5e-3, the bound the int8 way (Q8_K
// activations, as llama.cpp's) was held to (measured 1.7e-3 for Q4_K). A wrong product or window moves the
// cross-entropy of these random models by O(0.1).
TEST(QuantPrefill, EvalOnTheBlocksNearTheDequantizedFile) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 300; ++i) text += i % 7 == 0 ? "unto the lord " : i % 3 ? "and he shall " : "in the beginning ";
  {
    std::FILE* fp = std::fopen((dir / "t.txt").c_str(), "w");
    ASSERT_TRUE(fp);
    std::fwrite(text.data(), 1, text.size(), fp);
    std::fclose(fp);
  }
  auto run = [&](const std::string& args) {
    const std::string out = (dir / "out").string();
    EXPECT_EQ(std::system((test::binary() + " " + args + " >" + out + " 2>/dev/null").c_str()), 0) << args;
    const auto bytes = test::read_bytes(out);
    std::string s(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    const size_t end = s.find_last_not_of('\n'), start = s.rfind('\n', end);
    return nlohmann::json::parse(s.substr(start == std::string::npos ? 0 : start + 1, end - start));
  };
  const bool bf16_products = kernels::quant_matmul_way(kernels::GgmlType::Q8_0, 64, kernels::QuantMatmul::Auto, true) ==
                             kernels::QuantMatmul::DequantizedBf16;
  const double tol = bf16_products ? 5e-3 : 1e-3;
  for (const std::string& f : {fixture("qwen3_next_L5.q8_0"), small_gguf(dir, gguf::QuantScheme::Q4_K)}) {
    const std::string args = "eval --checkpoint " + f + " --text " + (dir / "t.txt").string() + " --seq 64";
    const auto deq = run(args + " --gguf-dequantize"), q = run(args);  // (the blocks: the default for a .gguf)
    EXPECT_EQ(q["gguf_blocks"], true);
    EXPECT_EQ(deq["gguf_blocks"], false);
    EXPECT_EQ(q["tokens"], deq["tokens"]);
    const double a = deq["cross_entropy"].get<double>(), b = q["cross_entropy"].get<double>();
    EXPECT_NEAR(b, a, tol * a) << f;
    std::printf("%s: eval cross-entropy dequantized at load %.6f, on the blocks %.6f (%lld tokens)\n",
                fs::path(f).filename().c_str(), a, b, static_cast<long long>(q["tokens"].get<int64_t>()));
  }
}

}  // namespace
}  // namespace hs::infer
