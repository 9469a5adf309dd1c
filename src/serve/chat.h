// How the server turns chat messages into a prompt. To be replaced by hs::chat::ChatTemplate (the checkpoint's own
// Jinja chat template, src/chat/) when that lands: this one function is the only place that renders chat.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace hs::serve {

// messages: [{role, content (a string)}]. The Qwen im_start / im_end format (as infer::chat_user_turn writes one user
// turn), ending with the assistant's opening when add_generation_prompt.
std::string render_chat(const nlohmann::json& messages, bool add_generation_prompt = true);

}  // namespace hs::serve
