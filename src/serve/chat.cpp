#include "serve/chat.h"

namespace hs::serve {

std::string render_chat(const nlohmann::json& messages, bool add_generation_prompt) {
  std::string out;
  for (const auto& m : messages)
    out += "<|im_start|>" + m.at("role").get<std::string>() + "\n" + m.at("content").get<std::string>() +
           "<|im_end|>\n";
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace hs::serve
