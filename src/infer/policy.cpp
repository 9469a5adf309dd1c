#include "infer/policy.h"

#include <algorithm>
#include <stdexcept>

namespace hs::infer {

namespace {
const nlohmann::json& text_config(const nlohmann::json& config) {
  return config.contains("text_config") ? config["text_config"] : config;
}
}  // namespace

int64_t model_context(const nlohmann::json& config) {
  return text_config(config).value("max_position_embeddings", int64_t{0});
}

std::vector<int32_t> end_ids(const nlohmann::json& config, const tokenizer::Tokenizer* tok) {
  std::vector<int32_t> ids;
  auto add = [&ids](int32_t id) {
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  };
  for (const nlohmann::json* j : {&config, &text_config(config)}) {
    if (!j->contains("eos_token_id")) continue;
    const nlohmann::json& e = (*j)["eos_token_id"];
    if (e.is_number_integer()) add(e.get<int32_t>());
    if (e.is_array())
      for (const auto& x : e)
        if (x.is_number_integer()) add(x.get<int32_t>());
  }
  if (tok)
    for (const char* end : {"<|im_end|>", "<|endoftext|>"})
      if (auto id = tok->token_to_id(end)) add(static_cast<int32_t>(*id));
  return ids;
}

int64_t new_token_budget(int64_t requested, int64_t context, int64_t longest_prompt) {
  if (context <= 0) return requested;
  if (longest_prompt >= context)
    throw std::invalid_argument("a prompt of " + std::to_string(longest_prompt) +
                                " tokens does not fit the model's context of " + std::to_string(context) +
                                " (max_position_embeddings)");
  return std::min(requested, context - longest_prompt);
}

}  // namespace hs::infer
