// train::write_chat_tokens (tokenize --chat, train --chat): one document per conversation with its loss mask, the
// separators out of the loss under --loss-on assistant, long conversations dropped and counted, bad lines numbered
// (or counted), and no file left behind by an error. With the real Qwen3.5 tokenizer and template (scripts/setup.sh).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "chat/chat_template.h"
#include "chat/conversation.h"
#include "dataset/token_file.h"
#include "test_util.h"
#include "train/chat_data.h"

namespace fs = std::filesystem;
using namespace hs;

namespace {

struct Fixture {
  fs::path dir, tokenizer, tmpl;
};

// Skips the test (returns false) when scripts/setup.sh has not fetched the tokenizer and template.
bool fixture(Fixture& f, const std::string& name) {
  f.tokenizer = fs::path(test::source_dir()) / "data/tokenizers/qwen3_5/tokenizer.json";
  f.tmpl = fs::path(test::source_dir()) / "data/templates/Qwen3.5-4B.jinja";
  if (!fs::exists(f.tokenizer) || !fs::exists(f.tmpl)) return false;
  f.dir = fs::temp_directory_path() / ("hs_chat_tokens_" + name);
  fs::remove_all(f.dir);
  fs::create_directories(f.dir);
  return true;
}

const char* kLines[] = {
    R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 日本語"}]})",
    R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6, which is a longer answer than the first one by some words"}]})",
    R"([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])",
};

void write_lines(const fs::path& p, const std::vector<std::string>& lines) {
  std::ofstream f(p);
  for (const auto& l : lines) f << l << "\n";
}

train::ChatDataOptions options(const Fixture& f, const fs::path& chat) {
  train::ChatDataOptions o;
  o.chat = chat.string();
  o.tokenizer = f.tokenizer.string();
  o.chat_template = f.tmpl.string();
  o.threads = 2;
  return o;
}

}  // namespace

TEST(ChatTokens, OneDocumentPerConversationWithItsMaskAndTheSeparatorsOutOfTheLoss) {
  Fixture f;
  if (!fixture(f, "docs")) GTEST_SKIP() << "scripts/setup.sh fetches data/tokenizers and data/templates";
  write_lines(f.dir / "c.jsonl", {kLines[0], kLines[1], kLines[2]});
  const auto tok = tokenizer::Tokenizer::load(f.tokenizer);
  const auto tmpl = chat::ChatTemplate::load(f.tmpl);
  const auto convs = chat::read_conversations(f.dir / "c.jsonl").conversations;
  for (const chat::LossOn loss_on : {chat::LossOn::Assistant, chat::LossOn::All}) {
    train::ChatDataOptions o = options(f, f.dir / "c.jsonl");
    o.loss_on = loss_on;
    const train::ChatDataReport r = train::write_chat_tokens(o, f.dir / "c.tok");
    // What the file must hold: each conversation's ids and mask, an end-of-text separator between them whose mask
    // byte is 0 under `assistant` (the loss on the assistant turns alone) and 1 under `all`.
    std::vector<int32_t> ids;
    std::vector<uint8_t> mask;
    int64_t loss = 0;
    for (size_t i = 0; i < convs.size(); ++i) {
      const chat::TokenizedConversation t = chat::tokenize_conversation(tmpl, tok, convs[i], loss_on);
      if (i) {
        ids.push_back(static_cast<int32_t>(*tok.end_of_text_id()));
        mask.push_back(loss_on == chat::LossOn::All ? 1 : 0);
      }
      ids.insert(ids.end(), t.ids.begin(), t.ids.end());
      mask.insert(mask.end(), t.loss_mask.begin(), t.loss_mask.end());
    }
    for (uint8_t m : mask) loss += m;
    const auto file = dataset::TokenFile::open(f.dir / "c.tok");
    ASSERT_TRUE(file->has_mask());
    EXPECT_EQ(file->header().documents, 3);
    ASSERT_EQ(file->size(), static_cast<int64_t>(ids.size()));
    std::vector<int32_t> got(ids.size());
    std::vector<uint8_t> got_mask(ids.size());
    file->read(0, file->size(), got.data());
    file->read_mask(0, file->size(), got_mask.data());
    EXPECT_EQ(got, ids);
    EXPECT_EQ(got_mask, mask);
    EXPECT_EQ(r.written, 3u);
    EXPECT_EQ(r.tokens, file->size());
    EXPECT_EQ(r.loss_tokens, loss);
    if (loss_on == chat::LossOn::Assistant) EXPECT_LT(loss, file->size() / 2);  // the masks do mask
    else EXPECT_EQ(loss, file->size());
  }
}

