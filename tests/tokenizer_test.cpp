// The tokenizer against Hugging Face `tokenizers` on the two real Qwen vocabularies (the reference ids are computed
// now by tests/tokenizer_reference.py from the installed package), round trips, streaming decode, the regex
// dialect translation, the parallel encoder's cuts, and refusal of what is not supported.
#include "tokenizer/tokenizer.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "test_util.h"
#include "tokenizer/text.h"

namespace hs::tokenizer {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const fs::path kSource = hs::test::source_dir();
constexpr const char* kSetupHint = " (run scripts/setup.sh: it builds data/tokenizers/ and the .venv peers)";

fs::path qwen_json(const std::string& name) { return kSource / "data" / "tokenizers" / name / "tokenizer.json"; }

// The real tokenizers, loaded once per process.
const Tokenizer& qwen(const std::string& name) {
  static std::map<std::string, Tokenizer> loaded;
  auto it = loaded.find(name);
  if (it == loaded.end()) it = loaded.emplace(name, Tokenizer::load(qwen_json(name).string())).first;
  return it->second;
}

// Fails the calling test (never skips) when the vocabularies are missing.
::testing::AssertionResult have_qwen(const std::string& name) {
  if (fs::exists(qwen_json(name))) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << qwen_json(name) << " is missing" << kSetupHint;
}

std::string escaped(std::string_view s) {
  std::ostringstream o;
  for (size_t i = 0; i < s.size() && i < 160; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7F && c != '\\') {
      o << static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      o << buf;
    }
  }
  if (s.size() > 160) o << "... (" << s.size() << " bytes)";
  return o.str();
}

std::string ids_str(const std::vector<TokenId>& ids) {
  std::ostringstream o;
  for (size_t i = 0; i < ids.size() && i < 40; ++i) o << (i ? " " : "") << ids[i];
  if (ids.size() > 40) o << " ... (" << ids.size() << " ids)";
  return o.str();
}

struct Reference {
  std::vector<std::string> lines;  // the corpus, then all of it joined by '\n'
  std::vector<std::vector<TokenId>> ids;
  std::vector<std::string> beyond14;  // lines with letters newer than PCRE2's Unicode (docs/tokenizer.md)
  std::vector<std::vector<TokenId>> beyond14_ids;
};

uint32_t read_u32(std::istream& in) {
  uint32_t v = 0;
  in.read(reinterpret_cast<char*>(&v), 4);
  return v;
}

