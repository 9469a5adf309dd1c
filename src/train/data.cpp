#include "train/data.h"

#include <omp.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>

#include "core/hash.h"
#include "dataset/vocabulary.h"

namespace hs::train {

namespace {

uint64_t mix(uint64_t x) { return splitmix64(x); }

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read text file '" + path + "'");
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

std::vector<int32_t> read_byte_tokens(const std::string& path) {
  const std::string bytes = read_text(path);
  std::vector<int32_t> t(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) t[i] = static_cast<unsigned char>(bytes[i]);
  return t;
}

tokenizer::Tokenizer load_tokenizer(const std::string& path, int64_t model_vocab, const std::string& role) {
  tokenizer::Tokenizer t = tokenizer::Tokenizer::load(path);
  if (t.vocab_size() > model_vocab)
    throw std::invalid_argument(role + " " + path + " has " + std::to_string(t.vocab_size()) +
                                " ids, more than the model's vocab_size " + std::to_string(model_vocab) +
                                "; use the tokenizer the model was trained with");
  return t;
}

// The tokenizer.json a checkpoint can carry for `path` (a tokenizer.json, or a directory holding one); "" for a
// vocab.json + merges.txt pair.
std::string tokenizer_json(const std::string& path) {
  if (!std::filesystem::is_directory(path)) return path;
  const std::filesystem::path p = std::filesystem::path(path) / "tokenizer.json";
  return std::filesystem::is_regular_file(p) ? p.string() : "";
}

}  // namespace

std::string checkpoint_tokenizer(const std::string& checkpoint_dir) {
  if (checkpoint_dir.empty()) return "";
  const std::filesystem::path p = std::filesystem::path(checkpoint_dir) / "tokenizer.json";
  return std::filesystem::is_regular_file(p) ? p.string() : "";
}

Tokens load_tokens(const DataOptions& d, const ModelVocabulary& model) {
  if (!d.data.empty() && !d.text.empty())
    throw std::invalid_argument("a token file and a text were both given: train on one of them");
  // The tokenizer the ids must belong to: the one asked for, which must then be the model's own when it has one.
  std::optional<tokenizer::Tokenizer> tok;
  std::string tok_path = d.tokenizer.empty() ? model.tokenizer : d.tokenizer;
  if (!tok_path.empty()) tok = load_tokenizer(tok_path, model.size, d.tokenizer.empty() ? "the model's tokenizer" : "tokenizer");
  if (!d.tokenizer.empty() && !model.tokenizer.empty()) {
    const tokenizer::Tokenizer own = tokenizer::Tokenizer::load(model.tokenizer);
    if (own.fingerprint() != tok->fingerprint())
      throw std::invalid_argument("tokenizer " + d.tokenizer + " is not the model's own (" + model.tokenizer +
                                  ": different vocabulary fingerprint); leave the tokenizer unset to use the model's");
  }
  Tokens out;
  out.tokenizer = tok_path.empty() ? "" : tokenizer_json(tok_path);
  if (!d.data.empty()) {
    std::shared_ptr<const dataset::TokenFile> f = dataset::TokenFile::open(d.data);
    dataset::check_token_file(*f, model.size, tok ? std::optional(tok->fingerprint()) : std::nullopt, tok_path);
    out.tokens = TokenSource::mapped(f);
    out.description = "token file " + d.data + " (" + std::to_string(f->size()) + " tokens, " +
                      std::to_string(f->header().documents) + " documents, memory-mapped)";
    return out;
  }
  if (tok) {
    const std::string text = read_text(d.text);
    const std::vector<tokenizer::TokenId> ids = tok->encode_parallel(text, omp_get_max_threads());
    out.tokens = TokenSource::in_memory(std::vector<int32_t>(ids.begin(), ids.end()),
                                        dataset::vocabulary_of(*tok).token_bytes);
    out.description = d.text + " (" + std::to_string(ids.size()) + " tokens of " + tok_path + ")";
    return out;
  }
  if (model.size < 256)
    throw std::invalid_argument("byte tokens need vocab_size >= 256; the model has " + std::to_string(model.size));
  out.tokens = TokenSource::in_memory(read_byte_tokens(d.text));
  out.description = d.text + " (byte tokens)";
  return out;
}

Corpus split_heldout(const TokenSource& all, double heldout_fraction, int64_t seq, const std::string& what) {
  const int64_t n = all.size();
  int64_t held = static_cast<int64_t>(static_cast<double>(n) * heldout_fraction);
  if (held > 0) held = std::max<int64_t>(held, seq + 1);
  if (n - held < seq + 1)
    throw std::runtime_error(what + " has " + std::to_string(n) + " tokens: too short for windows of " +
                             std::to_string(seq + 1) + " tokens plus a held-out part (use a longer text or shorter sequences)");
  return {all.slice(0, n - held), all.slice(n - held, n)};
}

bool packs_documents(const TokenSource& tokens, Packing packing) {
  return packing == Packing::Documents || (packing == Packing::Auto && tokens.document_separator().has_value());
}

namespace {

// Row r of a batch from its window of seq+1 tokens (`have` of them real: the rest are ignored targets). With a
// separator: positions restart after each one, whose target (another document's first token) is ignored.
// mask (empty: none): the window's loss mask; a target whose mask byte is 0 is ignored.
void fill_row(TokenBatch& b, int64_t r, const std::vector<int32_t>& window, int64_t have,
              std::optional<int32_t> separator, const std::vector<uint8_t>& mask) {
  const int64_t seq = b.seq;
  int32_t* in = b.inputs.data() + r * seq;
  int32_t* tg = b.targets.data() + r * seq;
  for (int64_t j = 0; j < seq; ++j) {
    in[j] = j < have ? window[static_cast<size_t>(j)] : 0;
    tg[j] = j + 1 < have && (mask.empty() || mask[static_cast<size_t>(j + 1)] != 0) ? window[static_cast<size_t>(j + 1)]
                                                                                    : -1;
  }
  if (b.positions.empty()) return;
  int32_t* pos = b.positions.data() + r * seq;
  for (int64_t j = 0; j < seq; ++j) {
    const bool after_separator = j > 0 && separator && in[j - 1] == *separator;
    pos[j] = j == 0 || after_separator ? 0 : pos[j - 1] + 1;
    if (separator && in[j] == *separator) tg[j] = -1;
  }
}

}  // namespace

TokenBatch sample_batch(const TokenSource& tokens, int64_t batch, int64_t seq, uint64_t seed, int64_t step,
                        Packing packing) {
  TokenBatch b;
  b.batch = batch;
  b.seq = seq;
  b.inputs.resize(static_cast<size_t>(batch * seq));
  b.targets.resize(static_cast<size_t>(batch * seq));
  const bool documents = packs_documents(tokens, packing);
  if (documents) b.positions.resize(static_cast<size_t>(batch * seq));
  const uint64_t span = static_cast<uint64_t>(tokens.size() - seq);  // valid window starts
  std::vector<int32_t> window(static_cast<size_t>(seq + 1));
  std::vector<uint8_t> mask(tokens.has_mask() ? static_cast<size_t>(seq + 1) : 0);
  for (int64_t r = 0; r < batch; ++r) {
    uint64_t start = mix(mix(seed) ^ mix(static_cast<uint64_t>(step) * 0x100000001b3ull + static_cast<uint64_t>(r))) % span;
    tokens.read(static_cast<int64_t>(start), seq + 1, window.data());
    if (!mask.empty()) tokens.read_mask(static_cast<int64_t>(start), seq + 1, mask.data());
    fill_row(b, r, window, seq + 1, documents ? tokens.document_separator() : std::nullopt, mask);
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

int64_t eval_batch_count(int64_t tokens, int64_t seq, int64_t batch) {
  const int64_t windows = tokens < 2 ? 0 : (tokens - 1 + seq - 1) / seq;
  return (windows + batch - 1) / batch;
}

TokenBatch eval_batch(const TokenSource& tokens, int64_t seq, int64_t batch, int64_t index, Packing packing) {
  const int64_t n = tokens.size();
  const int64_t windows = n < 2 ? 0 : (n - 1 + seq - 1) / seq;
  const bool documents = packs_documents(tokens, packing);
  TokenBatch b;
  b.seq = seq;
  b.batch = std::max<int64_t>(0, std::min(windows, (index + 1) * batch) - index * batch);
  b.inputs.resize(static_cast<size_t>(b.batch * seq));
  b.targets.resize(static_cast<size_t>(b.batch * seq));
  if (documents) b.positions.resize(static_cast<size_t>(b.batch * seq));
  std::vector<int32_t> window(static_cast<size_t>(seq + 1));
  std::vector<uint8_t> mask(tokens.has_mask() ? static_cast<size_t>(seq + 1) : 0);
  // Window w covers tokens [w*seq, w*seq + seq] (seq+1 tokens): inputs are the first seq, targets the last seq.
  for (int64_t r = 0; r < b.batch; ++r) {
    const int64_t start = (index * batch + r) * seq, have = std::min(seq + 1, n - start);
    tokens.read(start, have, window.data());
    if (!mask.empty()) tokens.read_mask(start, have, mask.data());
    fill_row(b, r, window, have, documents ? tokens.document_separator() : std::nullopt, mask);
  }
  return b;
}

}  // namespace hs::train
