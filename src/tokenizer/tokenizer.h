// Hugging Face byte-level BPE tokenizers (the kind Qwen2 / Qwen3 / Qwen3-Next / Qwen3.5 ship as tokenizer.json):
// added and special tokens, NFC normalization, the split pre-tokenizer's Unicode-class regex, the byte-level
// mapping, BPE merges and the byte-level decoder. Ids equal those of the Hugging Face `tokenizers` library.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hs::tokenizer {

using TokenId = uint32_t;

class Tokenizer {
 public:
  // `path`: a tokenizer.json, or a directory holding tokenizer.json (or vocab.json + merges.txt).
  // Throws std::runtime_error naming the file and what is wrong with it.
  static Tokenizer load(const std::string& path);

  // The ids Hugging Face `tokenizers` gives for encode(text, add_special_tokens=False): added and special tokens
  // written in the text are recognised as such. Invalid UTF-8 is read as U+FFFD per maximal subpart (what Python's
  // bytes.decode("utf-8", errors="replace") makes of it). Thread-safe.
  std::vector<TokenId> encode(std::string_view text) const;
  // The same ids as encode(text), computed on `threads` threads (the text is cut only where no pre-token can
  // straddle the cut, into pieces of at least `min_chunk_bytes`; texts under two of them are encoded serially).
  std::vector<TokenId> encode_parallel(std::string_view text, int threads, size_t min_chunk_bytes = 1 << 16) const;
  // The text of `ids` (byte-level decoder); bytes that do not form valid UTF-8 are returned as they are.
  std::string decode(std::span<const TokenId> ids, bool skip_special_tokens = false) const;

  int64_t vocab_size() const;  // the highest id + 1, added tokens included
  // A hash of everything that decides the ids (vocabulary, merges, added tokens, normalizer, split regex): the
  // same on every machine and run; token files record it so that data and model are never silently mismatched.
  uint64_t fingerprint() const;
  std::optional<TokenId> token_to_id(std::string_view token) const;  // a vocabulary or added token, as written
  std::optional<TokenId> end_of_text_id() const;                      // "<|endoftext|>" when the vocabulary has it
  bool is_special(TokenId id) const;
  // The bytes token `id` decodes to on its own (may be part of a UTF-8 character).
  std::string token_bytes(TokenId id) const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

// Decodes ids one at a time for streaming output: push() returns only complete UTF-8 characters; the bytes of a
// character split across tokens wait for the rest. finish() returns whatever is left.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  std::string push(TokenId id);
  std::string finish();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace hs::tokenizer
