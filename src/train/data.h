// Training data: a token sequence (the bytes of a text, a text encoded by a tokenizer, or a memory-mapped token file)
// split into a training and a held-out part, and batches of windows drawn by a counter-based generator so the batch of
// step t depends only on (seed, t): resuming at step t sees exactly the batches an uninterrupted run would.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dataset/token_source.h"
#include "train/schedule.h"

namespace hs::train {

using dataset::TokenSource;

// Where the tokens come from (the --data, --text and --tokenizer flags of train and eval).
struct DataOptions {
  std::string data;       // a token file written by `hybridscan tokenize`
  std::string text;       // a text file
  std::string tokenizer;  // tokenizer.json (or a directory holding one) to encode `text` with
};

// What the tokens must fit: the model's vocabulary size and, when its checkpoint carries one, its tokenizer.
struct ModelVocabulary {
  int64_t size = 0;
  std::string tokenizer;  // tokenizer.json beside the weights; empty when there is none
};

// The tokenizer.json a checkpoint directory carries beside its weights, or "" when it has none.
std::string checkpoint_tokenizer(const std::string& checkpoint_dir);

struct Tokens {
  TokenSource tokens;
  std::string description;  // for logs: what the tokens are
  // The tokenizer.json the ids belong to, which checkpoints carry ("" for byte tokens, a token file alone, or a
  // vocab.json + merges.txt tokenizer).
  std::string tokenizer;
};

// A token file (refused when its vocabulary is larger than the model's or its fingerprint is not that of the model's
// tokenizer), a text encoded by d.tokenizer or else the model's own tokenizer, or else the bytes of the text (ids
// 0..255). Throws std::invalid_argument or dataset::TokenFileError saying what does not match and how to fix it.
Tokens load_tokens(const DataOptions& d, const ModelVocabulary& model);

struct Corpus {
  TokenSource train, heldout;
};

// The last `heldout_fraction` of the tokens (at least one window's worth when possible) is held out. Throws
// std::runtime_error naming `what` when there are too few tokens for one window of seq+1 plus the held-out part.
Corpus split_heldout(const TokenSource& all, double heldout_fraction, int64_t seq, const std::string& what);

struct TokenBatch {
  std::vector<int32_t> inputs, targets;  // [batch, seq]
  // Packed documents: [batch, seq] positions within each document (train::Batch::positions); empty: stream.
  std::vector<int32_t> positions;
  int64_t batch = 0, seq = 0;
  const int32_t* positions_or_null() const { return positions.empty() ? nullptr : positions.data(); }
};

// Whether batches of `tokens` pack documents: Documents and Stream as said; Auto when the tokens have a document
// separator (a token file of several documents).
bool packs_documents(const TokenSource& tokens, Packing packing);

// Step t's batch: `batch` windows of seq+1 tokens at positions drawn from (seed, t, row). The windows and the ids
// do not depend on the packing; with documents (packs_documents) each window also gets positions that start at 0 and
// restart after every document separator (the separator is its document's last token, and is predicted), and the
// target of a separator (the next document's first token) is -1.
TokenBatch sample_batch(const TokenSource& tokens, int64_t batch, int64_t seq, uint64_t seed, int64_t step,
                        Packing packing = Packing::Stream);
// Random tokens in [0, vocab) (for --synthetic benchmarking).
TokenBatch synthetic_batch(int64_t vocab, int64_t batch, int64_t seq, uint64_t seed, int64_t step);
// Evaluation reads consecutive windows of seq+1 tokens overlapping by one token, so every token after the first is
// predicted exactly once; the last window may be shorter (padded with ignored targets, -1). Batch `index` holds
// windows [index * batch, (index + 1) * batch); batches are made one at a time so a large file is never copied whole.
int64_t eval_batch_count(int64_t tokens, int64_t seq, int64_t batch);
// With documents, positions and targets as sample_batch's.
TokenBatch eval_batch(const TokenSource& tokens, int64_t seq, int64_t batch, int64_t index,
                      Packing packing = Packing::Stream);

}  // namespace hs::train
