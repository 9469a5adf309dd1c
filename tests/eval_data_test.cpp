// train --eval-data: a held-out token file or text evaluated every --eval-every steps instead of the split-off tail
// of the training data, in the training data's ids, with clear refusals otherwise.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/convert.h"
#include "dataset/token_file.h"
#include "dataset/vocabulary.h"
#include "train/data.h"
#include "train/evaluate.h"
#include "train/trainer.h"
#include "test_util.h"
#include "token_file_util.h"

namespace hs::train {
namespace {

namespace fs = std::filesystem;
using test::lorem;

// A token file of `text` as one document of bytes.
void write_token_file(const fs::path& path, const std::string& text, uint64_t fingerprint) {
  test::write_byte_documents(path, test::byte_vocabulary(256, fingerprint), {text});
}

TrainOptions run_options(const fs::path& out) {
  TrainOptions o;
  o.model = "tiny";
  o.steps = 3;
  o.batch = 2;
  o.seq = 32;
  o.opt.warmup = 1;
  o.eval_every = 2;
  o.eval_batches = 3;
  o.out = out.string();
  o.progress = false;
  o.step.compute = DType::F32;
  return o;
}

// A text trained on whole (no tail held out) and another text evaluated at steps 2 and 3: the reported held-out
// loss is what evaluate_tokens gives for the final checkpoint's parameters on that text (the same windows, the same
// arithmetic: equal to the bit), and the log counts every training byte as a training token.
TEST(EvalData, TextIsEvaluatedInsteadOfTheTail) {
  test::TempDir t;
  std::ofstream(t / "train.txt") << lorem(6000, 1);
  std::ofstream(t / "held.txt") << lorem(1500, 2);
  TrainOptions o = run_options(t / "run");
  o.text = (t / "train.txt").string();
  o.eval_data = (t / "held.txt").string();
  std::ostringstream log;
  const TrainSummary s = run_training(o, log);
  EXPECT_NE(log.str().find("6000 train / 1500 held-out tokens"), std::string::npos) << log.str();
  std::vector<double> evals;
  std::ifstream f(t / "run/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const nlohmann::json m = nlohmann::json::parse(line);
    if (m.contains("eval_ce")) evals.push_back(m["eval_ce"].get<double>());
  }
  ASSERT_EQ(evals.size(), 2u);  // steps 2 and 3
  EXPECT_EQ(evals.back(), s.eval_ce);

  const checkpoint::CheckpointDir ckpt = checkpoint::open_checkpoint_dir((t / "run/checkpoint-3").string());
  MemoryAccountant mem;
  model::ParamSet params(ckpt.config, DType::F32, mem, MemCategory::Parameters, false);
  checkpoint::load_parameters(ckpt, params);
  const Tokens held = load_tokens({"", (t / "held.txt").string(), ""}, {256, ""});
  const EvalResult e = evaluate_tokens(params, held.tokens, o.seq, o.batch, DType::F32, mem, o.eval_batches);
  EXPECT_EQ(e.ce, s.eval_ce);
  // And the options come back with a resume.
  nlohmann::json st = ckpt.native["state"]["options"];
  EXPECT_EQ(st["eval_data"], o.eval_data);
}

// A run that packs documents evaluates its held-out documents packed too: the reported held-out loss is
// evaluate_tokens' with Packing::Documents on the final checkpoint, to the bit, and not the stream's.
TEST(EvalData, PackedRunsEvaluateTheirDocumentsPacked) {
  test::TempDir t;
  std::vector<std::string> train_docs, held_docs;
  for (uint32_t i = 0; i < 40; ++i) train_docs.push_back(lorem(60 + 13 * i % 90, 100 + i));
  for (uint32_t i = 0; i < 12; ++i) held_docs.push_back(lorem(20 + 7 * i, 200 + i));
  test::write_byte_documents(t / "train.tok", test::byte_vocabulary(256, 0x1234), train_docs);
  test::write_byte_documents(t / "held.tok", test::byte_vocabulary(256, 0x1234), held_docs);
  TrainOptions o = run_options(t / "run");
  o.data = (t / "train.tok").string();
  o.eval_data = (t / "held.tok").string();
  o.step.packing = Packing::Documents;
  std::ostringstream log;
  const TrainSummary s = run_training(o, log);

  const checkpoint::CheckpointDir ckpt = checkpoint::open_checkpoint_dir((t / "run/checkpoint-3").string());
  MemoryAccountant mem;
  model::ParamSet params(ckpt.config, DType::F32, mem, MemCategory::Parameters, false);
  checkpoint::load_parameters(ckpt, params);
  const Tokens held = load_tokens({(t / "held.tok").string(), "", ""}, {256, ""});
  auto eval = [&](Packing p) {
    return evaluate_tokens(params, held.tokens, o.seq, o.batch, DType::F32, mem, o.eval_batches, nullptr, p).ce;
  };
  EXPECT_EQ(eval(Packing::Documents), s.eval_ce);
  EXPECT_NE(eval(Packing::Stream), s.eval_ce);
}

// A token file of the training token file's vocabulary is evaluated; one of another fingerprint, a token file against
// byte tokens, a text against a token file whose tokenizer is unknown and a chat file are refused, each saying why.
TEST(EvalData, TokenFilesAndRefusals) {
  test::TempDir t;
  write_token_file(t / "train.tok", lorem(4000, 3), 0x1234);
  write_token_file(t / "held.tok", lorem(1000, 4), 0x1234);
  write_token_file(t / "other.tok", lorem(1000, 4), 0x9999);
  std::ofstream(t / "held.txt") << lorem(1000, 4);
  std::ofstream(t / "chat.jsonl") << "{\"messages\": []}\n";
  TrainOptions o = run_options(t / "run");
  o.data = (t / "train.tok").string();
  o.eval_data = (t / "held.tok").string();
  std::ostringstream log;
  const TrainSummary s = run_training(o, log);
  EXPECT_GT(s.eval_ce, 0);
  EXPECT_NE(log.str().find("held out: token file"), std::string::npos) << log.str();

  auto refusal = [&](TrainOptions x) { return test::error_of([&] { run_training(x, log); }); };
  o.eval_data = (t / "other.tok").string();
  EXPECT_NE(refusal(o).find("vocabulary fingerprints differ"), std::string::npos) << refusal(o);
  o.eval_data = (t / "held.txt").string();
  EXPECT_NE(refusal(o).find("is not known here: pass --tokenizer"), std::string::npos) << refusal(o);
  o.eval_data = (t / "chat.jsonl").string();
  EXPECT_NE(refusal(o).find("is a chat file, but the run has no tokenizer"), std::string::npos) << refusal(o);
  TrainOptions bytes = run_options(t / "bytes");
  std::ofstream(t / "train.txt") << lorem(4000, 3);
  bytes.text = (t / "train.txt").string();
  bytes.eval_data = (t / "held.tok").string();
  EXPECT_NE(refusal(bytes).find("read as bytes"), std::string::npos) << refusal(bytes);
}

}  // namespace
}  // namespace hs::train