// Runs the Python peer for tokenizer `name` and reads what it wrote.
::testing::AssertionResult hf_reference(const std::string& name, const test::TempDir& dir, Reference& ref) {
  const fs::path python = kSource / ".venv" / "bin" / "python";
  if (!fs::exists(python)) return ::testing::AssertionFailure() << python << " is missing" << kSetupHint;
  const fs::path out = dir / "reference.bin";
  const std::string cmd = "'" + python.string() + "' '" + (kSource / "tests" / "tokenizer_reference.py").string() +
                          "' '" + qwen_json(name).string() + "' '" + out.string() + "'";
  if (std::system(cmd.c_str()) != 0)
    return ::testing::AssertionFailure() << "the Python peer failed: " << cmd << kSetupHint;
  std::ifstream in(out, std::ios::binary);
  char magic[4] = {};
  in.read(magic, 4);
  if (std::string_view(magic, 4) != "HSTR") return ::testing::AssertionFailure() << out << " is not a reference";
  const uint32_t n = read_u32(in);
  for (uint32_t i = 0; i < n && in; ++i) {
    std::string line(read_u32(in), '\0');
    in.read(line.data(), static_cast<std::streamsize>(line.size()));
    const uint32_t flags = read_u32(in);
    std::vector<TokenId> ids(read_u32(in));
    in.read(reinterpret_cast<char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
    (flags ? ref.beyond14 : ref.lines).push_back(std::move(line));
    (flags ? ref.beyond14_ids : ref.ids).push_back(std::move(ids));
  }
  if (!in || ref.lines.size() + ref.beyond14.size() != n)
    return ::testing::AssertionFailure() << out << " is truncated";
  return ::testing::AssertionSuccess();
}

void expect_matches_hf(const std::string& name) {
  ASSERT_TRUE(have_qwen(name));
  test::TempDir dir;
  Reference ref;
  ASSERT_TRUE(hf_reference(name, dir, ref));
  ASSERT_GE(ref.lines.size(), 10001u);  // at least 10,000 lines, then all of them joined
  const Tokenizer& tok = qwen(name);
  size_t bad = 0, tokens = 0;
  for (size_t i = 0; i + 1 < ref.lines.size(); ++i) {
    const auto got = tok.encode(ref.lines[i]);
    tokens += got.size();
    if (got != ref.ids[i] && ++bad <= 8)
      ADD_FAILURE() << name << " line " << i << " \"" << escaped(ref.lines[i]) << "\"\n  hybridscan " << ids_str(got)
                    << "\n  tokenizers " << ids_str(ref.ids[i]);
  }
  EXPECT_EQ(bad, 0u) << "of " << ref.lines.size() - 1 << " lines";
  EXPECT_GT(tokens, 100000u);
  // Where the Unicode versions part (docs/tokenizer.md): counted, not compared, so that a newer PCRE2 shows.
  size_t differ = 0;
  for (size_t i = 0; i < ref.beyond14.size(); ++i) differ += tok.encode(ref.beyond14[i]) != ref.beyond14_ids[i];
  std::cout << name << ": " << differ << " of " << ref.beyond14.size()
            << " lines with letters newer than Unicode 14.0 tokenize differently from HF\n";
  // All lines joined by '\n': whole, and cut into pieces as small as 256 bytes (thousands of cuts) on 2 and 3
  // threads, and at the default size.
  const std::string& all = ref.lines.back();
  const auto& want = ref.ids.back();
  EXPECT_TRUE(tok.encode(all) == want) << "the joined corpus";
  for (const auto& [threads, chunk] : {std::pair{2, size_t{256}}, {3, size_t{4096}}, {2, size_t{1} << 16}}) {
    const auto got = tok.encode_parallel(all, threads, chunk);
    EXPECT_TRUE(got == want) << "encode_parallel(" << threads << " threads, " << chunk
                             << "-byte chunks): " << got.size() << " ids vs " << want.size();
  }
}

TEST(Tokenizer, MatchesHuggingFaceQwen2) { expect_matches_hf("qwen2"); }
TEST(Tokenizer, MatchesHuggingFaceQwen35) { expect_matches_hf("qwen3_5"); }

TEST(Tokenizer, QwenVocabularies) {
  ASSERT_TRUE(have_qwen("qwen2"));
  ASSERT_TRUE(have_qwen("qwen3_5"));
  const Tokenizer& q2 = qwen("qwen2");
  const Tokenizer& q35 = qwen("qwen3_5");
  EXPECT_EQ(q2.vocab_size(), 151669);
  EXPECT_EQ(q35.vocab_size(), 248077);
  EXPECT_EQ(q2.end_of_text_id(), 151643u);
  EXPECT_EQ(q35.end_of_text_id(), 248044u);
  EXPECT_EQ(q2.token_to_id("<|im_start|>"), 151644u);
  EXPECT_EQ(q2.token_to_id("<think>"), 151667u);
  EXPECT_TRUE(q2.is_special(151643));
  EXPECT_FALSE(q2.is_special(151667));  // <think> is a plain added token: kept by skip_special_tokens
  EXPECT_FALSE(q2.is_special(0));
  EXPECT_EQ(q2.token_to_id("!"), 0u);
  const auto the = q2.token_to_id("\xC4\xA0the");  // "Ġthe", as tokenizer.json spells " the"
  ASSERT_TRUE(the.has_value());
  EXPECT_EQ(q2.token_bytes(*the), " the");
  EXPECT_EQ(q2.token_to_id("no such token, surely"), std::nullopt);
  EXPECT_EQ(q2.encode(" the"), std::vector<TokenId>{*the});
  EXPECT_THROW(q2.token_bytes(151669), std::out_of_range);
  const std::vector<TokenId> ids = q2.encode("<|im_start|>user\nhi<think>x</think><|im_end|>");
  EXPECT_EQ(q2.decode(ids), "<|im_start|>user\nhi<think>x</think><|im_end|>");
  EXPECT_EQ(q2.decode(ids, true), "user\nhi<think>x</think>");
  EXPECT_EQ(q2.decode(std::vector<TokenId>{151669, 200000}), "");  // ids without a token decode to nothing, as in HF
  EXPECT_NE(q2.fingerprint(), q35.fingerprint());
}

// Random valid UTF-8: code points drawn from every plane (no surrogates), weighted towards the ones text has.
std::string random_text(std::mt19937& rng, size_t n) {
  std::string s;
  std::uniform_int_distribution<int> kind(0, 9);
  for (size_t i = 0; i < n; ++i) {
    char32_t c;
    switch (kind(rng)) {
      case 0:
        c = std::uniform_int_distribution<char32_t>(0, 0x10FFFF)(rng);
        break;
      case 1:
        c = std::uniform_int_distribution<char32_t>(0x300, 0x36F)(rng);
        break;
      case 2:
        c = std::uniform_int_distribution<char32_t>(0x4E00, 0x9FFF)(rng);
        break;
      case 3:
        c = std::uniform_int_distribution<char32_t>(0x1F300, 0x1FAFF)(rng);
        break;
      case 4:
        c = std::uniform_int_distribution<char32_t>(0x0, 0x7F)(rng);
        break;
      case 5:
        c = " \n\t\r"[std::uniform_int_distribution<int>(0, 3)(rng)];
        break;
      case 6:
        c = std::uniform_int_distribution<char32_t>(0x80, 0x7FF)(rng);
        break;
      default:
        c = std::uniform_int_distribution<char32_t>(0x61, 0x7A)(rng);
    }
    if (c >= 0xD800 && c <= 0xDFFF) c = 0xFFFD;
    append_utf8(s, c);
  }
  return s;
}

std::string nfc(const std::string& s) {
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(err);
  std::string out;
  icu::StringByteSink<std::string> sink(&out);
  n->normalizeUTF8(0, icu::StringPiece(s.data(), static_cast<int32_t>(s.size())), sink, nullptr, err);
  EXPECT_TRUE(U_SUCCESS(err));
  return out;
}

TEST(Tokenizer, DecodeInvertsEncodeOnRandomText) {
  ASSERT_TRUE(have_qwen("qwen2"));
  ASSERT_TRUE(have_qwen("qwen3_5"));
  std::mt19937 rng(12);
  for (const char* name : {"qwen2", "qwen3_5"}) {
    const Tokenizer& tok = qwen(name);
    int exact = 0;
    for (int i = 0; i < 1500; ++i) {
      const std::string s = random_text(rng, std::uniform_int_distribution<size_t>(1, 120)(rng));
      ASSERT_TRUE(valid_utf8(s));
      const std::string back = tok.decode(tok.encode(s));
      // The NFC normalizer is part of the tokenizer: what comes back is the NFC form, which is s itself when s is
      // already normalized.
      const std::string want = nfc(s);
      ASSERT_EQ(back, want) << name << " \"" << escaped(s) << "\"";
      exact += want == s;
    }
    EXPECT_GT(exact, 300) << "too few random texts were already NFC to test the exact round trip";
  }
}

TEST(Tokenizer, InvalidUtf8BecomesReplacementCharacters) {
  std::string storage;
  EXPECT_EQ(repair_utf8("abc", storage), "abc");
  const std::pair<std::string, std::string> cases[] = {
      {"\x80", "\uFFFD"},
      {"a\xC3", "a\uFFFD"},
      {"\xE2\x82", "\uFFFD"},  // one maximal subpart
      {"\xE2\x82x", "\uFFFDx"},
      {"\xF0\x9F\x98", "\uFFFD"},
      {"\xC0\xAF", "\uFFFD\uFFFD"},                      // C0 is never a lead
      {"\xE0\x80\xAF", "\uFFFD\uFFFD\uFFFD"},            // E0 needs A0..BF next
      {"\xED\xA0\x80", "\uFFFD\uFFFD\uFFFD"},            // a surrogate
      {"\xF4\x90\x80\x80", "\uFFFD\uFFFD\uFFFD\uFFFD"},  // above U+10FFFF
      {"\xF8\x88\x80\x80\x80", "\uFFFD\uFFFD\uFFFD\uFFFD\uFFFD"},
      {"\xE2\x28\xA1", "\uFFFD(\uFFFD"},
      {"\xF0\x9F\x98\x80\xFF", "\U0001F600\uFFFD"},
  };
  for (const auto& [in, want] : cases) EXPECT_EQ(repair_utf8(in, storage), want) << escaped(in);
}

// A tokenizer.json over the 256 byte tokens (ids 0..255 in byte order) plus `merges` (left, right), each new
// token getting the next id; edit the returned json to vary it.
json small_tokenizer(const std::vector<std::pair<std::string, std::string>>& merges) {
  static const auto spell = [](std::string_view bytes) {
    std::string out;
    for (unsigned char b : bytes) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      int n = 0;
      char32_t cp = b;
      if (!printable) {
        for (int x = 0; x < b; ++x)
          if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE))) ++n;
        cp = static_cast<char32_t>(256 + n);
      }
      append_utf8(out, cp);
    }
    return out;
  };
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[spell(std::string(1, static_cast<char>(b)))] = b;
  json mj = json::array();
  int next = 256;
  for (const auto& [l, r] : merges) {
    vocab[spell(l + r)] = next++;
    mj.push_back(spell(l) + " " + spell(r));
  }
  const json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", json::array({{{"id", next},
                                         {"content", "<|endoftext|>"},
                                         {"special", true},
                                         {"normalized", false},
                                         {"lstrip", false},
                                         {"rstrip", false},
                                         {"single_word", false}}})},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", byte_level},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", vocab},
            {"merges", mj}}}};
}

