// What the chat renderer refuses (every construct it does not implement, named with its line), where a checkpoint's
// template is found, and the JSONL reader of conversations (bad lines numbered, unknown roles, skipping).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "chat/chat_template.h"
#include "chat/conversation.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace hs::chat;

namespace {

// The TemplateError's text, from parsing or (if parsing passes) rendering one user message.
std::string refusal(const std::string& source) {
  try {
    ChatTemplate t = ChatTemplate::parse(source, "t.jinja");
    t.render(nlohmann::json::array({{{"role", "user"}, {"content", "hi"}}}));
  } catch (const TemplateError& e) {
    return e.what();
  }
  return "(no TemplateError)";
}

void write(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

}  // namespace

TEST(ChatTemplateRefusal, EveryUnimplementedConstructIsNamedWithItsLine) {
  const std::pair<const char*, const char*> cases[] = {
      {"{% raw %}x{% endraw %}", "the 'raw' tag"},
      {"{% macro m() %}{% endmacro %}{% call m() %}x{% endcall %}", "the 'call' tag"},
      {"{% filter upper %}x{% endfilter %}", "the 'filter' tag"},
      {"{% include 'other.jinja' %}", "the 'include' tag"},
      {"{% import 'm.jinja' as m %}", "the 'import' tag"},
      {"{% extends 'base.jinja' %}", "the 'extends' tag"},
      {"{% block b %}{% endblock %}", "the 'block' tag"},
      {"{% with a = 1 %}{% endwith %}", "the 'with' tag"},
      {"{% set x %}body{% endset %}", "the block form of 'set'"},
      {"{% set a, b = 1, 2 %}", "'set' with several targets"},
      {"{% frobnicate %}", "the block tag 'frobnicate'"},
      {"{{ messages | map(attribute='role') | list }}", "the filter 'map'"},
      {"{{ messages | selectattr('role') }}", "the filter 'selectattr'"},
      {"{{ x is escaped }}", "the test 'escaped'"},
      {"{% for m in messages recursive %}{% endfor %}", "the recursive for loop"},
      {"{{ 'a {}'.format(1) }}", "the string method 'format'"},
      {"{{ 'a'.splitlines() }}", "the string method 'splitlines'"},
      {"{{ messages.append(1) }}", "the list method 'append'"},
      {"{{ messages[0].update({}) }}", "the dict method 'update'"},
      {"{{ '%s' % 1 }}", "string formatting with '%'"},
      {"{{ cycler('a', 'b') }}", "the function 'cycler'"},
      {"{{ 'É'.lower() }}", "str.lower() of non-ASCII text"},
      {"{{ messages | tojson(ensure_ascii=true) }}", "tojson(ensure_ascii=true)"},
      {"{{ f(*messages) }}", "'*args' / '**kwargs' in a call"},
      {"{% for m in messages %}{{ loop.cycle('a', 'b') }}{% endfor %}", "loop.cycle()"},
      {"{% for m in messages %}{{ loop.changed(m) }}{% endfor %}", "loop.changed()"},
      {"{% macro m() %}{{ varargs }}{% endmacro %}", "the special variable 'varargs'"},
      {"{% macro m() %}{{ caller() }}{% endmacro %}", "the special variable 'caller'"},
  };
  for (const auto& [src, name] : cases) {
    // The construct sits on the template's third line, behind two lines of text.
    const std::string msg = refusal(std::string("line one\nline two\n") + src);
    EXPECT_NE(msg.find(name), std::string::npos) << src << " -> " << msg;
    EXPECT_NE(msg.find("t.jinja, line 3:"), std::string::npos) << src << " -> " << msg;
    EXPECT_NE(msg.find("not implemented"), std::string::npos) << src << " -> " << msg;
  }
}

TEST(ChatTemplateRefusal, SyntaxAndRuntimeErrorsNameTheLine) {
  EXPECT_NE(refusal("a\n{% if true %}x").find("line 2"), std::string::npos);  // unclosed block (reported at the end)
  EXPECT_NE(refusal("{{ 1 +\n}}").find("line 2"), std::string::npos);
  const std::string raised = refusal("\n\n\n{{ raise_exception('No user query found.') }}");
  EXPECT_NE(raised.find("line 4"), std::string::npos) << raised;
  EXPECT_NE(raised.find("No user query found."), std::string::npos) << raised;
  const std::string undefined = refusal("{{ messages[0].nothing + 'x' }}");
  EXPECT_NE(undefined.find("has no attribute 'nothing'"), std::string::npos) << undefined;
  EXPECT_THROW(ChatTemplate::parse("{{ 'unclosed }}", "t"), TemplateError);
  EXPECT_THROW(ChatTemplate::parse("{{ x", "t"), TemplateError);
  EXPECT_THROW(ChatTemplate::parse("{% for %}", "t"), TemplateError);
  // Bounded depth: no input exhausts the stack.
  EXPECT_NE(refusal("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}").find("nested deeper"),
            std::string::npos);
  std::string ifs;
  for (int k = 0; k < 5000; ++k) ifs += "{% if true %}";
  EXPECT_NE(refusal(ifs).find("nested deeper"), std::string::npos);
  EXPECT_NE(refusal("{{ " + std::string(100000, '-') + "1 }}").find("nested deeper"), std::string::npos);
  EXPECT_NE(refusal("{{ " + std::string(100000, '[') + " }}").find("nested deeper"), std::string::npos);
  const std::string recursion = refusal("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}\n{{ m(0) }}");
  EXPECT_NE(recursion.find("maximum recursion depth exceeded in macro 'm'"), std::string::npos) << recursion;
  // Past what 64-bit ints and memory hold: refused, where Python would go on (big ints) or run out of memory.
  EXPECT_NE(refusal("{{ 9223372036854775807 + 1 }}").find("beyond 64 bits"), std::string::npos);
  EXPECT_NE(refusal("{{ 2 ** 64 }}").find("beyond 64 bits"), std::string::npos);
  EXPECT_NE(refusal("{{ 99999999999999999999 }}").find("beyond 64 bits"), std::string::npos);
  EXPECT_NE(refusal("{{ 'ab' * 1000000000000 }}").find("repetition"), std::string::npos);
  EXPECT_EQ(ChatTemplate::parse("{{ 3 ** 39 }} {{ (-2) ** 63 }} {{ 1 ** 1000000000000 }}", "t")
                .render(nlohmann::json::array({{{"role", "user"}}})),
            "4052555153018976267 -9223372036854775808 1");
  // Nothing in random bytes crashes the parser: each either parses or is refused with a TemplateError.
  std::mt19937 rng(7);
  const std::string alphabet = "{}%#-+()[]'\".,:|~ abcifnotdefsendforinmacro=<>!*/0123456789\n\t\\";
  for (int k = 0; k < 3000; ++k) {
    std::string src;
    for (int n = static_cast<int>(rng() % 40); n > 0; --n) src += alphabet[rng() % alphabet.size()];
    try {
      ChatTemplate::parse(src, "fuzz").render(nlohmann::json::array({{{"role", "user"}, {"content", "hi"}}}));
    } catch (const TemplateError&) {
    } catch (const std::invalid_argument&) {
    }
  }
}

TEST(ChatTemplateLoad, FindsTheTemplateOfACheckpointDirectory) {
  hs::test::TempDir dir;
  const fs::path d = dir.path();
  const auto msgs = nlohmann::json::array({{{"role", "user"}, {"content", "hi"}}});
  // No template at all: a sentence naming what is missing.
  try {
    ChatTemplate::load(d);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("chat_template.jinja"), std::string::npos) << e.what();
  }
  // tokenizer_config.json's string, with its special tokens as variables.
  write(d / "tokenizer_config.json",
        R"({"chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}", "bos_token": null,
            "eos_token": {"content": "<|im_end|>", "special": true}})");
  EXPECT_EQ(ChatTemplate::load(d).render(msgs), "hi<|im_end|>");
  // A list of named templates: "default" is taken.
  write(d / "tokenizer_config.json",
        R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ 1 }}"}]})");
  EXPECT_EQ(ChatTemplate::load(d).render(msgs), "D1");
  EXPECT_EQ(ChatTemplate::load(d / "tokenizer_config.json").render(msgs), "D1");
  write(d / "tokenizer_config.json", R"({"chat_template": [{"name": "tool_use", "template": "T"}]})");
  EXPECT_THROW(ChatTemplate::load(d), std::runtime_error);
  // chat_template.jinja wins over tokenizer_config.json.
  write(d / "chat_template.jinja", "J{{ messages | length }}\n");
  EXPECT_EQ(ChatTemplate::load(d).render(msgs), "J1");
  EXPECT_EQ(ChatTemplate::load(d / "chat_template.jinja").render(msgs), "J1");
  EXPECT_THROW(ChatTemplate::load(d / "absent.jinja"), std::runtime_error);
  // Bad messages: clear errors, not crashes.
  const ChatTemplate t = ChatTemplate::parse("{{ messages[0].content }}", "t");
  EXPECT_THROW(t.render(nlohmann::json::array()), std::invalid_argument);
  EXPECT_THROW(t.render(nlohmann::json::array({1})), std::invalid_argument);
  EXPECT_THROW(t.render(nlohmann::json::object()), std::invalid_argument);
  RenderOptions bad;
  bad.extra = {{"messages", 1}};
  EXPECT_THROW(t.render(msgs, bad), std::invalid_argument);
}

