// Weights for inference (infer/weights.h): a native scanned checkpoint in the asked dtype is used in place through
// the mapping (no byte of it in the accountant, the tensors' data pointers inside the file's map); anything else is
// copied. Both give the same generation.
#include <gtest/gtest.h>

#include "checkpoint/convert.h"
#include "infer/generate.h"
#include "infer/weights.h"
#include "test_util.h"

namespace hs::infer {
namespace {

const std::string kParity = std::string(HS_SOURCE_DIR) + "/tests/fixtures/parity/";

TEST(InferenceWeights, NativeCheckpointsAreMappedInTheirStoredDtype) {
  test::TempDir dir;
  MemoryAccountant mem;
  const model::ModelConfig cfg = model::load_config(kParity + "qwen3_5_L7");
  model::ParamSet ps(cfg, DType::BF16, mem, MemCategory::Parameters, false);
  model::init_params(ps, 9);
  checkpoint::save_native(dir / "ck", {&ps, nullptr, nullptr, nlohmann::json{{"step", 0}}});
  const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(dir / "ck");

  GenerateOptions opt;
  opt.max_new_tokens = 20;
  opt.compute = DType::BF16;
  const std::vector<std::vector<int32_t>> prompts = {{3, 1, 4, 1, 5, 9, 2, 6}};
  const auto want = generate(ps, prompts, opt, mem).tokens;

  MemoryAccountant fresh;
  auto mapped = load_weights(d, std::nullopt, fresh);
  ASSERT_TRUE(mapped->mapped) << (mapped->notes.empty() ? "" : mapped->notes[0]);
  EXPECT_EQ(fresh.live_total(), 0u);
  for (const auto& sp : mapped->params->all()) {
    EXPECT_EQ(sp.tensor.data(), mapped->reader->bytes(sp.name).data()) << sp.name;
    EXPECT_EQ(sp.dtype, ps.find(sp.name)->dtype) << sp.name;
  }
  EXPECT_EQ(generate(*mapped->params, prompts, opt, fresh).tokens, want);

  // Asked for fp32: converted into memory, with the reason.
  MemoryAccountant other;
  auto copied = load_weights(d, DType::F32, other);
  EXPECT_FALSE(copied->mapped);
  ASSERT_FALSE(copied->notes.empty());
  EXPECT_NE(copied->notes[0].find("stored as BF16"), std::string::npos) << copied->notes[0];
  EXPECT_EQ(other.live_total(), copied->params->nbytes());
  EXPECT_EQ(copied->params->global(model::g::kEmbed).dtype, DType::F32);
}

TEST(InferenceWeights, HuggingFaceCheckpointsAreCopiedInTheirStoredDtype) {
  const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(kParity + "qwen3_next_L5");
  EXPECT_EQ(stored_weight_dtype(d), DType::F32);
  MemoryAccountant mem;
  auto w = load_weights(d, std::nullopt, mem);
  EXPECT_FALSE(w->mapped);
  EXPECT_EQ(w->params->global(model::g::kLmHead).dtype, DType::F32);
  EXPECT_EQ(mem.live_total(), w->params->nbytes());
  auto b = load_weights(d, DType::BF16, mem);
  EXPECT_EQ(b->params->global(model::g::kLmHead).dtype, DType::BF16);
}

}  // namespace
}  // namespace hs::infer
