#include "tokenizer/text.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uniset.h>
#include <unicode/unistr.h>

#include <cstring>
#include <stdexcept>

namespace hs::tokenizer {

namespace {

bool all_ascii(std::string_view s) {
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    if (w & 0x8080808080808080ull) return false;
  }
  for (; i < s.size(); ++i)
    if (static_cast<unsigned char>(s[i]) & 0x80) return false;
  return true;
}

// The length of the well-formed UTF-8 sequence at s[i], or 0 when it is ill-formed there; in that case `subpart`
// is the length of its maximal subpart (at least 1), the bytes one U+FFFD replaces (Unicode 15, section 3.9).
size_t well_formed_at(std::string_view s, size_t i, size_t& subpart) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) return 1;
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    subpart = 1;
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) {
      subpart = k;
      return 0;
    }
    const auto c = static_cast<unsigned char>(s[i + k]);
    if (k == 1 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) {
      subpart = k;
      return 0;
    }
  }
  return need + 1;
}

// The length of the longest prefix of `text` that is well-formed UTF-8.
size_t valid_prefix(std::string_view text) {
  size_t i = 0, sub = 0;
  while (i < text.size()) {
    if (static_cast<unsigned char>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = well_formed_at(text, i, sub);
    if (n == 0) break;
    i += n;
  }
  return i;
}

}  // namespace

bool valid_utf8(std::string_view text) { return valid_prefix(text) == text.size(); }

std::string_view repair_utf8(std::string_view text, std::string& storage) {
  size_t i = valid_prefix(text), sub = 0;
  if (i == text.size()) return text;
  storage.assign(text.data(), i);
  storage.reserve(text.size() + 16);
  while (i < text.size()) {
    const size_t n = well_formed_at(text, i, sub);
    if (n) {
      storage.append(text.data() + i, n);
      i += n;
    } else {
      storage.append("\xEF\xBF\xBD");
      i += sub;
    }
  }
  return storage;
}

size_t utf8_length(unsigned char lead) {
  if (lead < 0xC0) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  return 4;
}

char32_t decode_utf8(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[i + k])); };
  switch (utf8_length(static_cast<unsigned char>(s[i]))) {
    case 1:
      return b(0);
    case 2:
      return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3:
      return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default:
      return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

namespace {
// The code points Hugging Face's normalizers know: those assigned in Unicode 9.0, the version of the tables in their
// Rust crate (unicode-normalization-alignments 0.1.12). A later character is unassigned to them: a starter without
// a decomposition, which blocks and takes part in no composition. ICU's FilteredNormalizer2 gives exactly that:
// text outside the set is passed through and bounds the normalized spans around it. The normalization properties
// of an assigned character never change (Unicode's stability policy), so ICU's newer data, cut to 9.0, is 9.0's.
const icu::UnicodeSet& hf_code_points() {
  static const icu::UnicodeSet* set = [] {
    UErrorCode err = U_ZERO_ERROR;
    auto* s = new icu::UnicodeSet(icu::UnicodeString(u"[:age=9.0:]"), err);
    if (U_FAILURE(err)) throw std::runtime_error(std::string("tokenizer: ICU [:age=9.0:]: ") + u_errorName(err));
    s->freeze();
    return s;
  }();
  return *set;
}
}  // namespace

Normalizer::Normalizer(std::vector<Form> forms) : forms_(std::move(forms)) {
  for (Form f : forms_) {
    UErrorCode err = U_ZERO_ERROR;
    const icu::Normalizer2* n = f == Form::NFC    ? icu::Normalizer2::getNFCInstance(err)
                                : f == Form::NFD  ? icu::Normalizer2::getNFDInstance(err)
                                : f == Form::NFKC ? icu::Normalizer2::getNFKCInstance(err)
                                                  : icu::Normalizer2::getNFKDInstance(err);
    if (U_FAILURE(err)) throw std::runtime_error(std::string("tokenizer: ICU normalizer: ") + u_errorName(err));
    icu_.push_back(std::make_shared<icu::FilteredNormalizer2>(*n, hf_code_points()));
  }
}

std::string_view Normalizer::apply(std::string_view text, std::string& storage) const {
  // Every form leaves ASCII as it is, and most training text is ASCII.
  if (forms_.empty() || all_ascii(text)) return text;
  std::string next;
  std::string_view cur = text;
  for (const auto& p : icu_) {
    const auto* n = static_cast<const icu::FilteredNormalizer2*>(p.get());
    UErrorCode err = U_ZERO_ERROR;
    const icu::StringPiece piece(cur.data(), static_cast<int32_t>(cur.size()));
    if (n->isNormalizedUTF8(piece, err) && U_SUCCESS(err)) continue;
    err = U_ZERO_ERROR;
    next.clear();
    icu::StringByteSink<std::string> sink(&next, static_cast<int32_t>(cur.size()) + 16);
    n->normalizeUTF8(0, piece, sink, nullptr, err);
    if (U_FAILURE(err))
      throw std::runtime_error(std::string("tokenizer: ICU normalization failed: ") + u_errorName(err));
    storage.swap(next);
    cur = storage;
  }
  return cur;
}

std::string Normalizer::describe() const {
  std::string out;
  for (Form f : forms_) {
    if (!out.empty()) out += ',';
    out += f == Form::NFC ? "NFC" : f == Form::NFD ? "NFD" : f == Form::NFKC ? "NFKC" : "NFKD";
  }
  return out;
}

std::string onig_to_pcre2(std::string_view p) {
  static constexpr std::string_view kSpace = "\\t\\n\\x{0B}\\f\\r\\x{85}\\p{Z}";
  static constexpr std::string_view kWord = "\\p{L}\\p{M}\\p{Nd}\\p{Pc}";
  std::string out;
  bool in_class = false;
  const auto unsupported = [&](std::string_view what) {
    throw std::invalid_argument("split regex uses " + std::string(what) +
                                ", which Oniguruma and PCRE2 read differently: " + std::string(p));
  };
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\') {
      if (i + 1 == p.size()) unsupported("a trailing backslash");
      const char e = p[++i];
      switch (e) {
        case 's':
        case 'w': {
          const std::string_view set = e == 's' ? kSpace : kWord;
          if (in_class) {
            out += set;
          } else {
            out += '[';
            out += set;
            out += ']';
          }
          break;
        }
        case 'S':
        case 'W':
          if (in_class) unsupported("\\S or \\W inside a character class");
          out += "[^";
          out += e == 'S' ? kSpace : kWord;
          out += ']';
          break;
        case 'h':
        case 'H':
        case 'b':
        case 'B':
        case 'R':
        case 'X':
        case 'K':
        case 'G':
        case 'A':
        case 'z':
        case 'Z':
          unsupported(std::string("\\") + e);
          break;
        default:
          out += c;
          out += e;
      }
      continue;
    }
    if (c == '[') {
      if (in_class) {
        if (i + 1 < p.size() && p[i + 1] == ':') unsupported("a POSIX bracket class");
        unsupported("a nested character class");
      }
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a leading ']' is a literal in both dialects
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    if (c == '&' && in_class && i + 1 < p.size() && p[i + 1] == '&') unsupported("class intersection &&");
    out += c;
  }
  return out;
}

