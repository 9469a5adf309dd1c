// plan --generate against what generation measures: the planner runs the decoder over shapes, so its total must be
// the accountant's peak of a real generate() whose prompts fill a prefill piece, to the byte.
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "infer/generate.h"
#include "planner/plan.h"
#include "test_util.h"

namespace hs {
namespace {

const std::string kParity = hs::test::source_dir() + "/tests/fixtures/parity/";

TEST(GeneratePlan, TotalIsTheMeasuredPeakToTheByte) {
  for (DType dt : {DType::F32, DType::BF16}) {
    for (const char* name : {"qwen3_next_L5", "qwen3_5_L7"}) {
      const model::ModelConfig cfg = model::load_config(kParity + name);
      MemoryAccountant mem;
      model::ParamSet ps(cfg, dt, mem, MemCategory::Parameters, false);
      model::init_params(ps, 3);
      std::mt19937 rng(1);
      std::vector<std::vector<int32_t>> prompts;
      for (int64_t n : {130, 128, 90}) {  // the first two fill two 64-token pieces
        prompts.emplace_back(static_cast<size_t>(n));
        for (auto& x : prompts.back()) x = static_cast<int32_t>(rng() % 256);
      }
      infer::GenerateOptions opt;
      opt.max_new_tokens = 12;
      opt.compute = dt;
      opt.piece = 64;
      const infer::GenerateResult g = infer::generate(ps, prompts, opt, mem);
      planner::GeneratePlanRequest r;
      r.model = cfg;
      r.context = 130 + 12 - 1;
      r.batch = 3;
      r.piece = 64;
      r.weight_dtype = dt;
      const planner::GeneratePlan p = planner::plan_generate(r);
      EXPECT_EQ(p.total, g.peak_bytes) << name;
      EXPECT_EQ(p.kv_cache, g.kv_cache_bytes) << name;
      EXPECT_EQ(p.recurrent_state, g.recurrent_state_bytes) << name;
      EXPECT_EQ(p.weights, ps.nbytes()) << name;
      EXPECT_GT(p.workspace, 0u);
      // The formula for the caches (docs/model.md, "Decoding"): per sequence at context t,
      // L_gdn (Hv dk dv 4 + (K-1) conv_dim b) + L_attn 2 nKV hd t b.
      const size_t b = dtype_size(dt), L_attn = size_t(cfg.layers / cfg.cycle), L_gdn = size_t(cfg.layers) - L_attn;
      EXPECT_EQ(p.recurrent_state, 3 * L_gdn * (cfg.v_heads * cfg.dk * cfg.dv * 4 + (cfg.conv_width - 1) * cfg.conv_dim() * b));
      EXPECT_EQ(p.kv_cache, 3 * L_attn * 2 * cfg.kv_heads * cfg.head_dim * r.context * b);
    }
  }
}

// A context of at most two prefill pieces (here 20 positions, pieces of 512): the plan's prompt leaves room for the
// step (it used to fill the context and the step found the slot full), and equals what generate measures for a
// prompt of 19 tokens and 2 new ones; a context of 1 plans the prompt alone.
TEST(GeneratePlan, ShortContextsPlanTheirStep) {
  const model::ModelConfig cfg = model::load_config(kParity + "qwen3_5_L7");
  MemoryAccountant mem;
  model::ParamSet ps(cfg, DType::F32, mem, MemCategory::Parameters, false);
  model::init_params(ps, 3);
  infer::GenerateOptions opt;
  opt.max_new_tokens = 2;
  const infer::GenerateResult g = infer::generate(ps, {std::vector<int32_t>(19, 5)}, opt, mem);
  planner::GeneratePlanRequest r;
  r.model = cfg;
  r.context = 20;
  r.batch = 1;
  r.weight_dtype = DType::F32;
  EXPECT_EQ(planner::plan_generate(r).total, g.peak_bytes);
  opt.max_new_tokens = 1;
  const infer::GenerateResult one = infer::generate(ps, {std::vector<int32_t>(1, 5)}, opt, mem);
  r.context = 1;
  EXPECT_EQ(planner::plan_generate(r).total, one.peak_bytes);
}

// The command line: plan --generate and generate --json report the same bytes for a 1100-byte prompt (two 512-token
// pieces, as planned); a 300-byte prompt needs less.
TEST(GeneratePlan, CommandLineFiguresAgree) {
  test::TempDir dir;
  const std::string ck = kParity + "qwen3_5_L7";
  const std::string prompt(1100, 'a');
  auto run = [&](const std::string& args) {
    const std::string out = (dir / "out").string();
    EXPECT_EQ(std::system((hs::test::binary() + " " + args + " >" + out + " 2>/dev/null").c_str()), 0) << args;
    const auto bytes = test::read_bytes(out);
    std::string s(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    const size_t end = s.find_last_not_of('\n'), start = s.rfind('\n', end);
    return nlohmann::json::parse(s.substr(start == std::string::npos ? 0 : start + 1, end - start));
  };
  const auto g = run("generate --checkpoint " + ck + " --prompt " + prompt + " --max-new-tokens 5 --json --weights-memory map");
  const auto p = run("plan --generate --model " + ck + "/config.json --context 1104 --batch 1 --weight-dtype fp32 --json");
  // Weights used in place from the mapped files are outside the accountant (transformers saved this checkpoint's
  // experts one tensor each, which are fused in memory, so part is copied); the plan counts them all.
  EXPECT_GT(g["weights_mapped_bytes"].get<size_t>(), 0u);
  EXPECT_EQ(g["accounted_peak_bytes"].get<size_t>() + g["weights_mapped_bytes"].get<size_t>(),
            p["total_bytes"].get<size_t>());
  const auto shorter = run("generate --checkpoint " + ck + " --prompt " + std::string(300, 'a') + " --max-new-tokens 805 --json");
  EXPECT_LT(shorter["accounted_peak_bytes"].get<size_t>(), p["total_bytes"].get<size_t>());
  EXPECT_EQ(g["kv_cache_bytes"], p["kv_cache_bytes"]);
  EXPECT_EQ(g["recurrent_state_bytes"], p["recurrent_state_bytes"]);
  // --weights-memory copy: every weight but the embedding table in the accountant; the sum is the plan's again, and
  // the tokens are the same.
  const auto c = run("generate --checkpoint " + ck + " --prompt " + prompt + " --max-new-tokens 5 --json --weights-memory copy");
  EXPECT_EQ(c["weights_memory"], "copy");
  EXPECT_LT(c["weights_mapped_bytes"].get<size_t>(), g["weights_mapped_bytes"].get<size_t>());
  EXPECT_EQ(c["accounted_peak_bytes"].get<size_t>() + c["weights_mapped_bytes"].get<size_t>(),
            p["total_bytes"].get<size_t>());
  EXPECT_EQ(c["tokens"], g["tokens"]);
}

}  // namespace
}  // namespace hs