TEST(ChatTokens, LongConversationsAreDroppedAndCounted) {
  Fixture f;
  if (!fixture(f, "long")) GTEST_SKIP() << "scripts/setup.sh fetches data/tokenizers and data/templates";
  write_lines(f.dir / "c.jsonl", {kLines[0], kLines[1], kLines[2]});
  const auto tok = tokenizer::Tokenizer::load(f.tokenizer);
  const auto tmpl = chat::ChatTemplate::load(f.tmpl);
  const auto convs = chat::read_conversations(f.dir / "c.jsonl").conversations;
  const int64_t longest = static_cast<int64_t>(chat::tokenize_conversation(tmpl, tok, convs[1], chat::LossOn::All).ids.size());
  train::ChatDataOptions o = options(f, f.dir / "c.jsonl");
  o.max_tokens = longest - 1;
  train::ChatDataReport r = train::write_chat_tokens(o, f.dir / "c.tok");
  EXPECT_EQ(r.written, 2u);
  EXPECT_EQ(r.dropped_long, 1u);
  EXPECT_EQ(r.longest_dropped, longest);
  EXPECT_NE(r.summary().find("1 dropped as longer than the window (the longest " + std::to_string(longest)),
            std::string::npos) << r.summary();
  EXPECT_EQ(dataset::TokenFile::open(f.dir / "c.tok")->header().documents, 2);
  o.max_tokens = longest;  // a conversation of exactly max_tokens is kept
  EXPECT_EQ(train::write_chat_tokens(o, f.dir / "c.tok").dropped_long, 0u);
  // Nothing left: an error, and no file.
  o.max_tokens = 3;
  EXPECT_NE(test::error_of([&] { train::write_chat_tokens(o, f.dir / "none.tok"); }).find("no conversation left"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(f.dir / "none.tok"));
}

TEST(ChatTokens, BadLinesAreNumberedOrCountedAndLeaveNoFile) {
  Fixture f;
  if (!fixture(f, "bad")) GTEST_SKIP() << "scripts/setup.sh fetches data/tokenizers and data/templates";
  write_lines(f.dir / "c.jsonl", {kLines[0], R"({"messages": [{"role": "robot", "content": "x"}]})", "{not json", kLines[2]});
  train::ChatDataOptions o = options(f, f.dir / "c.jsonl");
  const std::string e = test::error_of([&] { train::write_chat_tokens(o, f.dir / "c.tok"); });
  EXPECT_NE(e.find("c.jsonl:2"), std::string::npos) << e;
  EXPECT_NE(e.find("robot"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(f.dir / "c.tok"));
  o.skip_bad_lines = true;
  const train::ChatDataReport r = train::write_chat_tokens(o, f.dir / "c.tok");
  EXPECT_EQ(r.bad_lines, 2u);
  EXPECT_EQ(r.written, 2u);
  EXPECT_NE(r.summary().find("2 bad lines skipped"), std::string::npos) << r.summary();
  // A directory without a template, and no template at all.
  o.chat_template = f.dir.string();
  EXPECT_NE(test::error_of([&] { train::write_chat_tokens(o, f.dir / "t.tok"); }).find("chat template"), std::string::npos);
  o.chat_template.clear();
  EXPECT_NE(test::error_of([&] { train::write_chat_tokens(o, f.dir / "t.tok"); }).find("--chat-template"), std::string::npos);
  EXPECT_FALSE(fs::exists(f.dir / "t.tok"));
}
