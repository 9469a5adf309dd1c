// The Unicode steps in front of BPE: repairing invalid UTF-8, normalization (ICU's, cut to Hugging Face's Unicode
// 9.0) and the split regex (PCRE2, with
// Oniguruma's meaning of the classes that the two dialects define differently).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace hs::tokenizer {

// `text` with every maximal subpart of an ill-formed UTF-8 sequence replaced by U+FFFD (what Python's
// bytes.decode("utf-8", errors="replace") does). Returns `text` itself when it is valid; otherwise the repaired
// copy, kept in `storage`.
std::string_view repair_utf8(std::string_view text, std::string& storage);

bool valid_utf8(std::string_view text);

// The length of the UTF-8 character whose first byte is `lead` (valid UTF-8 assumed).
size_t utf8_length(unsigned char lead);

// The code point of the (valid) UTF-8 character at s[i].
char32_t decode_utf8(std::string_view s, size_t i);

// Appends the UTF-8 encoding of c.
void append_utf8(std::string& out, char32_t c);

// A chain of Unicode normalization forms (HF's normalizers NFC / NFD / NFKC / NFKD and Sequences of them), as HF
// computes them: with the tables of Unicode 9.0, so that a character assigned later (a combining mark of Unicode 10
// or newer, say) is a starter that is neither reordered nor composed (docs/tokenizer.md).
class Normalizer {
 public:
  enum class Form : uint8_t { NFC, NFD, NFKC, NFKD };
  explicit Normalizer(std::vector<Form> forms);
  bool empty() const { return forms_.empty(); }
  // `text` (valid UTF-8) normalized: `text` itself when already normalized, otherwise the result kept in
  // `storage`.
  std::string_view apply(std::string_view text, std::string& storage) const;
  std::string describe() const;  // "NFC", "NFC,NFKD": part of the fingerprint

 private:
  std::vector<Form> forms_;
  // ICU's normalizer of each form, cut to the code points of Hugging Face's Unicode (text.cpp).
  // (icu::FilteredNormalizer2, held type-erased to keep ICU's headers out of this one).
  std::vector<std::shared_ptr<const void>> icu_;
};

// A split regex written in the Oniguruma dialect tokenizer.json uses, compiled by PCRE2 (UTF, UCP, JIT).
class SplitRegex {
 public:
  explicit SplitRegex(const std::string& onig_pattern);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;
  const std::string& pattern() const { return onig_pattern_; }
  // The first non-empty match in s (valid UTF-8) starting at or after `from`: false when there is none.
  bool find(std::string_view s, size_t from, size_t& begin, size_t& end) const;

 private:
  std::string onig_pattern_;
  void* code_ = nullptr;  // pcre2_code_8
};

// The PCRE2 pattern meaning what `onig_pattern` means to Oniguruma (Hugging Face's regex engine): \s and \S are
// spelled out as Oniguruma's Unicode set (U+0009-000D, U+0085 and \p{Z}; PCRE2 adds U+180E), \w / \W as
// Letter | Mark | Decimal_Number | Connector_Punctuation. Throws std::invalid_argument for what the two dialects
// read differently and this translation does not cover (\h, \b, nested classes, \S inside a class, ...).
std::string onig_to_pcre2(std::string_view onig_pattern);

}  // namespace hs::tokenizer
