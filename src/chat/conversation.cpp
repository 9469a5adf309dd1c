#include "chat/conversation.h"

#include <fstream>
#include <istream>
#include <stdexcept>

namespace hs::chat {

namespace {

std::string check_conversation(const nlohmann::ordered_json& j, Conversation& c) {
  const nlohmann::ordered_json* messages = &j;
  if (j.is_object()) {
    if (!j.contains("messages")) return "an object without \"messages\"";
    messages = &j["messages"];
    if (j.contains("tools") && !j["tools"].is_null()) {
      if (!j["tools"].is_array()) return "\"tools\" is not an array";
      c.tools = j["tools"];
    }
  } else if (!j.is_array()) {
    return "neither an object with \"messages\" nor an array of messages";
  }
  if (!messages->is_array()) return "\"messages\" is not an array";
  if (messages->empty()) return "no messages";
  for (size_t k = 0; k < messages->size(); ++k) {
    const auto& m = (*messages)[k];
    const std::string which = "message " + std::to_string(k + 1);
    if (!m.is_object()) return which + " is not an object";
    if (!m.contains("role") || !m["role"].is_string()) return which + " has no \"role\" string";
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      return which + " has role \"" + role + "\" (the roles are system, user, assistant and tool)";
    if (m.contains("content") && !m["content"].is_null() && !m["content"].is_string() && !m["content"].is_array())
      return which + "'s content is neither a string, an array of parts nor null";
  }
  c.messages = *messages;
  return {};
}

}  // namespace

JsonlResult read_conversations(std::istream& in, const std::string& name, const JsonlOptions& opt) {
  JsonlResult r;
  std::string text;
  for (size_t line = 1; std::getline(in, text); ++line) {
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (line == 1 && text.rfind("\xEF\xBB\xBF", 0) == 0) text.erase(0, 3);  // a UTF-8 byte-order mark
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    Conversation c;
    c.line = line;
    std::string err;
    try {
      err = check_conversation(nlohmann::ordered_json::parse(text), c);
    } catch (const nlohmann::json::parse_error& e) {
      err = std::string("not valid JSON (") + e.what() + ")";
    }
    if (err.empty()) {
      r.conversations.push_back(std::move(c));
      continue;
    }
    const std::string msg = name + ":" + std::to_string(line) + ": " + err;
    if (!opt.skip_bad_lines) throw std::runtime_error(msg + " (--skip-bad-lines skips such lines and counts them)");
    ++r.bad_lines;
    if (r.examples.size() < 5) r.examples.push_back(msg);
  }
  return r;
}

JsonlResult read_conversations(const std::filesystem::path& path, const JsonlOptions& opt) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  return read_conversations(in, path.string(), opt);
}

LossOn parse_loss_on(const std::string& s) {
  if (s == "assistant") return LossOn::Assistant;
  if (s == "all") return LossOn::All;
  throw std::invalid_argument("the loss is on 'assistant' or 'all', not '" + s + "'");
}

const char* loss_on_name(LossOn l) { return l == LossOn::Assistant ? "assistant" : "all"; }

TokenizedConversation tokenize_rendered(const std::string& rendered, const tokenizer::Tokenizer& tok, LossOn loss_on) {
  TokenizedConversation out;
  const auto ids = tok.encode(rendered);
  out.ids.assign(ids.begin(), ids.end());
  out.loss_mask.assign(ids.size(), loss_on == LossOn::All ? 1 : 0);
  if (loss_on == LossOn::All) return out;
  const auto start = tok.token_to_id("<|im_start|>"), end = tok.token_to_id("<|im_end|>");
  if (!start || !end)
    throw std::invalid_argument("the loss on assistant turns needs a tokenizer with <|im_start|> and <|im_end|>");
  // The header's text after <|im_start|>: the role, then the newline the Qwen templates write after it. Tokens that
  // lie wholly inside it are the header; the first token reaching past it starts the turn. These bytes are ASCII, so
  // the tokens' bytes are the text's (no normalisation can change them).
  static const std::string kHeader = "assistant\n";
  enum { Outside, Header, Inside } state = Outside;
  std::string seen;  // Header: the bytes after <|im_start|> so far
  for (size_t k = 0; k < ids.size(); ++k) {
    const auto id = ids[k];
    if (state == Inside) {
      out.loss_mask[k] = 1;
      if (id == *end) state = Outside;
      continue;
    }
    if (id == *start) {
      state = Header;
      seen.clear();
      continue;
    }
    if (state != Header) continue;
    if (tok.is_special(id)) {  // a special token straight after the header starts the turn
      if (seen == kHeader) {
        out.loss_mask[k] = 1;
        state = id == *end ? Outside : Inside;
      } else {
        state = Outside;
      }
      continue;
    }
    seen += tok.token_bytes(id);
    const size_t common = std::min(seen.size(), kHeader.size());
    if (seen.compare(0, common, kHeader, 0, common) != 0) {
      state = Outside;  // another role
    } else if (seen.size() > kHeader.size()) {
      out.loss_mask[k] = 1;  // the first token reaching past the header
      state = Inside;
    }
  }
  return out;
}

TokenizedConversation tokenize_conversation(const ChatTemplate& tmpl, const tokenizer::Tokenizer& tok,
                                            const Conversation& c, LossOn loss_on, const nlohmann::json& extra) {
  RenderOptions opt;
  opt.extra = extra;
  return tokenize_rendered(tmpl.render(c.messages, opt, c.tools), tok, loss_on);
}

}  // namespace hs::chat