namespace {

// Per-thread PCRE2 match state: match data for one pair and a JIT stack big enough for long runs.
struct MatchScratch {
  pcre2_match_data_8* data = pcre2_match_data_create_8(1, nullptr);
  pcre2_jit_stack_8* stack = pcre2_jit_stack_create_8(32 * 1024, 8 * 1024 * 1024, nullptr);
  pcre2_match_context_8* context = pcre2_match_context_create_8(nullptr);
  MatchScratch() {
    if (!data || !stack || !context) throw std::bad_alloc();
    pcre2_jit_stack_assign_8(context, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_match_context_free_8(context);
    pcre2_jit_stack_free_8(stack);
    pcre2_match_data_free_8(data);
  }
  MatchScratch(const MatchScratch&) = delete;
  MatchScratch& operator=(const MatchScratch&) = delete;
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

}  // namespace

SplitRegex::SplitRegex(const std::string& onig_pattern) : onig_pattern_(onig_pattern) {
  const std::string pat = onig_to_pcre2(onig_pattern);
  int err = 0;
  PCRE2_SIZE off = 0;
  code_ = pcre2_compile_8(reinterpret_cast<PCRE2_SPTR8>(pat.data()), pat.size(), PCRE2_UTF | PCRE2_UCP, &err, &off,
                          nullptr);
  if (!code_) {
    PCRE2_UCHAR8 msg[256];
    pcre2_get_error_message_8(err, msg, sizeof msg);
    throw std::invalid_argument("split regex does not compile at offset " + std::to_string(off) + " (" +
                                reinterpret_cast<const char*>(msg) + "): " + onig_pattern);
  }
  const int jit = pcre2_jit_compile_8(static_cast<pcre2_code_8*>(code_), PCRE2_JIT_COMPLETE);
  if (jit != 0) {
    pcre2_code_free_8(static_cast<pcre2_code_8*>(code_));
    throw std::runtime_error("tokenizer: PCRE2 JIT compilation failed (error " + std::to_string(jit) + ")");
  }
}

SplitRegex::~SplitRegex() { pcre2_code_free_8(static_cast<pcre2_code_8*>(code_)); }

bool SplitRegex::find(std::string_view s, size_t from, size_t& begin, size_t& end) const {
  MatchScratch& m = scratch();
  const auto* code = static_cast<const pcre2_code_8*>(code_);
  while (from < s.size()) {
    const int rc =
        pcre2_jit_match_8(code, reinterpret_cast<PCRE2_SPTR8>(s.data()), s.size(), from, 0, m.data, m.context);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR8 msg[256];
      pcre2_get_error_message_8(rc, msg, sizeof msg);
      throw std::runtime_error(std::string("tokenizer: split regex match failed: ") +
                               reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer_8(m.data);
    if (ov[1] > ov[0]) {
      begin = ov[0];
      end = ov[1];
      return true;
    }
    // An empty match splits nothing (HF drops empty pieces): look again one character on.
    if (ov[0] >= s.size()) return false;
    from = ov[0] + utf8_length(static_cast<unsigned char>(s[ov[0]]));
  }
  return false;
}

}  // namespace hs::tokenizer
