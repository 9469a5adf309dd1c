// How the server turns chat messages into a prompt: the checkpoint's own chat template (or serve --chat-template
// FILE), rendered by src/chat as transformers' apply_chat_template renders it, the same renderer as generate --chat
// and train --chat.
#pragma once
#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"

namespace hs::serve {

class ChatFormat {
 public:
  // `template_file` (a .jinja file or a directory holding one; empty: none) or else the checkpoint's own template.
  // Without either the server still serves completions, and answers chat requests with 400 saying why. A template
  // that is there but uses what the renderer does not implement stops the server at start (chat::TemplateError).
  ChatFormat(const std::filesystem::path& checkpoint, const std::filesystem::path& template_file);
  bool available() const { return template_.has_value(); }
  const std::string& origin() const;  // where the template came from ("" when none)
  // messages: [{role, content, ...}] as the request gave them. Throws ApiError (400) when there is no template or the
  // template raises for these messages (e.g. a role it does not accept).
  std::string render(const nlohmann::json& messages, bool add_generation_prompt) const;

 private:
  std::optional<chat::ChatTemplate> template_;
  std::string missing_;  // why there is none
};

}  // namespace hs::serve