TEST(ChatJsonl, ReadsConversationsAndNumbersBadLines) {
  const std::string good1 =
      R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})";
  const std::string good2 = R"([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}])";
  const std::string tools = R"({"messages": [{"role": "user", "content": "x"}], )"
                            R"("tools": [{"type": "function", "function": {"name": "f", "z": 1, "a": 2}}]})";
  {
    std::istringstream in("\xEF\xBB\xBF" + good1 + "\n\n" + good2 + "\r\n" + tools + "\n");
    const auto r = read_conversations(in, "chat.jsonl");
    ASSERT_EQ(r.conversations.size(), 3u);
    EXPECT_EQ(r.conversations[1].line, 3u);
    EXPECT_EQ(r.conversations[1].messages.size(), 2u);
    EXPECT_EQ(r.conversations[2].tools[0]["function"].dump(), R"({"name":"f","z":1,"a":2})");  // the file's order
  }
  const std::pair<std::string, std::string> bad[] = {
      {"{not json", "not valid JSON"},
      {R"({"messages": [{"role": "robot", "content": "x"}]})", "role \"robot\""},
      {R"({"messages": [{"role": "developer", "content": "x"}]})", "role \"developer\""},
      {R"({"messages": []})", "no messages"},
      {R"({"conversation": []})", "without \"messages\""},
      {R"({"messages": [{"content": "x"}]})", "no \"role\""},
      {R"({"messages": ["hi"]})", "message 1 is not an object"},
      {R"({"messages": [{"role": "user", "content": 5}]})", "content is neither"},
      {R"(42)", "neither an object"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": {}})", "\"tools\" is not an array"},
  };
  for (const auto& [line, why] : bad) {
    std::istringstream in(good1 + "\n" + good2 + "\n" + line + "\n" + good1 + "\n");
    try {
      read_conversations(in, "chat.jsonl");
      ADD_FAILURE() << "accepted " << line;
    } catch (const std::runtime_error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("chat.jsonl:3: "), std::string::npos) << msg;
      EXPECT_NE(msg.find(why), std::string::npos) << msg;
    }
    std::istringstream again(good1 + "\n" + line + "\n" + good2 + "\n" + line + "\n");
    const auto r = read_conversations(again, "chat.jsonl", {.skip_bad_lines = true});
    EXPECT_EQ(r.conversations.size(), 2u);
    EXPECT_EQ(r.bad_lines, 2u);
    ASSERT_EQ(r.examples.size(), 2u);
    EXPECT_NE(r.examples[1].find("chat.jsonl:4: "), std::string::npos) << r.examples[1];
  }
  EXPECT_THROW(read_conversations(fs::path("/nonexistent/chat.jsonl")), std::runtime_error);
  EXPECT_EQ(parse_loss_on("assistant"), LossOn::Assistant);
  EXPECT_EQ(parse_loss_on("all"), LossOn::All);
  EXPECT_THROW(parse_loss_on("user"), std::invalid_argument);
}
