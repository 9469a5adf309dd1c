#include "serve/chat.h"

#include <stdexcept>

#include "serve/request.h"

namespace hs::serve {

ChatFormat::ChatFormat(const std::filesystem::path& checkpoint, const std::filesystem::path& template_file) {
  if (!template_file.empty()) {
    template_ = chat::ChatTemplate::load(template_file);  // asked for by name: any failure stops the server
    return;
  }
  try {
    template_ = chat::ChatTemplate::load(checkpoint);
  } catch (const chat::TemplateError&) {
    throw;
  } catch (const std::runtime_error& e) {
    missing_ = e.what();
  }
}

const std::string& ChatFormat::origin() const {
  static const std::string none;
  return template_ ? template_->origin() : none;
}

std::string ChatFormat::render(const nlohmann::json& messages, bool add_generation_prompt) const {
  if (!template_)
    throw ApiError(400,
                   "this server has no chat template (" + missing_ +
                       "): use /v1/completions, or restart serve with --chat-template FILE",
                   "messages");
  chat::RenderOptions o;
  o.add_generation_prompt = add_generation_prompt;
  try {
    return template_->render(messages, o);
  } catch (const chat::TemplateError& e) {
    throw ApiError(400, std::string("the chat template refused these messages: ") + e.what(), "messages");
  } catch (const std::invalid_argument& e) {
    throw ApiError(400, e.what(), "messages");
  }
}

}  // namespace hs::serve