fs::path write(const test::TempDir& dir, const std::string& name, const std::string& text) {
  const fs::path p = dir / name;
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

const std::vector<std::pair<std::string, std::string>> kSmallMerges = {
    {"t", "h"}, {"th", "e"}, {" ", "the"}, {"h", "e"}, {"a", "a"}, {"aa", "aa"}, {"\xC3", "\xA9"}};

TEST(Tokenizer, SmallBpeMergesByRank) {
  test::TempDir dir;
  const Tokenizer tok = Tokenizer::load(write(dir, "t.json", small_tokenizer(kSmallMerges).dump()).string());
  EXPECT_EQ(tok.vocab_size(), 256 + 7 + 1);
  EXPECT_EQ(tok.encode("the"), (std::vector<TokenId>{257}));
  EXPECT_EQ(tok.encode(" the"), (std::vector<TokenId>{258}));  // t h, th e, then " " the
  EXPECT_EQ(tok.encode("he"), (std::vector<TokenId>{259}));
  EXPECT_EQ(tok.encode("aaaaa"), (std::vector<TokenId>{261, 'a'}));  // aa aa a -> aaaa a: leftmost first
  EXPECT_EQ(tok.encode("aaa"), (std::vector<TokenId>{260, 'a'}));
  EXPECT_EQ(tok.encode("\xC3\xA9t"), (std::vector<TokenId>{262, 't'}));
  EXPECT_EQ(tok.encode("x<|endoftext|>the"), (std::vector<TokenId>{'x', 263, 257}));
  // The GPT-2 regex of ByteLevel(use_regex): " the" is one piece, "the the" two.
  EXPECT_EQ(tok.encode("the the"), (std::vector<TokenId>{257, 258}));
  // A piece long enough for the heap merger gives what the short one gives piecewise.
  std::string run(5001, 'a');
  std::vector<TokenId> want(1250, 261);
  want.push_back('a');
  EXPECT_EQ(tok.encode(run), want);

  // The same vocabulary as vocab.json + merges.txt (no added tokens): the same ids for text without them, and a
  // round trip without normalization for any valid UTF-8.
  const json j = small_tokenizer(kSmallMerges);
  test::TempDir dir2;
  write(dir2, "vocab.json", j["model"]["vocab"].dump());
  std::string merges = "#version: 0.2\n";
  for (const auto& m : j["model"]["merges"]) merges += m.get<std::string>() + "\n";
  write(dir2, "merges.txt", merges);
  const Tokenizer old = Tokenizer::load(dir2.path().string());
  EXPECT_EQ(old.encode("the the aaaaa \xC3\xA9"), tok.encode("the the aaaaa \xC3\xA9"));
  EXPECT_EQ(Tokenizer::load((dir2 / "vocab.json").string()).fingerprint(), old.fingerprint());
  EXPECT_NE(old.fingerprint(), tok.fingerprint());
  std::mt19937 rng(5);
  for (int i = 0; i < 300; ++i) {
    const std::string s = random_text(rng, 60);
    ASSERT_EQ(old.decode(old.encode(s)), s) << escaped(s);
  }
}

TEST(Tokenizer, FingerprintSeesMergesAndAddedTokens) {
  test::TempDir dir;
  const auto fp = [&](const json& j) { return Tokenizer::load(write(dir, "t.json", j.dump()).string()).fingerprint(); };
  const json base = small_tokenizer(kSmallMerges);
  EXPECT_EQ(fp(base), fp(base));  // stable across loads
  json fewer = base;
  fewer["model"]["merges"].erase(fewer["model"]["merges"].end() - 1);
  EXPECT_NE(fp(fewer), fp(base));
  json swapped = base;
  std::swap(swapped["model"]["merges"][4], swapped["model"]["merges"][6]);
  EXPECT_NE(fp(swapped), fp(base));
  json renamed = base;
  renamed["added_tokens"][0]["content"] = "<|eot|>";
  EXPECT_NE(fp(renamed), fp(base));
  json nfc_json = base;
  nfc_json["normalizer"] = {{"type", "NFC"}};
  EXPECT_NE(fp(nfc_json), fp(base));
  // The list form of merges is the same tokenizer.
  json lists = base;
  for (auto& m : lists["model"]["merges"]) {
    const std::string s = m.get<std::string>();
    m = json::array({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  EXPECT_EQ(fp(lists), fp(base));
}

TEST(Tokenizer, StreamDecoderHoldsSplitCharacters) {
  test::TempDir dir;
  const Tokenizer tok = Tokenizer::load(write(dir, "t.json", small_tokenizer(kSmallMerges).dump()).string());
  StreamDecoder sd(tok);
  // U+1F600 as four byte tokens: nothing until the last.
  EXPECT_EQ(sd.push(0xF0), "");
  EXPECT_EQ(sd.push(0x9F), "");
  EXPECT_EQ(sd.push(0x98), "");
  EXPECT_EQ(sd.push(0x80), "\U0001F600");
  EXPECT_EQ(sd.push('a'), "a");
  // Bytes that can never become a character go out at once, as decode() returns them.
  EXPECT_EQ(sd.push(0xFF), "\xFF");
  EXPECT_EQ(sd.push(0xE0), "");
  EXPECT_EQ(sd.push(0x80), "\xE0\x80");  // E0 80 starts no character
  EXPECT_EQ(sd.push(0xE4), "");
  EXPECT_EQ(sd.push(0xB8), "");
  EXPECT_EQ(sd.finish(), "\xE4\xB8");
  EXPECT_EQ(sd.finish(), "");
  StreamDecoder skip(tok, true);
  EXPECT_EQ(skip.push(263), "");
  EXPECT_EQ(skip.push(257), "the");
  StreamDecoder keep(tok);
  EXPECT_EQ(keep.push(263), "<|endoftext|>");
}

TEST(Tokenizer, StreamDecoderMatchesDecodeOnRealText) {
  ASSERT_TRUE(have_qwen("qwen2"));
  const Tokenizer& tok = qwen("qwen2");
  std::mt19937 rng(99);
  for (int i = 0; i < 200; ++i) {
    const std::string s = random_text(rng, 80) + "中文😀👨‍👩‍👧 <|im_end|>";
    const auto ids = tok.encode(s);
    StreamDecoder sd(tok);
    std::string streamed;
    for (TokenId id : ids) {
      const std::string part = sd.push(id);
      ASSERT_TRUE(valid_utf8(part)) << escaped(part);
      streamed += part;
    }
    streamed += sd.finish();
    ASSERT_EQ(streamed, tok.decode(ids));
  }
}

// Every combining mark (each code point whose canonical combining class is above 0 in ICU's Unicode, the newest
// here) after a few base letters, alone, doubled, and before and after one mark of every other class, normalized
// by each form as Hugging Face's normalizers do (they follow the Unicode 9.0 tables of their Rust crate: a mark
// assigned later is a starter to them, which neither reorders nor composes; docs/tokenizer.md), and the ids of both
// Qwen vocabularies for the strings whose characters this Python's Unicode 14.0 (PCRE2's) knows. Today's
// ICU-only normalizer (Unicode 15.0) gave 7,461 of the NFC strings and 6,921 of the ids differently.
TEST(Tokenizer, NormalizerMatchesHuggingFaceOnEveryCombiningMark) {
  ASSERT_TRUE(have_qwen("qwen2"));
  ASSERT_TRUE(have_qwen("qwen3_5"));
  std::vector<char32_t> marks, probes;  // probes: the first mark of each class
  std::vector<bool> seen(256, false);
  for (char32_t c = 0; c < 0x110000; ++c) {
    const uint8_t k = u_getCombiningClass(static_cast<UChar32>(c));
    if (k == 0) continue;
    marks.push_back(c);
    if (!seen[k]) probes.push_back(c);
    seen[k] = true;
  }
  ASSERT_GT(marks.size(), 900u);
  ASSERT_GT(probes.size(), 50u);
  // Latin, Devanagari, Arabic, Malayalam, Lao, Sinhala, Hangul (an LV syllable, which composes with a trailing jamo).
  const std::vector<char32_t> bases = {U'a', U'o', 0x915, 0x627, 0xD15, 0xE81, 0xD9A, 0xAC00};
  std::vector<std::string> inputs;
  auto add = [&](std::initializer_list<char32_t> cs) {
    std::string s;
    for (char32_t c : cs) append_utf8(s, c);
    inputs.push_back(std::move(s));
  };
  for (char32_t m : marks) {
    for (char32_t b : bases) add({b, m});
    add({U'a', m, m});
    add({m});
    for (char32_t p : probes) {
      add({U'a', m, p});
      add({U'a', p, m});
    }
  }
  // And every character with a canonical or compatibility decomposition, alone and fully decomposed (the
  // compositions of characters assigned after 9.0, U+11938 = U+11935 U+11930 say, are not HF's).
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* nfkd = icu::Normalizer2::getNFKDInstance(err);
  const icu::Normalizer2* nfd = icu::Normalizer2::getNFDInstance(err);
  ASSERT_TRUE(U_SUCCESS(err));
  size_t decomposable = 0;
  for (char32_t c = 0; c < 0x110000; ++c) {
    icu::UnicodeString d;
    if ((c >= 0xD800 && c < 0xE000) || !nfkd->getDecomposition(static_cast<UChar32>(c), d)) continue;
    ++decomposable;
    add({c});
    for (const icu::Normalizer2* n : {nfd, nfkd}) {
      icu::UnicodeString full;
      if (!n->getDecomposition(static_cast<UChar32>(c), full)) continue;
      std::string s;
      full.toUTF8String(s);
      inputs.push_back(s);
    }
  }
  ASSERT_GT(decomposable, 9000u);
  test::TempDir dir;
  {
    std::ofstream f(dir / "in.txt", std::ios::binary);
    for (const std::string& s : inputs) f << s << '\n';
  }
  const fs::path python = kSource / ".venv" / "bin" / "python";
  ASSERT_TRUE(fs::exists(python)) << python << kSetupHint;
  const std::string cmd = "'" + python.string() + "' '" + (kSource / "tests" / "normalizer_reference.py").string() +
                          "' '" + (dir / "in.txt").string() + "' '" + (dir / "out.json").string() + "' '" +
                          qwen_json("qwen2").string() + "' '" + qwen_json("qwen3_5").string() + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "the Python peer failed: " << cmd << kSetupHint;
  const nlohmann::json ref = nlohmann::json::parse(std::ifstream(dir / "out.json"));
  const std::pair<const char*, Normalizer::Form> forms[] = {{"NFC", Normalizer::Form::NFC},
                                                            {"NFD", Normalizer::Form::NFD},
                                                            {"NFKC", Normalizer::Form::NFKC},
                                                            {"NFKD", Normalizer::Form::NFKD}};
  for (const auto& [name, form] : forms) {
    const Normalizer n({form});
    const auto& want = ref[name];
    ASSERT_EQ(want.size(), inputs.size());
    size_t bad = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::string storage;
      const std::string got(n.apply(inputs[i], storage));
      if (got != want[i].get<std::string>() && ++bad <= 5)
        ADD_FAILURE() << name << " of \"" << escaped(inputs[i]) << "\": hybridscan \"" << escaped(got)
                      << "\", tokenizers \"" << escaped(want[i].get<std::string>()) << "\"";
    }
    EXPECT_EQ(bad, 0u) << name << ": of " << inputs.size() << " strings";
  }
  for (const char* name : {"qwen2", "qwen3_5"}) {
    const auto& want = ref["ids"][qwen_json(name).string()];
    ASSERT_EQ(want.size(), inputs.size());
    size_t bad = 0, compared = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (want[i].is_null()) continue;
      ++compared;
      const auto got = qwen(name).encode(inputs[i]);
      if (got != want[i].get<std::vector<TokenId>>() && ++bad <= 5)
        ADD_FAILURE() << name << " \"" << escaped(inputs[i]) << "\": hybridscan " << ids_str(got) << ", tokenizers "
                      << ids_str(want[i].get<std::vector<TokenId>>());
    }
    EXPECT_EQ(bad, 0u) << name << ": of " << compared << " strings";
    EXPECT_GT(compared, inputs.size() * 9 / 10);
  }
}

TEST(Tokenizer, RegexDialectFollowsOniguruma) {
  // PCRE2's \s (with UCP) also takes U+180E; Oniguruma's, which HF uses, does not.
  EXPECT_EQ(onig_to_pcre2(R"(\s+(?!\S)|[^\s\p{L}])"),
            R"([\t\n\x{0B}\f\r\x{85}\p{Z}]+(?![^\t\n\x{0B}\f\r\x{85}\p{Z}])|[^\t\n\x{0B}\f\r\x{85}\p{Z}\p{L}])");
  const SplitRegex space(R"(\s+)");
  size_t b = 0, e = 0;
  EXPECT_FALSE(space.find("a\u180Eb", 0, b, e));
  for (const char* s : {"a\u00A0b", "a\u0085b", "a\u2028b", "a\u3000b", "a\u1680b", "a\u202Fb",
                        "a\x0B"
                        "b"}) {
    ASSERT_TRUE(space.find(s, 0, b, e)) << escaped(s);
    EXPECT_EQ(b, 1u);
  }
  EXPECT_FALSE(space.find("a\u200Bb\uFEFFc", 0, b, e));
  for (const char* bad : {R"(\h+)", R"(\bx)", R"([a[b]])", R"([^\S])", R"([\w&&[^a]])"})
    EXPECT_THROW(onig_to_pcre2(bad), std::invalid_argument) << bad;
}

TEST(Tokenizer, ParallelEncodeEqualsSerialOnKjv) {
  ASSERT_TRUE(have_qwen("qwen2"));
  const fs::path kjv = kSource / "data" / "kjv.txt";
  ASSERT_TRUE(fs::exists(kjv)) << kjv << " is missing" << kSetupHint;
  std::ifstream in(kjv, std::ios::binary);
  std::string text(1 << 20, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  const Tokenizer& tok = qwen("qwen2");
  const auto want = tok.encode(text);
  EXPECT_EQ(tok.encode_parallel(text, 2), want);
  EXPECT_EQ(tok.encode_parallel(text, 4, 1000), want);
}

void expect_refused(const test::TempDir& dir, const json& j, const std::string& part) {
  const fs::path p = write(dir, "bad.json", j.dump());
  const std::string msg = test::error_of([&] { Tokenizer::load(p.string()); });
  EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find(part), std::string::npos) << "wanted \"" << part << "\" in: " << msg;
}

TEST(Tokenizer, RefusesWhatItDoesNotSupport) {
  test::TempDir dir;
  const json base = small_tokenizer(kSmallMerges);
  auto with = [&](const std::function<void(json&)>& edit) {
    json j = base;
    edit(j);
    return j;
  };
  expect_refused(dir, with([](json& j) { j["model"]["type"] = "WordPiece"; }), "model type \"WordPiece\"");
  expect_refused(dir, with([](json& j) { j["model"]["type"] = "Unigram"; }), "Unigram");
  expect_refused(dir, with([](json& j) {
                   j["normalizer"] = {{"type", "Lowercase"}};
                 }),
                 "normalizer type \"Lowercase\"");
  expect_refused(dir, with([](json& j) {
                   j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "Strip"}}}}};
                 }),
                 "\"Strip\"");
  expect_refused(dir, with([](json& j) {
                   j["pre_tokenizer"] = {{"type", "Whitespace"}};
                 }),
                 "pre_tokenizer type \"Whitespace\"");
  expect_refused(dir, with([](json& j) { j["pre_tokenizer"] = nullptr; }), "pre_tokenizer is null");
  expect_refused(
      dir, with([](json& j) {
        j["pre_tokenizer"] = {
            {"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Removed"}, {"invert", false}},
              j["decoder"]}}};
      }),
      "behavior \"Removed\"");
  expect_refused(
      dir, with([](json& j) {
        j["pre_tokenizer"] = {
            {"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", "\\h+"}}}, {"behavior", "Isolated"}, {"invert", false}},
              j["decoder"]}}};
      }),
      "\\h");
  expect_refused(dir, with([](json& j) { j["pre_tokenizer"]["add_prefix_space"] = true; }), "add_prefix_space");
  expect_refused(dir, with([](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }), "decoder \"WordPiece\"");
  expect_refused(dir, with([](json& j) {
                   j["post_processor"] = {{"type", "TemplateProcessing"}};
                 }),
                 "TemplateProcessing");
  expect_refused(dir, with([](json& j) { j["model"]["byte_fallback"] = true; }), "byte_fallback");
  expect_refused(dir, with([](json& j) { j["model"]["dropout"] = 0.1; }), "dropout");
  expect_refused(dir, with([](json& j) { j["truncation"] = {{"max_length", 8}}; }), "truncation");
  expect_refused(dir, with([](json& j) { j["added_tokens"][0]["lstrip"] = true; }), "lstrip");
  expect_refused(dir, with([](json& j) { j["added_tokens"][0]["single_word"] = true; }), "single_word");
  expect_refused(dir, with([](json& j) { j["model"]["vocab"].erase("a"); }), "byte 97");
  expect_refused(dir, with([](json& j) { j["model"]["merges"].push_back("Q Z"); }), "not in the vocab");
  expect_refused(dir, with([](json& j) { j["model"]["merges"].push_back("abc"); }), "not two tokens");
  expect_refused(dir, with([](json& j) { j["model"]["vocab"]["x"] = "seven"; }), "malformed");
  expect_refused(dir, with([](json& j) { j.erase("model"); }), "no \"model\"");

  const std::string text = base.dump();
  for (const std::string& broken : {text.substr(0, text.size() / 2), text.substr(0, text.size() - 1), std::string("{]"),
                                    std::string(""), std::string("\x89PNG\r\n")}) {
    const fs::path p = write(dir, "broken.json", broken);
    const std::string msg = test::error_of([&] { Tokenizer::load(p.string()); });
    EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;
  }
  EXPECT_NE(test::error_of([&] { Tokenizer::load((dir / "missing.json").string()); }).find("no such file"),
            std::string::npos);
  test::TempDir empty;
  EXPECT_NE(test::error_of([&] { Tokenizer::load(empty.path().string()); }).find("neither tokenizer.json"),
            std::string::npos);
}

}  // namespace
}  // namespace hs::tokenizer
