// Chat data for training (tokenize --chat, train --chat, train --eval-data FILE.jsonl): conversations read from JSONL,
// rendered with the checkpoint's chat template, tokenized with its loss mask (hs::chat, docs/chat.md), and written to
// a token file of version 2 (docs/token_format.md), one conversation a document.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "chat/conversation.h"
#include "train/data.h"

namespace hs::train {

struct ChatDataOptions {
  std::string chat;           // the JSONL file
  std::string tokenizer;      // tokenizer.json, or a directory holding one
  std::string chat_template;  // a .jinja file, a tokenizer_config.json, or a checkpoint directory that carries one
  chat::LossOn loss_on = chat::LossOn::Assistant;
  bool skip_bad_lines = false;
  // Conversations of more ids than this are dropped (counted and reported): a window of --seq + 1 tokens sees a
  // conversation of up to --seq ids whole. 0: none dropped.
  int64_t max_tokens = 0;
  int threads = 0;  // 0: all OpenMP threads
  // After every block of conversations: how many of the file's conversations are done, of how many.
  std::function<void(size_t done, size_t total, int64_t tokens)> progress;
};

struct ChatDataReport {
  size_t lines = 0;         // conversations read (bad lines not included)
  size_t written = 0;       // conversations written as documents
  size_t bad_lines = 0;     // skipped under skip_bad_lines: malformed, or refused by the template
  std::vector<std::string> bad_examples;  // the first few of their errors
  size_t dropped_long = 0;  // longer than max_tokens
  int64_t longest_dropped = 0;
  size_t without_loss = 0;  // written, but no token of theirs counts (e.g. no assistant turn under `assistant`)
  int64_t tokens = 0;       // ids written, separators included
  int64_t loss_tokens = 0;  // ids whose mask is 1 (separators included when they count)
  std::string template_origin;
  // One line for a log: counts, and what was dropped or skipped and why.
  std::string summary() const;
};

// Renders, tokenizes and writes every conversation of o.chat to `out` (atomically: nothing at `out` unless all went
// well). Under LossOn::Assistant the separator between two conversations is not predicted (mask 0): the loss is on
// the assistant turns alone; under All every token counts, separators too. Throws std::runtime_error /
// std::invalid_argument naming the file and line of a bad conversation (unless skip_bad_lines), a missing template
// ("no chat template ... pass --chat-template"), or a file in which no conversation is left.
ChatDataReport write_chat_tokens(const ChatDataOptions& o, const std::filesystem::path& out);

// The same in memory for train --chat / --eval-data FILE.jsonl: written to a temporary token file (in
// std::filesystem::temp_directory_path()), memory-mapped and checked against the model, then unlinked (the mapping
// stays). `report`, when given, receives the counts.
Tokens load_chat_tokens(const ChatDataOptions& o, const ModelVocabulary& model, ChatDataReport* report = nullptr);

// Whether `path` names a chat file (its extension is .jsonl).
bool is_chat_file(const std::string& path);

}  // namespace hs::train
