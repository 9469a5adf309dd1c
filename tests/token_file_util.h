// Byte vocabularies and token files the data and training tests share: text as one id per byte, the vocabulary's last
// id separating documents.
#pragma once
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "dataset/token_file.h"

namespace hs::test {

// A vocabulary of `size` ids whose id b < 255 is byte b (one byte of text) and whose last id separates documents.
inline dataset::Vocabulary byte_vocabulary(int64_t size, uint64_t fingerprint = 0x1234) {
  dataset::Vocabulary v;
  v.fingerprint = fingerprint;
  v.size = size;
  v.end_of_text = static_cast<uint32_t>(size - 1);
  v.token_bytes.assign(static_cast<size_t>(size), 1);
  v.token_bytes.back() = 0;
  return v;
}

// The ids of `s` under a byte vocabulary.
inline std::vector<uint32_t> bytes_of(std::string_view s) {
  std::vector<uint32_t> ids;
  for (char c : s) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

// The TokenFileWriter encoder of a byte vocabulary.
inline dataset::Encoder byte_encoder() {
  return [](std::string_view s, int) { return bytes_of(s); };
}

// n bytes of English-like text (words, line breaks, punctuation) drawn by a generator seeded with `seed`.
inline std::string lorem(size_t n, uint32_t seed) {
  static const char* words[] = {"In", "the", "beginning", "God", "created", "heaven", "and", "earth", "\n", ". ", ", "};
  std::mt19937 rng(seed);
  std::string s;
  while (s.size() < n) s += std::string(words[rng() % 11]) + (rng() % 3 ? " " : "");
  s.resize(n);
  return s;
}

// Writes `docs` to a token file at `path` under `vocab`, a byte vocabulary.
inline dataset::TokenFileHeader write_byte_documents(const std::filesystem::path& path, const dataset::Vocabulary& vocab,
                                                     const std::vector<std::string>& docs) {
  dataset::TokenFileWriter w(path, vocab, byte_encoder());
  for (const auto& d : docs) w.add_document(d);
  return w.commit();
}

}  // namespace hs::test
