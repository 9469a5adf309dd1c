// `hybridscan generate` end to end on a random checkpoint of the parity fixtures (vocabulary 256: text is bytes).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "checkpoint/hf_io.h"
#include "infer/generate.h"
#include "tokenizer/tokenizer.h"
#include "test_util.h"

namespace hs {
namespace {

const std::string kCase = hs::test::source_dir() + "/tests/fixtures/parity/qwen3_next_L5";

struct Outcome {
  int status;
  std::string out, err;
};
// env: a prefix for the command (`env -u VAR NAME=value`), empty for the test's own environment.
Outcome run(const std::string& args, const std::string& env = "") {
  test::TempDir dir;
  const std::string cmd = env + (env.empty() ? "" : " ") + hs::test::binary() + " generate " + args + " >" +
                          (dir / "out").string() + " 2>" + (dir / "err").string();
  const int status = std::system(cmd.c_str());
  auto slurp = [&](const char* n) {
    const auto b = test::read_bytes(dir / n);
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  };
  return {status, slurp("out"), slurp("err")};
}

nlohmann::json last_line(const std::string& out) {
  const size_t end = out.find_last_not_of('\n');
  const size_t start = out.rfind('\n', end);
  return nlohmann::json::parse(out.substr(start == std::string::npos ? 0 : start + 1, end - start));
}

// Greedy ids through the command equal the library's (which decode_test holds to transformers), the streamed text
// is their bytes, and the JSON line carries the figures.
TEST(GenerateCli, GreedyIdsMatchTheLibraryAndJsonEndsTheOutput) {
  const Outcome r = run("--checkpoint " + kCase + " --prompt 'In the beginning' --max-new-tokens 12 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = last_line(r.out);
  MemoryAccountant mem;
  model::ParamSet ps(model::load_config(kCase), DType::F32, mem, MemCategory::Parameters, false);
  checkpoint::load_hf_params(checkpoint::CheckpointReader(kCase + "/model.safetensors"), ps);
  const std::string prompt = "In the beginning";
  infer::GenerateOptions opt;
  opt.max_new_tokens = 12;
  const auto want = infer::generate(ps, {std::vector<int32_t>(prompt.begin(), prompt.end())}, opt, mem).tokens[0];
  EXPECT_EQ(j["tokens"][0].get<std::vector<int32_t>>(), want);
  std::string bytes(want.begin(), want.end());
  EXPECT_EQ(r.out.substr(0, bytes.size()), bytes);
  EXPECT_GT(j["prefill_tokens_per_s"].get<double>(), 0);
  EXPECT_GT(j["decode_tokens_per_s"].get<double>(), 0);
  EXPECT_GT(j["peak_rss_bytes"].get<double>(), 1e6);
  EXPECT_NE(r.err.find("decode 11 tokens"), std::string::npos) << r.err;
}

// How idle threads wait (src/cli/main.cpp, core/cpu_load.h), as --json reports it: a policy the user set is kept; with
// none set one is chosen at start (this test's runner sets OMP_WAIT_POLICY, so it is unset here); threads that
// outnumber the processors (an MPI launch's many local ranks, one thread each) sleep at once whatever the load.
TEST(GenerateCli, ThreadWaitIsTheUsersOrChosenFromTheLoad) {
  const std::string args = "--checkpoint " + kCase + " --prompt-ids 5,6,7 --max-new-tokens 2 --threads 1 --json";
  const std::string unset = "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT";
  auto wait = [&](const std::string& env) {
    const Outcome r = run(args, env);
    EXPECT_EQ(r.status, 0) << r.err;
    return r.status == 0 ? last_line(r.out)["thread_wait"].get<std::string>() : std::string();
  };
  EXPECT_EQ(wait(unset + " OMP_WAIT_POLICY=active"), "active");
  EXPECT_EQ(wait(unset + " GOMP_SPINCOUNT=777"), "spin 777");
  EXPECT_EQ(wait(unset + " OMPI_COMM_WORLD_LOCAL_SIZE=100000"), "passive");
  const std::string chosen = wait(unset);
  EXPECT_TRUE(chosen == "passive" || chosen == "spin 30000") << chosen;
}

// A seed reproduces a sampled run; several prompts from a file each get their tokens; a stop string ends a sequence
// with its text cut before it.
TEST(GenerateCli, SeedsPromptFilesAndStopStrings) {
  const std::string base = "--checkpoint " + kCase + " --max-new-tokens 10 --temperature 0.9 --top-k 50 --json ";
  const Outcome a = run(base + "--prompt-ids 5,6,7 --seed 4"), b = run(base + "--prompt-ids 5,6,7 --seed 4");
  ASSERT_EQ(a.status, 0) << a.err;
  EXPECT_EQ(last_line(a.out)["tokens"], last_line(b.out)["tokens"]);
  test::TempDir dir;
  std::ofstream(dir / "prompts") << "first prompt\nthe second, longer prompt\n";
  const Outcome f = run(base + "--prompts " + (dir / "prompts").string());
  ASSERT_EQ(f.status, 0) << f.err;
  EXPECT_EQ(last_line(f.out)["tokens"].size(), 2u);
  // A letter or digit of the greedy text as a stop string: the text ends before its first occurrence.
  const Outcome g = run("--checkpoint " + kCase + " --prompt-ids 5,6,7 --max-new-tokens 40 --json");
  const auto ids = last_line(g.out)["tokens"][0].get<std::vector<int32_t>>();
  const std::string text(ids.begin(), ids.end());
  const size_t k = text.find_first_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789");
  ASSERT_NE(k, std::string::npos) << "no letter or digit in 40 random bytes";
  const Outcome s = run("--checkpoint " + kCase + " --prompt-ids 5,6,7 --max-new-tokens 40 --json --stop " + text[k]);
  ASSERT_EQ(s.status, 0) << s.err;
  EXPECT_EQ(last_line(s.out)["tokens"][0].size(), k + 1);
  EXPECT_EQ(s.out.substr(0, k), text.substr(0, k));
}

// --prompt-ids repeated: one prompt each, each getting its own tokens (as alone). --ignore-eos: the checkpoint's
// end-of-text id no longer ends a sequence.
TEST(GenerateCli, RepeatedPromptIdsAndIgnoreEos) {
  const std::string base = "--checkpoint " + kCase + " --max-new-tokens 12 --threads 2 --json ";
  const Outcome a = run(base + "--prompt-ids 5,6,7"), b = run(base + "--prompt-ids 9,1"),
                both = run(base + "--prompt-ids 5,6,7 --prompt-ids 9,1");
  ASSERT_EQ(both.status, 0) << both.err;
  const nlohmann::json j = last_line(both.out);
  ASSERT_EQ(j["tokens"].size(), 2u);
  EXPECT_EQ(j["tokens"][0], last_line(a.out)["tokens"][0]);
  EXPECT_EQ(j["tokens"][1], last_line(b.out)["tokens"][0]);

  // A copy of the checkpoint whose eos_token_id is the third greedy token.
  const auto ids = last_line(a.out)["tokens"][0].get<std::vector<int32_t>>();
  ASSERT_EQ(ids.size(), 12u);
  test::TempDir dir;
  std::filesystem::copy_file(kCase + "/model.safetensors", dir / "model.safetensors");
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(kCase + "/config.json"));
  cfg["eos_token_id"] = ids[2];
  std::ofstream(dir / "config.json") << cfg.dump();
  const std::string copy = "--checkpoint " + dir.path().string() + " --prompt-ids 5,6,7 --max-new-tokens 12 --json";
  const Outcome stops = run(copy), goes_on = run(copy + " --ignore-eos");
  ASSERT_EQ(stops.status, 0) << stops.err;
  const size_t first = static_cast<size_t>(std::find(ids.begin(), ids.end(), ids[2]) - ids.begin());
  EXPECT_EQ(last_line(stops.out)["tokens"][0].size(), first + 1);
  EXPECT_EQ(last_line(goes_on.out)["tokens"][0].get<std::vector<int32_t>>(), ids);
  EXPECT_NE(run("--checkpoint " + kCase + " --prompt-ids 5 --threads -1").err.find("--threads must be >= 0"),
            std::string::npos);
}

TEST(GenerateCli, BadInputGivesClearErrors) {
  auto fails_with = [](const std::string& args, const std::string& msg) {
    const Outcome r = run(args);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_NE(r.err.find(msg), std::string::npos) << args << ": " << r.err;
  };
  const std::string ck = "--checkpoint " + kCase + " ";
  fails_with(ck + "--prompt-ids 1,256", "outside the vocabulary");
  fails_with(ck + "--prompt-ids 1,x", "not an integer");
  fails_with(ck + "--prompt hi --max-new-tokens 0", "must be positive");
  fails_with(ck + "--prompt hi --max-new-tokens -3", "must be positive");
  fails_with(ck + "--prompt hi --prompt-ids 1", "exactly one");
  fails_with(ck + "--prompt hi --chat", "--chat: no chat template in");
  fails_with(ck + "--prompt hi --system brief", "--system needs --chat");
  test::TempDir dir;
  std::filesystem::copy(kCase, dir / "ck");
  // A context of 4 positions: a 5-byte prompt does not fit.
  {
    std::ifstream in(dir / "ck" / "config.json");
    nlohmann::json cfg = nlohmann::json::parse(in);
    cfg["max_position_embeddings"] = 4;
    std::ofstream(dir / "ck" / "config.json") << cfg.dump();
  }
  fails_with("--checkpoint " + (dir / "ck").string() + " --prompt hello", "does not fit the model's context of 4");
  // Not bytes and no tokenizer: text prompts are refused.
  {
    std::ifstream in(dir / "ck" / "config.json");
    nlohmann::json cfg = nlohmann::json::parse(in);
    cfg["max_position_embeddings"] = 64;
    cfg["vocab_size"] = 300;
    std::ofstream(dir / "ck" / "config.json") << cfg.dump();
  }
  fails_with("--checkpoint " + (dir / "ck").string() + " --prompt hello", "has no tokenizer.json");
  std::filesystem::copy(kCase + "/config.json", dir / "ck" / "config.json",
                        std::filesystem::copy_options::overwrite_existing);
  // A truncated weights file.
  std::filesystem::resize_file(dir / "ck" / "model.safetensors", 1000);
  fails_with("--checkpoint " + (dir / "ck").string() + " --prompt hello", "model.safetensors");
}

// A checkpoint with a tokenizer.json: text prompts are encoded by it and the output decoded by it (the parity model
// has a vocabulary of 256, so the Qwen2 tokenizer's byte-level ids below 256 are what it can read and write).
TEST(GenerateCli, TextGoesThroughTheCheckpointsTokenizer) {
  const std::string json = hs::test::source_dir() + "/data/tokenizers/qwen2/tokenizer.json";
  ASSERT_TRUE(std::filesystem::exists(json)) << json << " (run scripts/setup.sh: it builds data/tokenizers/)";
  test::TempDir dir;
  std::filesystem::copy(kCase, dir / "ck");
  std::filesystem::copy(json, dir / "ck" / "tokenizer.json");
  const auto tok = tokenizer::Tokenizer::load(json);
  const std::vector<tokenizer::TokenId> enc = tok.encode("a");
  std::vector<int32_t> ids(enc.begin(), enc.end());
  for (int32_t id : ids) ASSERT_LT(id, 256);
  const Outcome r = run("--checkpoint " + (dir / "ck").string() + " --prompt a --max-new-tokens 16 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = last_line(r.out);
  MemoryAccountant mem;
  model::ParamSet ps(model::load_config(kCase), DType::F32, mem, MemCategory::Parameters, false);
  checkpoint::load_hf_params(checkpoint::CheckpointReader(kCase + "/model.safetensors"), ps);
  infer::GenerateOptions opt;
  opt.max_new_tokens = 16;
  const auto want = infer::generate(ps, {ids}, opt, mem).tokens[0];
  EXPECT_EQ(j["tokens"][0].get<std::vector<int32_t>>(), want);
  const std::vector<tokenizer::TokenId> out(want.begin(), want.end());
  const std::string text = tok.decode(out, true);  // streamed as it is (the JSON replaces invalid UTF-8)
  EXPECT_EQ(r.out.substr(0, text.size() + 1), text + "\n");
  // The chat format's special tokens are beyond this model's vocabulary: a clear error, not a crash.
  std::filesystem::copy(hs::test::source_dir() + "/data/templates/Qwen-Qwen3-0.6B.jinja",
                        dir / "ck" / "chat_template.jinja");
  const Outcome chat = run("--checkpoint " + (dir / "ck").string() + " --prompt hi --chat");
  EXPECT_NE(chat.status, 0);
  EXPECT_NE(chat.err.find("outside the model's vocabulary"), std::string::npos) << chat.err;
}

// --chat renders the prompt with the checkpoint's own template (here Qwen3's, on the byte-level parity model: the
// prompt is the rendered text's bytes), and --chat-template names another one.
TEST(GenerateCli, ChatRendersThePromptWithTheCheckpointsTemplate) {
  const std::string templates = hs::test::source_dir() + "/data/templates/";
  ASSERT_TRUE(std::filesystem::exists(templates + "Qwen-Qwen3-0.6B.jinja"))
      << "run scripts/setup.sh: it fetches data/templates";
  test::TempDir dir;
  std::filesystem::copy(kCase, dir / "ck");
  std::filesystem::copy(templates + "Qwen-Qwen3-0.6B.jinja", dir / "ck" / "chat_template.jinja");
  auto greedy_of = [&](const std::string& text) {
    MemoryAccountant mem;
    model::ParamSet ps(model::load_config(kCase), DType::F32, mem, MemCategory::Parameters, false);
    checkpoint::load_hf_params(checkpoint::CheckpointReader(kCase + "/model.safetensors"), ps);
    infer::GenerateOptions opt;
    opt.max_new_tokens = 8;
    const std::vector<int32_t> ids(reinterpret_cast<const unsigned char*>(text.data()),
                                   reinterpret_cast<const unsigned char*>(text.data()) + text.size());
    return infer::generate(ps, {ids}, opt, mem).tokens[0];
  };
  // What transformers renders for [{"role": "user", "content": "hi"}] with add_generation_prompt=True.
  const Outcome r = run("--checkpoint " + (dir / "ck").string() + " --prompt hi --chat --max-new-tokens 8 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(last_line(r.out)["tokens"][0].get<std::vector<int32_t>>(),
            greedy_of("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"));
  const Outcome sys = run("--checkpoint " + (dir / "ck").string() + " --prompt hi --chat --system 'Be brief.' " +
                          "--chat-template " + templates + "Qwen-Qwen2.5-7B-Instruct.jinja --max-new-tokens 8 --json");
  ASSERT_EQ(sys.status, 0) << sys.err;
  EXPECT_EQ(last_line(sys.out)["tokens"][0].get<std::vector<int32_t>>(),
            greedy_of("<|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"));
  // A template that raises (Qwen3.5's needs a user turn that is not a tool response): its message, not a crash.
  std::filesystem::copy(templates + "Qwen3.5-4B.jinja", dir / "ck" / "chat_template.jinja",
                        std::filesystem::copy_options::overwrite_existing);
  const Outcome raised = run("--checkpoint " + (dir / "ck").string() +
                             " --prompt '<tool_response>x</tool_response>' --chat --max-new-tokens 2");
  EXPECT_NE(raised.status, 0);
  EXPECT_NE(raised.err.find("No user query found in messages."), std::string::npos) << raised.err;
}

}  // namespace
}  // namespace hs
