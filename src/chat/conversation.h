// Chat data for training: conversations read from JSONL, rendered with a checkpoint's chat template, tokenized, and
// the loss mask that says which tokens the loss is taken on (docs/chat.md: which tokens count under `assistant`).
#pragma once
#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "chat/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace hs::chat {

// One line of a chat file: `{"messages": [...], "tools": [...]}` (tools optional) or a bare messages array. Keys
// keep the file's order (tojson prints them in that order, as transformers does).
struct Conversation {
  nlohmann::ordered_json messages;
  nlohmann::ordered_json tools;  // null when the line has none
  size_t line = 0;               // 1-based line in the file
};

struct JsonlOptions {
  bool skip_bad_lines = false;  // count and skip malformed lines instead of throwing at the first one
};

struct JsonlResult {
  std::vector<Conversation> conversations;
  size_t bad_lines = 0;               // lines skipped (skip_bad_lines)
  std::vector<std::string> examples;  // the first few skipped lines' errors, for the report
};

// The roles a message may have: system, user, assistant, tool. Blank lines are ignored. A bad line (not JSON, not a
// conversation, a message that is not an object or has another role) throws std::runtime_error naming `name` and the
// line number, unless opt.skip_bad_lines.
JsonlResult read_conversations(std::istream& in, const std::string& name, const JsonlOptions& opt = {});
JsonlResult read_conversations(const std::filesystem::path& path, const JsonlOptions& opt = {});

enum class LossOn { Assistant, All };
LossOn parse_loss_on(const std::string& s);  // "assistant" or "all"; std::invalid_argument otherwise
const char* loss_on_name(LossOn l);

struct TokenizedConversation {
  std::vector<int32_t> ids;
  std::vector<uint8_t> loss_mask;  // 1: the loss is taken on predicting this token
};

// The ids of `rendered` (the tokenizer's encode of the whole text, special tokens recognised) and its mask. Under
// Assistant a token counts from the first one past an assistant header ("<|im_start|>" then "assistant\n") through
// the next "<|im_end|>", included; a token that straddles the header's end counts (docs/chat.md). Throws
// std::invalid_argument when the tokenizer lacks <|im_start|> or <|im_end|> (Assistant only).
TokenizedConversation tokenize_rendered(const std::string& rendered, const tokenizer::Tokenizer& tok, LossOn loss_on);

// Renders `c` with `tmpl` (no generation prompt: the conversation is complete) and tokenizes it.
TokenizedConversation tokenize_conversation(const ChatTemplate& tmpl, const tokenizer::Tokenizer& tok,
                                            const Conversation& c, LossOn loss_on,
                                            const nlohmann::json& extra = nlohmann::json::object());

}  // namespace hs::chat
