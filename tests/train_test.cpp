// Training end to end: exact resume, learning on real text, and the planner's exactness against measured steps.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "planner/plan.h"
#include "train/trainer.h"
#include "test_util.h"
#include "train_util.h"

namespace hs::train {
namespace {

namespace fs = std::filesystem;

TrainOptions tiny_options(const fs::path& out) {
  TrainOptions o = tiny_synthetic_run(8, 40);
  o.out = out.string();
  o.step.compute = DType::F32;
  return o;
}

// N steps, save, resume, M steps: the same losses, bit for bit, as N+M steps in one run (weights, AdamW moments, step
// count, learning-rate schedule and data order all come back), for fp32 and bf16 weights.
TEST(Train, ResumeIsBitExact) {
  for (DType w : {DType::F32, DType::BF16}) {
    const fs::path root = fs::temp_directory_path() / ("hs_resume_" + std::to_string(::getpid()));
    fs::remove_all(root);
    std::ostringstream log;
    TrainOptions full = tiny_options(root / "full");
    full.weight_dtype = w;
    TrainSummary a = run_training(full, log);
    ASSERT_EQ(a.losses.size(), 8u);

    TrainOptions first = tiny_options(root / "part");
    first.weight_dtype = w;
    first.stop_after = 5;
    TrainSummary b = run_training(first, log);
    ASSERT_EQ(b.losses.size(), 5u);
    ASSERT_TRUE(fs::exists(root / "part/checkpoint-5/optimizer.safetensors"));

    TrainOptions rest = tiny_options(root / "resumed");
    rest.resume = (root / "part/checkpoint-5").string();
    rest.synthetic = false;  // taken back from the checkpoint
    rest.batch = 99;         // likewise: the checkpoint's options win
    TrainSummary c = run_training(rest, log);
    ASSERT_EQ(c.losses.size(), 3u);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(a.losses[size_t(i)], b.losses[size_t(i)]) << i;
    for (int i = 0; i < 3; ++i) EXPECT_EQ(a.losses[size_t(5 + i)], c.losses[size_t(i)]) << (5 + i);
    fs::remove_all(root);
  }
}

// A resume takes the compute dtype and the remat policy back from the checkpoint: saved with fp32 compute and remat
// none, resumed with the defaults (bf16, sublayer) left in the options, the rest of the curve is the same bits; a
// command line that names other ones is refused with a clear error before any step.
// --delta-rule-products is the step's arithmetic too: saved in the options, taken back by a resume that leaves it out,
// and refused when a resume names the other one.
TEST(Train, ResumeTakesTheDeltaRuleProductsBack) {
  TrainOptions saved = tiny_options(fs::temp_directory_path() / "unused");
  saved.step.delta_rule_bf16_products = true;
  const nlohmann::json j = options_to_json(saved);
  EXPECT_EQ(j.at("delta_rule_products"), "bf16");
  TrainOptions resumed = tiny_options(fs::temp_directory_path() / "unused");
  options_from_json(j, resumed);
  EXPECT_TRUE(resumed.step.delta_rule_bf16_products);
  TrainOptions named = tiny_options(fs::temp_directory_path() / "unused");
  named.delta_products_given = true;  // --delta-rule-products fp32 on the command line
  EXPECT_NE(test::error_of([&] { options_from_json(j, named); })
                .find("delta rule products fp32 differs from the checkpoint's bf16"),
            std::string::npos);
  TrainOptions old = tiny_options(fs::temp_directory_path() / "unused");
  nlohmann::json before = j;
  before.erase("delta_rule_products");  // a checkpoint from before the option: fp32 products
  options_from_json(before, old);
  EXPECT_FALSE(old.step.delta_rule_bf16_products);
}

TEST(Train, ResumeTakesComputeDtypeAndRematBack) {
  const fs::path root = fs::temp_directory_path() / ("hs_resume_dtype_" + std::to_string(::getpid()));
  fs::remove_all(root);
  std::ostringstream log;
  TrainOptions full = tiny_options(root / "full");
  full.steps = 6;
  full.step.remat = RematPolicy::None;
  TrainSummary a = run_training(full, log);
  TrainOptions first = full;
  first.out = (root / "part").string();
  first.stop_after = 3;
  run_training(first, log);
  TrainOptions rest = tiny_options(root / "resumed");
  rest.steps = 6;
  rest.resume = (root / "part/checkpoint-3").string();
  rest.step.compute = DType::BF16;  // what the command line has when --compute-dtype is not given
  rest.step.remat = RematPolicy::Sublayer;
  TrainSummary c = run_training(rest, log);
  ASSERT_EQ(c.losses.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(a.losses[size_t(3 + i)], c.losses[size_t(i)]) << (3 + i);
  TrainOptions named = rest;
  named.out = (root / "named").string();
  named.compute_given = true;
  try {
    run_training(named, log);
    ADD_FAILURE() << "a resume with another --compute-dtype was not refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("compute dtype bf16 differs from the checkpoint's f32"), std::string::npos)
        << e.what();
  }
  named.compute_given = false;
  named.step.compute = DType::F32;
  named.remat_given = true;
  try {
    run_training(named, log);
    ADD_FAILURE() << "a resume with another --remat was not refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("remat policy sublayer differs from the checkpoint's none"), std::string::npos)
        << e.what();
  }
  fs::remove_all(root);
}

// A few hundred steps on a repetitive text: the loss must fall far below the byte unigram entropy of the text.
TEST(Train, LearnsRealText) {
  const fs::path root = fs::temp_directory_path() / ("hs_learn_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  {
    std::ofstream f(root / "text.txt");
    for (int i = 0; i < 400; ++i) f << "In the beginning God created the heaven and the earth. And the earth was without form. ";
  }
  TrainOptions o = tiny_options(root / "run");
  o.synthetic = false;
  o.text = (root / "text.txt").string();
  o.steps = 60;
  o.batch = 4;
  o.seq = 64;
  o.opt.lr = 1e-2;
  o.opt.warmup = 5;
  o.eval_every = 60;
  o.eval_batches = 2;
  std::ostringstream log;
  TrainSummary s = run_training(o, log);
  // The unigram entropy of this text is ~3.0 nats; a model that uses context drives it well below.
  EXPECT_LT(s.eval_ce, 1.5) << log.str();
  EXPECT_LT(s.final_ce, s.losses.front() - 2.0);
  EXPECT_TRUE(fs::exists(root / "run/loss.svg"));
  EXPECT_TRUE(fs::exists(root / "run/metrics.jsonl"));
  fs::remove_all(root);
}

// The planner runs the same schedule over shapes: its peak equals the peak measured by a real training step (within
// 1%; in fact exactly, since both make the same allocations) for every policy and weight dtype, for tiny and small.
TEST(Planner, PlannedPeakEqualsMeasuredTrainingStep) {
  for (const char* preset : {"tiny", "small"})
    for (RematPolicy pol : {RematPolicy::None, RematPolicy::Block, RematPolicy::Sublayer})
      for (DType w : {DType::F32, DType::BF16}) {
        TrainOptions o = tiny_options("");
        o.model = preset;
        o.steps = 1;
        o.batch = 2;
        o.seq = 32;
        o.weight_dtype = w;
        o.step = {pol, DType::BF16};
        std::ostringstream log;
        TrainSummary s = run_training(o, log);
        planner::PlanRequest r;
        r.model = model::preset(preset);
        r.batch_per_device = 2;
        r.seq = 32;
        r.step.remat = pol;
        r.weight_dtype = w;
        planner::PlanResult p = planner::plan(r);
        const double measured = double(s.peak_bytes), planned = double(p.total_bytes);
        EXPECT_NEAR(planned, measured, 0.01 * measured) << preset << " " << remat_name(pol) << " " << dtype_name(w);
        EXPECT_EQ(p.argument_bytes, s.argument_bytes);
        EXPECT_EQ(p.temp_bytes, s.temp_bytes);
      }
}

// Sub-layer remat plans above block by at most the layer inputs it keeps and block does not (one per layer that
// does not start a block, tokens x hidden in bf16): with routed experts in pieces the peak can be at the LM head,
// where those inputs are all live; never by a layer's weights or gradients.
TEST(Planner, SublayerPlansAboveBlockByAtMostItsKeptInputsAndAutoPicks) {
  for (const char* preset : {"small", "qwen3.5-35b-a3b"})
    for (DType w : {DType::F32, DType::BF16}) {
      planner::PlanRequest r;
      r.model = model::preset(preset);
      r.devices = std::string(preset) == "small" ? 1 : 256;
      r.seq = 1024;
      r.weight_dtype = w;
      r.step.remat = RematPolicy::Block;
      planner::PlanResult block = planner::plan(r);
      r.step.remat = RematPolicy::Sublayer;
      planner::PlanResult sub = planner::plan(r);
      const model::ModelConfig& c = r.model;
      const size_t kept_inputs = size_t(c.layers - c.blocks() - (c.remainder() > 0)) * size_t(r.seq * c.hidden) * 2;
      EXPECT_LE(sub.temp_bytes, block.temp_bytes + kept_inputs) << preset << " " << dtype_name(w);
      EXPECT_EQ(sub.argument_bytes, block.argument_bytes);
      planner::PlanResult roomy = planner::plan_auto(r, size_t(1) << 50);
      EXPECT_EQ(roomy.remat, RematPolicy::None);
      planner::PlanResult tight = planner::plan_auto(r, sub.total_bytes);
      EXPECT_EQ(tight.remat, RematPolicy::Sublayer);
      EXPECT_TRUE(tight.fits);
    }
}

}  // namespace
}  // namespace hs::train
