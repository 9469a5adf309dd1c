#include "dataset/vocabulary.h"

namespace hs::dataset {

Vocabulary vocabulary_of(const tokenizer::Tokenizer& t) {
  Vocabulary v;
  v.fingerprint = t.fingerprint();
  v.size = t.vocab_size();
  v.end_of_text = t.end_of_text_id();
  v.token_bytes.resize(static_cast<size_t>(v.size));
  for (int64_t id = 0; id < v.size; ++id) {
    const size_t n = t.token_bytes(static_cast<tokenizer::TokenId>(id)).size();
    if (n > 0xFFFF) throw std::runtime_error("token " + std::to_string(id) + " is " + std::to_string(n) +
                                             " bytes long, more than a token file records (65535)");
    v.token_bytes[static_cast<size_t>(id)] = static_cast<uint16_t>(n);
  }
  // The writer adds the separators; they stand for no text.
  if (v.end_of_text) v.token_bytes[*v.end_of_text] = 0;
  return v;
}

Encoder encoder_of(const tokenizer::Tokenizer& t) {
  return [t](std::string_view text, int threads) {
    return threads > 1 ? t.encode_parallel(text, threads) : t.encode(text);
  };
}

}  // namespace hs::dataset
