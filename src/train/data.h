// Training data: a text corpus as byte tokens (ids 0..255), split into a training and a held-out part, and batches
// of windows drawn by a counter-based generator so the batch of step t depends only on (seed, t): resuming at step t
// sees exactly the batches an uninterrupted run would.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace hs::train {

struct Corpus {
  std::vector<int32_t> train, heldout;
  std::string source;
};

// Reads `path` as bytes; the last `heldout_fraction` (at least one window's worth when possible) is held out.
// Throws std::runtime_error naming the file when it cannot be read or is too short for one window of seq+1 tokens.
Corpus load_byte_corpus(const std::string& path, double heldout_fraction, int64_t seq);
std::vector<int32_t> read_byte_tokens(const std::string& path);

struct TokenBatch {
  std::vector<int32_t> inputs, targets;  // [batch, seq]
  int64_t batch = 0, seq = 0;
};

// Step t's batch: `batch` windows of seq+1 tokens at positions drawn from (seed, t, row).
TokenBatch sample_batch(const std::vector<int32_t>& tokens, int64_t batch, int64_t seq, uint64_t seed, int64_t step);
// Random tokens in [0, vocab) (for --synthetic benchmarking).
TokenBatch synthetic_batch(int64_t vocab, int64_t batch, int64_t seq, uint64_t seed, int64_t step);
// Consecutive windows of seq+1 tokens overlapping by one token, so every token after the first is predicted exactly
// once; the last window may be shorter (padded with ignored targets).
std::vector<TokenBatch> eval_windows(const std::vector<int32_t>& tokens, int64_t seq, int64_t batch);

}  // namespace hs::train
