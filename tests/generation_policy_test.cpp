// Generation's policy (infer/policy.h): the ids that end a sequence, the new-token budget within the model's
// context.
#include <gtest/gtest.h>

#include <stdexcept>

#include "infer/policy.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace hs::infer {
namespace {

TEST(GenerationPolicy, EndIdsComeFromTheConfigAndTheTokenizer) {
  EXPECT_TRUE(end_ids(nlohmann::json::object(), nullptr).empty());
  EXPECT_EQ(end_ids({{"eos_token_id", 7}}, nullptr), (std::vector<int32_t>{7}));
  EXPECT_EQ(end_ids({{"text_config", {{"eos_token_id", {5, 6}}}}}, nullptr), (std::vector<int32_t>{5, 6}));
  const tokenizer::Tokenizer tok =
      tokenizer::Tokenizer::load(test::source_dir() + "/tests/fixtures/tokenizer/qwen3_5_320/tokenizer.json");
  // The fixture has <|endoftext|> (id 320) and no <|im_end|>.
  EXPECT_EQ(end_ids({{"eos_token_id", 3}}, &tok), (std::vector<int32_t>{3, 320}));
}

TEST(GenerationPolicy, TheBudgetStaysInsideTheContext) {
  EXPECT_EQ(model_context({{"max_position_embeddings", 4096}}), 4096);
  EXPECT_EQ(model_context({{"text_config", {{"max_position_embeddings", 64}}}}), 64);
  EXPECT_EQ(model_context(nlohmann::json::object()), 0);
  EXPECT_EQ(new_token_budget(100, 0, 5000), 100);   // context unknown
  EXPECT_EQ(new_token_budget(100, 64, 10), 54);     // cut to what is left
  EXPECT_EQ(new_token_budget(10, 64, 10), 10);
  EXPECT_THROW(new_token_budget(10, 64, 64), std::invalid_argument);
}

}  // namespace
}  // namespace hs::infer
