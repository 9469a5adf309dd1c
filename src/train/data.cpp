#include "train/data.h"

#include "core/hash.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <stdexcept>

namespace hs::train {

namespace {
uint64_t mix(uint64_t x) { return splitmix64(x); }
}  // namespace

std::vector<int32_t> read_byte_tokens(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read text file '" + path + "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<int32_t> t(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) t[i] = static_cast<unsigned char>(bytes[i]);
  return t;
}

Corpus load_byte_corpus(const std::string& path, double heldout_fraction, int64_t seq) {
  std::vector<int32_t> all = read_byte_tokens(path);
  const int64_t n = static_cast<int64_t>(all.size());
  int64_t held = static_cast<int64_t>(static_cast<double>(n) * heldout_fraction);
  if (held > 0) held = std::max<int64_t>(held, seq + 1);
  if (n - held < seq + 1)
    throw std::runtime_error("text file '" + path + "' has " + std::to_string(n) + " bytes: too short for windows of " +
                             std::to_string(seq + 1) + " tokens plus a held-out part (use a longer text or a smaller --seq)");
  Corpus c;
  c.source = path;
  c.train.assign(all.begin(), all.end() - held);
  c.heldout.assign(all.end() - held, all.end());
  return c;
}

TokenBatch sample_batch(const std::vector<int32_t>& tokens, int64_t batch, int64_t seq, uint64_t seed, int64_t step) {
  TokenBatch b;
  b.batch = batch;
  b.seq = seq;
  b.inputs.resize(static_cast<size_t>(batch * seq));
  b.targets.resize(static_cast<size_t>(batch * seq));
  const uint64_t span = tokens.size() - static_cast<uint64_t>(seq);  // valid window starts
  for (int64_t r = 0; r < batch; ++r) {
    uint64_t start = mix(mix(seed) ^ mix(static_cast<uint64_t>(step) * 0x100000001b3ull + static_cast<uint64_t>(r))) % span;
    for (int64_t j = 0; j < seq; ++j) {
      b.inputs[static_cast<size_t>(r * seq + j)] = tokens[start + static_cast<uint64_t>(j)];
      b.targets[static_cast<size_t>(r * seq + j)] = tokens[start + static_cast<uint64_t>(j) + 1];
    }
  }
  return b;
}

TokenBatch synthetic_batch(int64_t vocab, int64_t batch, int64_t seq, uint64_t seed, int64_t step) {
  TokenBatch b;
  b.batch = batch;
  b.seq = seq;
  std::vector<int32_t> stream(static_cast<size_t>(batch * (seq + 1)));
  for (size_t i = 0; i < stream.size(); ++i)
    stream[i] = static_cast<int32_t>(mix(mix(seed) ^ mix(static_cast<uint64_t>(step) << 32 | i)) % static_cast<uint64_t>(vocab));
  for (int64_t r = 0; r < batch; ++r)
    for (int64_t j = 0; j < seq; ++j) {
      b.inputs.push_back(stream[static_cast<size_t>(r * (seq + 1) + j)]);
      b.targets.push_back(stream[static_cast<size_t>(r * (seq + 1) + j + 1)]);
    }
  return b;
}

std::vector<TokenBatch> eval_windows(const std::vector<int32_t>& tokens, int64_t seq, int64_t batch) {
  std::vector<TokenBatch> out;
  const int64_t n = static_cast<int64_t>(tokens.size());
  TokenBatch cur;
  auto flush = [&] {
    if (cur.batch > 0) out.push_back(std::move(cur));
    cur = TokenBatch();
  };
  // Window w covers tokens [w*seq, w*seq + seq] (seq+1 tokens): inputs are the first seq, targets the last seq.
  for (int64_t start = 0; start + 1 < n; start += seq) {
    if (cur.batch == batch) flush();
    cur.seq = seq;
    for (int64_t j = 0; j < seq; ++j) {
      int64_t i = start + j;
      cur.inputs.push_back(i < n ? tokens[static_cast<size_t>(i)] : 0);
      cur.targets.push_back(i + 1 < n ? tokens[static_cast<size_t>(i + 1)] : -1);
    }
    ++cur.batch;
  }
  flush();
  return out;
}

}  // namespace hs::train
