// Generation's policy, the same for every front end (`generate` today, a server later): what ends a sequence and how
// many new tokens fit the model's context. (Chat prompts: the checkpoint's template, src/chat.)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"

namespace hs::infer {

// The model's context from config.json (max_position_embeddings, at the top or in text_config); 0 when absent.
int64_t model_context(const nlohmann::json& config);

// The ids that end a sequence: config.json's eos_token_id (one id or a list, at the top or in text_config) and, where
// the tokenizer has them, <|im_end|> and <|endoftext|>; each once.
std::vector<int32_t> end_ids(const nlohmann::json& config, const tokenizer::Tokenizer* tok);

// The new tokens a request may have: `requested`, cut to what the model's context (0: unknown) leaves after the
// longest prompt. Throws std::invalid_argument when that prompt alone fills the context.
int64_t new_token_budget(int64_t requested, int64_t context, int64_t longest_prompt);

}  // namespace hs::infer
