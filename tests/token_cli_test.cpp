// The token-data commands end to end through the built binary: tokenize (and --raw), train and eval on a token file
// and on a text encoded by the checkpoint's own tokenizer, a Hugging Face directory that carries its tokenizer.json
// through convert, train --init and eval, and the refusals of data that does not fit the model.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dataset/token_file.h"
#include "model/config.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace hs {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using test::CliRun;
CliRun hybridscan(const std::string& args) { return test::run_command(hs::test::binary() + " " + args); }

// The last line of the output that is a JSON object.
json last_json(const std::string& out) {
  const size_t at = out.rfind("\n{");
  return json::parse(out.substr(at == std::string::npos ? 0 : at + 1));
}

const fs::path kTokenizer = fs::path(hs::test::source_dir()) / "tests/fixtures/tokenizer/qwen3_5_320/tokenizer.json";

std::string text_of(int i) {
  std::string s;
  for (int k = 0; k < 60; ++k)
    s += "And God said, Let there be light: and there was light " + std::to_string(i * 100 + k) + ".\n";
  return s;
}

TEST(TokenCli, TokenizeTrainEvalConvertAndFineTuneWithTheCheckpointsTokenizer) {
  test::TempDir t;
  const std::string d = t.path().string();
  std::ofstream(t / "a.txt") << text_of(1);
  std::ofstream(t / "b.txt") << text_of(2);
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::load(kTokenizer.string());
  // A tiny model whose vocabulary holds the tokenizer's ids, padded to a multiple of 64 as the released configs are.
  model::ModelConfig cfg = model::preset("tiny");
  cfg.vocab = (tok.vocab_size() + 63) / 64 * 64;
  std::ofstream(t / "config.json") << model::config_to_hf_json(cfg).dump(2);

  CliRun r = hybridscan("tokenize --tokenizer " + kTokenizer.string() + " --text " + d + "/a.txt " + d + "/b.txt --out " +
                     d + "/ab.tok");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("2 documents"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tokens/s"), std::string::npos) << r.out;
  auto f = dataset::TokenFile::open(t / "ab.tok");
  const std::vector<uint32_t> ids_a = tok.encode(text_of(1)), ids_b = tok.encode(text_of(2));
  ASSERT_EQ(f->size(), int64_t(ids_a.size() + 1 + ids_b.size()));
  EXPECT_EQ(f->header().fingerprint, tok.fingerprint());
  EXPECT_EQ(f->header().text_bytes, int64_t(text_of(1).size() + text_of(2).size()));

  r = hybridscan("tokenize --raw --tokenizer " + kTokenizer.string() + " --text " + d + "/a.txt --out " + d + "/a.raw");
  ASSERT_EQ(r.rc, 0) << r.out;
  const std::vector<std::byte> raw = test::read_bytes(t / "a.raw");
  ASSERT_EQ(raw.size(), 4 * ids_a.size());
  EXPECT_EQ(0, std::memcmp(raw.data(), ids_a.data(), raw.size()));
  r = hybridscan("tokenize --tokenizer " + kTokenizer.string() + " --text " + d + "/a.txt --out " + d + "/a.tok --quiet");
  ASSERT_EQ(r.rc, 0) << r.out;

  // Train on the token file; the checkpoint carries the tokenizer.
  r = hybridscan("train --config " + d + "/config.json --data " + d + "/ab.tok --tokenizer " + kTokenizer.string() +
                 " --steps 4 --batch 2 --seq 32 --eval-every 4 --eval-batches 2 --compute-dtype fp32 --quiet --out " + d +
                 "/run");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("bits/byte"), std::string::npos) << r.out;
  const fs::path ckpt = t / "run/checkpoint-4";
  ASSERT_TRUE(fs::exists(ckpt / "tokenizer.json"));

  // eval of a token file, and of a text encoded by the checkpoint's tokenizer (the default): one document, the same
  // ids, the same loss. bits per byte counts the bytes of the predicted tokens: every byte of the text but the first
  // token's.
  r = hybridscan("eval --checkpoint " + ckpt.string() + " --data " + d + "/a.tok --seq 64");
  ASSERT_EQ(r.rc, 0) << r.out;
  const json on_data = last_json(r.out);
  r = hybridscan("eval --checkpoint " + ckpt.string() + " --text " + d + "/a.txt --seq 64");
  ASSERT_EQ(r.rc, 0) << r.out;
  const json on_text = last_json(r.out);
  EXPECT_EQ(on_text["tokenizer"], (ckpt / "tokenizer.json").string());
  EXPECT_EQ(on_data["cross_entropy"], on_text["cross_entropy"]);
  EXPECT_EQ(on_data["tokens"].get<int64_t>(), int64_t(ids_a.size()) - 1);
  const int64_t bytes = on_data["text_bytes"].get<int64_t>();
  EXPECT_EQ(bytes + int64_t(tok.token_bytes(ids_a[0]).size()), int64_t(text_of(1).size()));
  EXPECT_NEAR(on_data["bits_per_byte"].get<double>(),
              on_data["cross_entropy"].get<double>() * double(ids_a.size() - 1) / std::log(2.0) / double(bytes), 1e-9);

  // A Hugging Face export carries the tokenizer; fine-tuning from it uses it and carries it on; eval of the
  // fine-tuned checkpoint and of its export agree.
  r = hybridscan("convert --quiet --from " + ckpt.string() + " --to " + d + "/hf --format hf");
  ASSERT_EQ(r.rc, 0) << r.out;
  ASSERT_TRUE(fs::exists(t / "hf/tokenizer.json"));
  r = hybridscan("train --init " + d + "/hf --text " + d + "/b.txt --steps 2 --batch 2 --seq 32 --eval-every 0 "
                 "--compute-dtype fp32 --quiet --out " + d + "/ft");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("tokens of " + d + "/hf/tokenizer.json"), std::string::npos) << r.out;
  ASSERT_TRUE(fs::exists(t / "ft/checkpoint-2/tokenizer.json"));
  r = hybridscan("convert --quiet --from " + d + "/ft/checkpoint-2 --to " + d + "/ft-hf --format hf");
  ASSERT_EQ(r.rc, 0) << r.out;
  r = hybridscan("eval --checkpoint " + d + "/ft/checkpoint-2 --text " + d + "/a.txt --seq 64");
  ASSERT_EQ(r.rc, 0) << r.out;
  const json ft = last_json(r.out);
  r = hybridscan("eval --checkpoint " + d + "/ft-hf --text " + d + "/a.txt --seq 64");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(last_json(r.out)["cross_entropy"], ft["cross_entropy"]);
  EXPECT_EQ(last_json(r.out)["tokenizer"], d + "/ft-hf/tokenizer.json");

  // Refused before the first step: ids beyond the model's vocabulary (byte preset), another tokenizer's token file,
  // another tokenizer than the checkpoint's own.
  r = hybridscan("train --preset tiny --data " + d + "/ab.tok --steps 1 --quiet");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("more than the model's vocab_size 256"), std::string::npos) << r.out;
  json other = json::parse(std::ifstream(kTokenizer));
  other["model"]["merges"].erase(other["model"]["merges"].size() - 1);
  std::ofstream(t / "other.json") << other.dump();
  r = hybridscan("tokenize --quiet --tokenizer " + d + "/other.json --text " + d + "/a.txt --out " + d + "/other.tok");
  ASSERT_EQ(r.rc, 0) << r.out;
  r = hybridscan("eval --checkpoint " + ckpt.string() + " --data " + d + "/other.tok");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("was written by a tokenizer with fingerprint"), std::string::npos) << r.out;
  r = hybridscan("train --init " + ckpt.string() + " --steps 2 --data " + d + "/other.tok --quiet");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("re-tokenize with `hybridscan tokenize --tokenizer " + (ckpt / "tokenizer.json").string() + "`"),
            std::string::npos)
      << r.out;
  r = hybridscan("eval --checkpoint " + ckpt.string() + " --text " + d + "/a.txt --tokenizer " + d + "/other.json");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("is not the model's own"), std::string::npos) << r.out;
  r = hybridscan("eval --checkpoint " + ckpt.string() + " --data " + d + "/a.txt");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("is not a hybridscan token file"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace hs
