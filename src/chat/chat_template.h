// A checkpoint's chat template, rendered as transformers' apply_chat_template renders it (docs/chat.md): the same
// bytes for the same messages, tools and variables.
#pragma once
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "chat/jinja.h"

namespace hs::chat {

struct RenderOptions {
  bool add_generation_prompt = false;
  nlohmann::json tools;                             // null, or the OpenAI tools array
  nlohmann::json extra = nlohmann::json::object();  // other template variables (enable_thinking, ...)
};

class ChatTemplate {
 public:
  // A checkpoint directory (chat_template.jinja, else tokenizer_config.json's "chat_template": a string, or a list of
  // {name, template} where "default" is taken), a tokenizer_config.json (any .json file) or a .jinja file. Throws
  // std::runtime_error saying what is missing, TemplateError when the template uses what this renderer does not
  // implement.
  static ChatTemplate load(const std::filesystem::path& path);
  static ChatTemplate parse(std::string source, std::string origin);  // throws TemplateError

  // messages: the OpenAI messages array. Throws std::invalid_argument for messages that are not an array of objects
  // (or an empty one), TemplateError for what the template raises. bos_token / eos_token are those of the
  // checkpoint's tokenizer_config.json when it has them.
  std::string render(const nlohmann::json& messages, const RenderOptions& opt = {}) const;
  // The same with JSON whose key order is kept (tojson prints keys in the order the request or file gave them, as
  // Python does; nlohmann::json sorts them). `tools` and `extra`, when not null, stand for opt.tools and opt.extra.
  std::string render(const nlohmann::ordered_json& messages, const RenderOptions& opt = {},
                     const nlohmann::ordered_json& tools = nullptr,
                     const nlohmann::ordered_json& extra = nullptr) const;

  const std::string& source() const { return source_; }
  const std::string& origin() const { return origin_; }
  const std::optional<std::string>& bos_token() const { return bos_; }
  const std::optional<std::string>& eos_token() const { return eos_; }
  void set_special_tokens(std::optional<std::string> bos, std::optional<std::string> eos);

 private:
  std::string render_values(const Value& messages, const Value& tools, const Value& extra,
                            bool add_generation_prompt) const;
  std::string source_, origin_;
  std::shared_ptr<const Program> program_;
  std::optional<std::string> bos_, eos_;
};

}  // namespace hs::chat
