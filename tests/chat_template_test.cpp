// The chat-template renderer against transformers' apply_chat_template (tests/chat_reference.py renders the same
// cases in .venv): every real Qwen template in data/templates (scripts/setup.sh fetches them) on >= 200 generated
// conversations each, byte for byte, and small templates for the semantics the real ones touch only in part; the
// loss masks against an independent computation (HF tokenizers' offsets and a regular expression).
#include "chat/chat_template.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "chat/conversation.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using hs::chat::ChatTemplate;
using hs::chat::RenderOptions;
using hs::chat::TemplateError;
using nlohmann::ordered_json;

namespace {

const char* kSetupHint = " (scripts/setup.sh fetches the templates into data/templates and installs the Python peers)";

fs::path source() { return hs::test::source_dir(); }

// The peer's cases, computed once per test program run.
const std::vector<ordered_json>& reference_cases() {
  static const std::vector<ordered_json> cases = [] {
    std::vector<ordered_json> out;
    const fs::path python = source() / ".venv" / "bin" / "python";
    const fs::path dir = fs::temp_directory_path() / ("hs_chat_reference_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    const fs::path file = dir / "cases.jsonl";
    const std::string cmd = "'" + python.string() + "' '" + (source() / "tests" / "chat_reference.py").string() +
                            "' '" + (source() / "data" / "templates").string() + "' '" +
                            (source() / "data" / "tokenizers").string() + "' '" + file.string() + "'";
    const auto run = hs::test::run_command(cmd);
    if (run.rc != 0) {
      ADD_FAILURE() << "the Python peer failed: " << cmd << "\n" << run.out << kSetupHint;
      return out;
    }
    std::ifstream in(file);
    for (std::string line; std::getline(in, line);) out.push_back(ordered_json::parse(line));
    fs::remove_all(dir);
    return out;
  }();
  return cases;
}

std::string shown(const std::string& s) {
  std::string o;
  for (char c : s) o += c == '\n' ? std::string("\\n\n") : std::string(1, c);
  return o;
}

// Renders a case as the peer did; `error` gets the exception's text when it throws.
std::string render_case(const ChatTemplate& t, const ordered_json& c, std::string& error) {
  RenderOptions opt;
  opt.add_generation_prompt = c["add_generation_prompt"].get<bool>();
  try {
    return t.render(c["messages"], opt, c["tools"], c["extra"]);
  } catch (const std::exception& e) {
    error = e.what();
    return {};
  }
}

const ChatTemplate& template_of(const ordered_json& c) {
  static std::map<std::string, std::unique_ptr<ChatTemplate>> cache;
  const std::string name = c["template"].get<std::string>();
  auto& slot = cache[name];
  if (!slot) {
    if (c.contains("source"))
      slot = std::make_unique<ChatTemplate>(ChatTemplate::parse(c["source"].get<std::string>(), name));
    else
      slot = std::make_unique<ChatTemplate>(ChatTemplate::load(source() / "data" / "templates" / name));
  }
  return *slot;
}

}  // namespace

TEST(ChatTemplate, RendersEveryQwenTemplateAsTransformersByteForByte) {
  const auto& cases = reference_cases();
  ASSERT_FALSE(cases.empty());
  std::map<std::string, int> rendered, raised, total;
  int failures = 0;
  for (const auto& c : cases) {
    const std::string name = c["template"].get<std::string>();
    if (name.rfind("snippet:", 0) == 0) continue;
    ++total[name];
    std::string error;
    const std::string got = render_case(template_of(c), c, error);
    if (c.contains("error")) {
      // transformers raised (e.g. Qwen3-Coder given arguments as a string): so must we, with a TemplateError.
      if (error.empty() && ++failures <= 5)
        ADD_FAILURE() << name << ": transformers raised " << c["error"] << " but hybridscan rendered\n" << shown(got);
      ++raised[name];
      continue;
    }
    const std::string want = c["rendered"].get<std::string>();
    if (!error.empty() || got != want) {
      if (++failures <= 5)
        ADD_FAILURE() << name << ": " << (error.empty() ? "differs" : "threw " + error) << "\nmessages "
                      << c["messages"].dump() << "\ntools " << c["tools"].dump() << "\nhybridscan:\n"
                      << shown(got) << "\ntransformers:\n"
                      << shown(want);
      continue;
    }
    ++rendered[name];
  }
  EXPECT_EQ(failures, 0);
  // Every Qwen*.jinja the sdist has (Qwen2.5, Qwen3-0.6B, QwQ, Qwen3-Coder, Qwen3.5-4B in llama-cpp-python 0.3.36).
  EXPECT_GE(total.size(), 5u);
  for (const auto& [name, n] : total) {
    std::cout << name << ": " << rendered[name] << " rendered equal, " << raised[name]
              << " raised as transformers does\n";
    EXPECT_GE(rendered[name], 200) << name;
  }
}

TEST(ChatTemplate, SmallTemplatesRenderAsJinja) {
  int n = 0, failures = 0;
  for (const auto& c : reference_cases()) {
    const std::string name = c["template"].get<std::string>();
    if (name.rfind("snippet:", 0) != 0) continue;
    ++n;
    std::string error;
    std::string got;
    try {
      got = render_case(template_of(c), c, error);
    } catch (const std::exception& e) {
      error = e.what();  // a parse error
    }
    if (c.contains("error")) {
      if (error.empty())
        ++failures,
            ADD_FAILURE() << name << " " << c["source"] << ": jinja2 raised " << c["error"] << ", we rendered " << got;
      continue;
    }
    if (!error.empty() || got != c["rendered"].get<std::string>())
      ++failures, ADD_FAILURE() << name << " " << c["source"]
                                << "\nhybridscan:  " << (error.empty() ? got : "threw " + error)
                                << "\ntransformers: " << c["rendered"].get<std::string>();
  }
  EXPECT_GE(n, 40);
  EXPECT_EQ(failures, 0);
}

TEST(ChatMask, CountsExactlyTheAssistantTokensAnIndependentComputationCounts) {
  std::map<std::string, std::unique_ptr<hs::tokenizer::Tokenizer>> toks;
  int checked = 0, failures = 0;
  size_t masked = 0, tokens = 0;
  for (const auto& c : reference_cases()) {
    if (!c.contains("ids")) continue;
    const std::string name = c["template"].get<std::string>();
    const std::string vocab = name.rfind("Qwen3.5", 0) == 0 ? "qwen3_5" : "qwen2";
    auto& tok = toks[vocab];
    if (!tok)
      tok = std::make_unique<hs::tokenizer::Tokenizer>(
          hs::tokenizer::Tokenizer::load((source() / "data" / "tokenizers" / vocab / "tokenizer.json").string()));
    const auto got = hs::chat::tokenize_rendered(c["rendered"].get<std::string>(), *tok, hs::chat::LossOn::Assistant);
    const auto want_ids = c["ids"].get<std::vector<int32_t>>();
    const auto want_mask = c["mask"].get<std::vector<uint8_t>>();
    ++checked;
    if (got.ids != want_ids || got.loss_mask != want_mask) {
      if (++failures <= 3) {
        std::string diff;
        for (size_t k = 0; k < std::min(got.ids.size(), want_ids.size()); ++k)
          if (got.ids[k] != want_ids[k] || got.loss_mask[k] != want_mask[k]) {
            diff = "first difference at token " + std::to_string(k) + " (" +
                   tok->token_bytes(static_cast<uint32_t>(want_ids[k])) + "): mask " +
                   std::to_string(got.loss_mask[k]) + " vs " + std::to_string(want_mask[k]);
            break;
          }
        ADD_FAILURE() << name << ": " << (got.ids != want_ids ? "ids differ; " : "") << diff << "\n"
                      << shown(c["rendered"].get<std::string>());
      }
    }
    for (auto m : got.loss_mask) masked += m;
    tokens += got.ids.size();
    const auto all = hs::chat::tokenize_rendered(c["rendered"].get<std::string>(), *tok, hs::chat::LossOn::All);
    EXPECT_EQ(all.ids, got.ids);
    EXPECT_EQ(std::count(all.loss_mask.begin(), all.loss_mask.end(), 1), static_cast<long>(all.ids.size()));
  }
  EXPECT_EQ(failures, 0);
  EXPECT_GE(checked, 500);
  // Both kinds of token occur: the test would not pass with a mask of all ones or all zeros.
  EXPECT_GT(masked, tokens / 10);
  EXPECT_LT(masked, tokens);
  std::cout << checked << " conversations, " << tokens << " tokens, " << masked << " on the loss\n";
}
