#include "train/evaluate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "dataset/token_file.h"

#include "train/data.h"
#include "train/schedule.h"

namespace hs::train {

EvalResult evaluate_tokens(const model::ParamSet& params, const dataset::TokenSource& tokens, int64_t seq,
                           int64_t batch, DType compute, MemoryAccountant& mem, int64_t max_batches,
                           Collectives* shards, Packing packing) {
  EvalResult r;
  double sum = 0;
  int64_t n = eval_batch_count(tokens.size(), seq, batch);
  if (max_batches >= 0) n = std::min(n, max_batches);
  for (int64_t i = 0; i < n; ++i) {
    const TokenBatch tb = eval_batch(tokens, seq, batch, i, packing);
    Batch b{tb.inputs.data(), tb.targets.data(), tb.batch, tb.seq, tb.positions_or_null()};
    StepResult s = forward_only(params, b, compute, mem, nullptr, shards);
    sum += s.ce_sum;
    r.count += s.count;
    for (int32_t t : tb.targets)
      if (t >= 0) r.text_bytes += tokens.text_bytes(t);
  }
  r.ce = r.count ? sum / static_cast<double>(r.count) : 0.0;
  r.bits_per_byte = r.text_bytes ? sum / std::log(2.0) / static_cast<double>(r.text_bytes) : 0.0;
  return r;
}

namespace {
bool is_token_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::invalid_argument("--eval-data " + path + ": cannot read it");
  char magic[8] = {};
  f.read(magic, sizeof magic);
  return f && std::string_view(magic, sizeof magic) == "HSTOKENS";
}
}  // namespace

Tokens load_eval_tokens(const std::string& path, const std::string& train_data, const std::string& tokenizer,
                        bool byte_tokens, const ModelVocabulary& vocab) {
  if (std::filesystem::path(path).extension() == ".jsonl")
    throw std::invalid_argument("--eval-data " + path + ": a chat file (JSONL) is evaluated as conversations, which "
                                "train does not render yet; give a token file from 'hybridscan tokenize' or a text");
  if (is_token_file(path)) {
    if (byte_tokens)
      throw std::invalid_argument("--eval-data " + path + " is a token file, but the training text is read as bytes: "
                                  "evaluate a text, or train with --tokenizer");
    if (!train_data.empty()) {
      const uint64_t want = dataset::TokenFile::open(train_data)->header().fingerprint;
      const uint64_t got = dataset::TokenFile::open(path)->header().fingerprint;
      if (want != got)
        throw std::invalid_argument("--eval-data " + path + " was written by another tokenizer than the training data " +
                                    train_data + " (vocabulary fingerprints differ): tokenize both with the same one");
    }
    return load_tokens({path, "", tokenizer}, vocab);
  }
  if (!train_data.empty() && tokenizer.empty())
    throw std::invalid_argument("--eval-data " + path + " is a text, but the tokenizer of the training token file " +
                                train_data + " is not known here: pass --tokenizer, or tokenize the text with it");
  return load_tokens({"", path, tokenizer}, byte_tokens ? ModelVocabulary{vocab.size, ""} : vocab);
}

}  // namespace hs::train
