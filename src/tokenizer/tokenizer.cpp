#include "tokenizer/tokenizer.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <unordered_map>

#include "tokenizer/bpe.h"
#include "tokenizer/text.h"

namespace hs::tokenizer {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The split patterns of GPT-2 (ByteLevel use_regex), Qwen2 / Qwen3 and Qwen3.5, in tokenizer.json's dialect.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen35Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2's byte <-> printable character table: tokenizer.json spells every token's bytes with it.
struct ByteAlphabet {
  char32_t byte_to_cp[256];
  int16_t cp_to_byte[324];
  ByteAlphabet() {
    std::fill(std::begin(cp_to_byte), std::end(cp_to_byte), int16_t{-1});
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_to_cp[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
  // The bytes a byte-level token string stands for; false when it has a character outside the alphabet.
  bool to_bytes(std::string_view token, std::string& out) const {
    out.clear();
    if (!valid_utf8(token)) return false;
    for (size_t i = 0; i < token.size(); i += utf8_length(static_cast<unsigned char>(token[i]))) {
      const char32_t cp = decode_utf8(token, i);
      if (cp >= 324 || cp_to_byte[cp] < 0) return false;
      out += static_cast<char>(cp_to_byte[cp]);
    }
    return true;
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw std::runtime_error("tokenizer: " + file + ": " + what);
}

struct Fnv1a {
  uint64_t h = 0xcbf29ce484222325ull;
  void bytes(const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 0x100000001b3ull;
  }
  void u64(uint64_t v) { bytes(&v, sizeof v); }  // little-endian hosts only, as the engine is
  void str(std::string_view s) {
    u64(s.size());
    bytes(s.data(), s.size());
  }
};

// Leftmost-longest matching of added tokens (what HF's Aho-Corasick with MatchKind::LeftmostLongest finds).
class AddedMatcher {
 public:
  void add(const std::string& content, TokenId id) {
    auto& bucket = by_first_[static_cast<unsigned char>(content[0])];
    bucket.push_back({content, id});
    std::stable_sort(bucket.begin(), bucket.end(),
                     [](const Entry& a, const Entry& b) { return a.content.size() > b.content.size(); });
    if (!is_first_[static_cast<unsigned char>(content[0])]) {
      is_first_[static_cast<unsigned char>(content[0])] = true;
      firsts_ += content[0];
    }
  }
  bool empty() const { return firsts_.empty(); }
  bool any_contains_inner_newline() const {
    for (const auto& bucket : by_first_)
      for (const Entry& e : bucket)
        if (e.content.find('\n') < e.content.size() - 1) return true;
    return false;
  }
  // Calls gap(text) for the text between matches and token(id) for each match, in order.
  template <typename Gap, typename Token>
  void split(std::string_view s, Gap&& gap, Token&& token) const {
    size_t start = 0, i = 0;
    while (i < s.size()) {
      if (firsts_.size() == 1) {
        const void* p = std::memchr(s.data() + i, firsts_[0], s.size() - i);
        if (!p) break;
        i = static_cast<size_t>(static_cast<const char*>(p) - s.data());
      } else if (!is_first_[static_cast<unsigned char>(s[i])]) {
        ++i;
        continue;
      }
      const Entry* hit = nullptr;
      for (const Entry& e : by_first_[static_cast<unsigned char>(s[i])])
        if (s.compare(i, e.content.size(), e.content) == 0) {
          hit = &e;
          break;
        }
      if (!hit) {
        ++i;
        continue;
      }
      if (i > start) gap(s.substr(start, i - start));
      token(hit->id);
      i += hit->content.size();
      start = i;
    }
    if (start < s.size()) gap(s.substr(start));
  }

 private:
  struct Entry {
    std::string content;
    TokenId id;
  };
  std::array<std::vector<Entry>, 256> by_first_;
  std::array<bool, 256> is_first_{};
  std::string firsts_;
};

enum class Kind : uint8_t { None, Vocab, Added, Special };

// Per-thread memo of short pieces -> ids: most words recur, and a hit skips the merging. Direct-mapped, so it
// stays bounded; it belongs to one tokenizer at a time (`owner`, a serial number never reused).
struct PieceCache {
  static constexpr size_t kSlots = 1 << 14;
  static constexpr size_t kMaxPiece = 32;
  struct Slot {
    std::string key;
    std::vector<TokenId> ids;
  };
  uint64_t owner = 0;
  std::vector<Slot> slots;
};

std::atomic<uint64_t> next_serial{1};

}  // namespace

struct Tokenizer::Impl {
  std::vector<std::string> bytes_of;  // per id: the bytes it decodes to
  std::vector<Kind> kind;
  std::unordered_map<std::string, TokenId> vocab;   // the model's tokens, by their bytes
  std::unordered_map<std::string, TokenId> added;   // added tokens, by content
  std::vector<std::pair<TokenId, TokenId>> merges;  // by rank
  std::unique_ptr<BpeMerges> bpe;
  bool ignore_merges = false;
  Normalizer normalizer{{}};
  std::vector<std::unique_ptr<SplitRegex>> splits;
  AddedMatcher raw_added, normalized_added;
  bool cut_after_newline = false;
  uint64_t fingerprint = 0;
  uint64_t serial = next_serial++;

  void encode_valid(std::string_view text, std::vector<TokenId>& out) const {
    if (raw_added.empty()) return encode_unmatched(text, out);
    raw_added.split(
        text, [&](std::string_view gap) { encode_unmatched(gap, out); }, [&](TokenId id) { out.push_back(id); });
  }

  // Text between the added tokens that are matched before normalization.
  void encode_unmatched(std::string_view text, std::vector<TokenId>& out) const {
    std::string storage;
    const std::string_view norm = normalizer.apply(text, storage);
    if (normalized_added.empty()) return split(norm, 0, out);
    normalized_added.split(
        norm, [&](std::string_view gap) { split(gap, 0, out); }, [&](TokenId id) { out.push_back(id); });
  }

  // HF's Split(Isolated) pre-tokenizers in turn: the matches and the text between them are the pieces.
  void split(std::string_view s, size_t level, std::vector<TokenId>& out) const {
    if (level == splits.size()) return piece(s, out);
    const SplitRegex& re = *splits[level];
    size_t at = 0, b = 0, e = 0;
    while (at < s.size() && re.find(s, at, b, e)) {
      if (b > at) split(s.substr(at, b - at), level + 1, out);
      split(s.substr(b, e - b), level + 1, out);
      at = e;
    }
    if (at < s.size()) split(s.substr(at), level + 1, out);
  }

  void piece(std::string_view p, std::vector<TokenId>& out) const {
    if (p.size() > PieceCache::kMaxPiece) return merge(p, out);
    thread_local PieceCache cache;
    if (cache.owner != serial) {
      cache.slots.assign(PieceCache::kSlots, {});
      cache.owner = serial;
    }
    PieceCache::Slot& slot = cache.slots[std::hash<std::string_view>{}(p) & (PieceCache::kSlots - 1)];
    if (slot.key != p) {
      slot.key.assign(p);
      slot.ids.clear();
      merge(p, slot.ids);
    }
    out.insert(out.end(), slot.ids.begin(), slot.ids.end());
  }

  void merge(std::string_view p, std::vector<TokenId>& out) const {
    if (ignore_merges) {
      const auto it = vocab.find(std::string(p));
      if (it != vocab.end()) return out.push_back(it->second);
    }
    bpe->encode(p, out);
  }
};

namespace {

using Impl = Tokenizer::Impl;

std::vector<Normalizer::Form> parse_normalizer(const json& n, const std::string& file) {
  if (n.is_null()) return {};
  const std::string type = n.value("type", "");
  if (type == "NFC") return {Normalizer::Form::NFC};
  if (type == "NFD") return {Normalizer::Form::NFD};
  if (type == "NFKC") return {Normalizer::Form::NFKC};
  if (type == "NFKD") return {Normalizer::Form::NFKD};
  if (type == "Sequence") {
    std::vector<Normalizer::Form> out;
    for (const json& m : n.at("normalizers")) {
      const auto part = parse_normalizer(m, file);
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  }
  fail(file, "unsupported normalizer type \"" + type + "\" (supported: NFC, NFD, NFKC, NFKD, Sequence of them, null)");
}

void add_split(Impl& t, const std::string& pattern, const std::string& file) {
  try {
    t.splits.push_back(std::make_unique<SplitRegex>(pattern));
  } catch (const std::invalid_argument& e) {
    fail(file, std::string("pre_tokenizer: ") + e.what());
  }
}

// Reads pre-tokenizer `p` into t.splits; returns true once the ByteLevel step has been read (it must come last).
bool parse_pre_tokenizer(Impl& t, const json& p, const std::string& file, bool byte_level_seen) {
  if (p.is_null()) fail(file, "pre_tokenizer is null; only byte-level BPE (a ByteLevel pre-tokenizer) is supported");
  const std::string type = p.value("type", "");
  if (byte_level_seen) fail(file, "pre_tokenizer \"" + type + "\" after ByteLevel is not supported");
  if (type == "Sequence") {
    for (const json& q : p.at("pretokenizers")) byte_level_seen = parse_pre_tokenizer(t, q, file, byte_level_seen);
    return byte_level_seen;
  }
  if (type == "Split") {
    const json& pat = p.at("pattern");
    if (!pat.contains("Regex"))
      fail(file, "pre_tokenizer Split with a String pattern is not supported (only {\"Regex\": ...})");
    const std::string behavior = p.value("behavior", "");
    if (behavior != "Isolated")
      fail(file, "pre_tokenizer Split behavior \"" + behavior + "\" is not supported (only Isolated)");
    if (p.value("invert", false)) fail(file, "pre_tokenizer Split with invert true is not supported");
    add_split(t, pat.at("Regex").get<std::string>(), file);
    return false;
  }
  if (type == "ByteLevel") {
    if (p.value("add_prefix_space", false))
      fail(file, "pre_tokenizer ByteLevel with add_prefix_space true is not supported");
    if (p.value("use_regex", true)) add_split(t, std::string(kGpt2Pattern), file);
    return true;
  }
  fail(file, "unsupported pre_tokenizer type \"" + type + "\" (supported: Split, ByteLevel, Sequence of them)");
}

void add_token(Impl& t, TokenId id, std::string bytes, Kind kind) {
  if (id >= t.bytes_of.size()) {
    t.bytes_of.resize(id + 1);
    t.kind.resize(id + 1, Kind::None);
  }
  t.bytes_of[id] = std::move(bytes);
  t.kind[id] = kind;
}

// The model's vocabulary (token string -> id, tokens spelled in the byte alphabet).
void read_vocab(Impl& t, const std::vector<std::pair<std::string, int64_t>>& vocab, const std::string& file) {
  t.vocab.reserve(vocab.size());
  std::string bytes;
  for (const auto& [token, id] : vocab) {
    if (id < 0 || id > INT32_MAX)
      fail(file, "vocab id " + std::to_string(id) + " of \"" + token + "\" is out of range");
    // A token outside the byte alphabet cannot come out of byte-level text; it decodes to its own UTF-8.
    if (!alphabet().to_bytes(token, bytes)) bytes = token;
    t.vocab[bytes] = static_cast<TokenId>(id);  // a key given twice keeps its last id, as a JSON map does
    add_token(t, static_cast<TokenId>(id), bytes, Kind::Vocab);
  }
}

// Merges in rank order, each as its two token strings.
void read_merges(Impl& t, const std::vector<std::pair<std::string, std::string>>& merges, const std::string& file) {
  uint32_t byte_ids[256];
  for (int b = 0; b < 256; ++b) {
    const auto it = t.vocab.find(std::string(1, static_cast<char>(b)));
    if (it == t.vocab.end())
      fail(file, "the vocab has no token for byte " + std::to_string(b) + " (byte-level BPE needs all 256)");
    byte_ids[b] = it->second;
  }
  t.bpe = std::make_unique<BpeMerges>(byte_ids);
  t.bpe->reserve(merges.size());
  t.merges.reserve(merges.size());
  std::string a, b;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    if (!alphabet().to_bytes(left, a) || !alphabet().to_bytes(right, b))
      fail(file, "merge " + std::to_string(rank) + " (\"" + left + "\", \"" + right + "\") is not byte-level");
    const auto l = t.vocab.find(a), r = t.vocab.find(b), m = t.vocab.find(a + b);
    if (l == t.vocab.end() || r == t.vocab.end() || m == t.vocab.end())
      fail(file,
           "merge " + std::to_string(rank) + " (\"" + left + "\", \"" + right + "\") uses a token not in the vocab");
    t.bpe->add(l->second, r->second, static_cast<uint32_t>(rank), m->second);
    t.merges.emplace_back(l->second, r->second);
  }
}

bool is_known_pattern(std::string_view p) { return p == kGpt2Pattern || p == kQwen2Pattern || p == kQwen35Pattern; }

void finish(Impl& t) {
  // Cutting the text right after '\n' when a letter or an ASCII graphic character follows splits no pre-token of
  // the three known patterns: every alternative that can take a '\n' ends with a greedy [\r\n]* or [\r\n]+ or a
  // \s run, none of which can go on into a non-space character, and no alternative starts with '\n' followed by
  // more (the optional prefixes exclude \r\n). '\n' never composes under any normalization form, and no added
  // token may straddle the cut.
  t.cut_after_newline =
      !t.splits.empty() && !t.raw_added.any_contains_inner_newline() &&
      !t.normalized_added.any_contains_inner_newline() &&
      std::all_of(t.splits.begin(), t.splits.end(), [](const auto& s) { return is_known_pattern(s->pattern()); });
  Fnv1a h;
  h.str("hybridscan tokenizer v1");
  h.str(t.normalizer.describe());
  h.u64(t.splits.size());
  for (const auto& s : t.splits) h.str(s->pattern());
  h.u64(t.ignore_merges);
  h.u64(t.bytes_of.size());
  for (size_t id = 0; id < t.bytes_of.size(); ++id) {
    h.u64(static_cast<uint64_t>(t.kind[id]));
    h.str(t.bytes_of[id]);
  }
  h.u64(t.merges.size());
  for (const auto& [l, r] : t.merges) h.u64((static_cast<uint64_t>(l) << 32) | r);
  t.fingerprint = h.h;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) fail(p.string(), "cannot be read");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

using VocabList = std::vector<std::pair<std::string, int64_t>>;
using MergeList = std::vector<std::pair<std::string, std::string>>;

// A SAX reader that keeps the two big members (the BPE vocab, an object of ~250k entries, and its merges) as flat
// lists and builds the rest as a json document: nlohmann's own document would put the vocab in a std::map and take
// seconds to build for the Qwen vocabularies.
class TokenizerSax final : public json::json_sax_t {
 public:
  // vocab_at_root: the file is a vocab.json (the whole document is the vocab).
  explicit TokenizerSax(bool vocab_at_root) : vocab_at_root_(vocab_at_root) {}
  json root;
  VocabList vocab;
  MergeList merges;
  bool has_vocab = false, has_merges = false;
  std::string error;

  bool null() override { return value(json()); }
  bool boolean(bool v) override { return value(v); }
  bool number_integer(number_integer_t v) override { return mode_ == Mode::Vocab ? vocab_id(v) : value(v); }
  bool number_unsigned(number_unsigned_t v) override {
    return mode_ == Mode::Vocab ? vocab_id(static_cast<int64_t>(std::min<uint64_t>(v, INT64_MAX))) : value(v);
  }
  bool number_float(number_float_t v, const string_t&) override { return value(v); }
  bool binary(binary_t&) override { return bad("binary data"); }
  bool string(string_t& v) override {
    if (mode_ == Mode::Merges) {
      const size_t sp = v.find(' ');
      if (sp == std::string::npos || v.find(' ', sp + 1) != std::string::npos)
        return bad("merge \"" + v + "\" is not two tokens separated by one space");
      merges.emplace_back(v.substr(0, sp), v.substr(sp + 1));
      return true;
    }
    if (mode_ == Mode::MergePair) {
      pair_.push_back(std::move(v));
      return pair_.size() <= 2 || bad("a merge [a, b] has more than two tokens");
    }
    return value(std::move(v));
  }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool start_object(size_t) override {
    if (vocab_at_root_ && stack_.empty() && mode_ == Mode::Dom) {
      mode_ = Mode::Vocab;
      has_vocab = true;
      return true;
    }
    if (mode_ == Mode::Dom && at_model_member("vocab")) {
      mode_ = Mode::Vocab;
      has_vocab = true;
      return true;
    }
    if (mode_ != Mode::Dom)
      return bad(mode_ == Mode::Vocab ? "a vocab entry is not an integer id" : "a merge is an object");
    return open(json::object());
  }
  bool end_object() override {
    if (mode_ == Mode::Vocab) {
      mode_ = Mode::Dom;
      return true;
    }
    stack_.pop_back();
    opened_as_.pop_back();
    return true;
  }
  bool start_array(size_t) override {
    if (mode_ == Mode::Dom && at_model_member("merges")) {
      mode_ = Mode::Merges;
      has_merges = true;
      return true;
    }
    if (mode_ == Mode::Merges) {
      mode_ = Mode::MergePair;
      pair_.clear();
      return true;
    }
    if (mode_ != Mode::Dom)
      return bad(mode_ == Mode::Vocab ? "a vocab entry is not an integer id" : "a merge nests arrays");
    return open(json::array());
  }
  bool end_array() override {
    if (mode_ == Mode::MergePair) {
      if (pair_.size() != 2) return bad("a merge [a, b] does not have two tokens");
      merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
      mode_ = Mode::Merges;
      return true;
    }
    if (mode_ == Mode::Merges) {
      mode_ = Mode::Dom;
      return true;
    }
    stack_.pop_back();
    opened_as_.pop_back();
    return true;
  }
  bool parse_error(size_t, const std::string&, const nlohmann::detail::exception& e) override {
    error = std::string("not valid JSON (truncated or corrupt?): ") + e.what();
    return false;
  }

 private:
  enum class Mode { Dom, Vocab, Merges, MergePair };
  bool bad(const std::string& what) {
    error = "malformed: " + what;
    return false;
  }
  bool vocab_id(int64_t id) {
    vocab.emplace_back(std::move(key_), id);
    return true;
  }
  // Whether the value about to start is model.<name> of a tokenizer.json.
  bool at_model_member(const char* name) const {
    return !vocab_at_root_ && stack_.size() == 2 && stack_[0]->is_object() && stack_[1]->is_object() &&
           opened_as_[1] == "model" && key_ == name;
  }
  bool value(json v) {
    if (mode_ == Mode::Vocab) return bad("a vocab entry is not an integer id");
    if (mode_ != Mode::Dom) return bad("a merge is neither \"a b\" nor [a, b]");
    if (stack_.empty()) {
      root = std::move(v);
      return true;
    }
    json& top = *stack_.back();
    if (top.is_array())
      top.push_back(std::move(v));
    else
      top[key_] = std::move(v);
    return true;
  }
  bool open(json v) {
    if (stack_.empty()) {
      root = std::move(v);
      stack_.push_back(&root);
      opened_as_.emplace_back();
      return true;
    }
    json& top = *stack_.back();
    json* slot;
    if (top.is_array()) {
      top.push_back(std::move(v));
      slot = &top.back();
    } else {
      slot = &(top[key_] = std::move(v));
    }
    opened_as_.push_back(top.is_array() ? std::string() : key_);
    stack_.push_back(slot);
    return true;
  }

  bool vocab_at_root_;
  Mode mode_ = Mode::Dom;
  std::vector<json*> stack_;
  std::string key_;
  std::vector<std::string> pair_;
  std::vector<std::string> opened_as_;  // per open container, the key it is the value of
};

// Parses `p` (a tokenizer.json, or a vocab.json when vocab_at_root) into `sax`.
void parse_file(const fs::path& p, TokenizerSax& sax) {
  const std::string text = read_file(p);
  bool ok = false;
  try {
    ok = json::sax_parse(text, &sax);
  } catch (const json::exception& e) {
    fail(p.string(), std::string("not valid JSON (truncated or corrupt?): ") + e.what());
  }
  if (!ok) fail(p.string(), sax.error.empty() ? "not valid JSON" : sax.error);
}

std::shared_ptr<Impl> load_tokenizer_json(const fs::path& path) {
  const std::string file = path.string();
  TokenizerSax sax(false);
  parse_file(path, sax);
  const json& j = sax.root;
  auto t = std::make_shared<Impl>();
  try {
    if (!j.is_object()) fail(file, "not a tokenizer.json (the top level is not an object)");
    if (!j.contains("model")) fail(file, "not a tokenizer.json (no \"model\")");
    for (const char* k : {"truncation", "padding"})
      if (j.contains(k) && !j[k].is_null()) fail(file, std::string("\"") + k + "\" is set; only null is supported");
    const json& m = j.at("model");
    const std::string type = m.value("type", "BPE");
    if (type != "BPE") fail(file, "model type \"" + type + "\" is not supported (only byte-level BPE)");
    if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0)
      fail(file, "BPE dropout is not supported");
    if (m.value("byte_fallback", false)) fail(file, "BPE byte_fallback is not supported");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(k) && !m[k].is_null() && !m[k].get<std::string>().empty())
        fail(file, std::string("BPE ") + k + " is not supported");
    t->ignore_merges = m.value("ignore_merges", false);
    if (!sax.has_vocab) fail(file, "the BPE model has no vocab object");
    if (!sax.has_merges) fail(file, "the BPE model has no merges list");
    read_vocab(*t, sax.vocab, file);
    read_merges(*t, sax.merges, file);

    t->normalizer = Normalizer(parse_normalizer(j.value("normalizer", json()), file));
    if (!parse_pre_tokenizer(*t, j.value("pre_tokenizer", json()), file, false))
      fail(file, "the pre_tokenizer has no ByteLevel step; only byte-level BPE is supported");
    const json dec = j.value("decoder", json());
    if (dec.is_null() || dec.value("type", "") != "ByteLevel")
      fail(file, "decoder " + (dec.is_null() ? std::string("null") : "\"" + dec.value("type", "") + "\"") +
                     " is not supported (only ByteLevel)");
    const json post = j.value("post_processor", json());
    if (!post.is_null() && post.value("type", "") != "ByteLevel")
      fail(file, "post_processor \"" + post.value("type", "") + "\" is not supported (only ByteLevel or null)");

    for (const json& a : j.value("added_tokens", json::array())) {
      const std::string content = a.at("content").get<std::string>();
      const int64_t id = a.at("id").get<int64_t>();
      const bool special = a.value("special", false);
      if (content.empty() || id < 0 || id > INT32_MAX) fail(file, "added token " + a.dump() + " is invalid");
      for (const char* k : {"lstrip", "rstrip", "single_word"})
        if (a.value(k, false))
          fail(file, std::string("added token \"") + content + "\" with " + k + " true is not supported");
      if (!valid_utf8(content)) fail(file, "added token content is not UTF-8");
      (a.value("normalized", !special) ? t->normalized_added : t->raw_added).add(content, static_cast<TokenId>(id));
      t->added[content] = static_cast<TokenId>(id);
      add_token(*t, static_cast<TokenId>(id), content, special ? Kind::Special : Kind::Added);
    }
  } catch (const json::exception& e) {
    fail(file, std::string("malformed: ") + e.what());
  }
  finish(*t);
  return t;
}

std::shared_ptr<Impl> load_vocab_merges(const fs::path& vocab_path, const fs::path& merges_path) {
  auto t = std::make_shared<Impl>();
  TokenizerSax sax(true);
  parse_file(vocab_path, sax);
  if (!sax.has_vocab || !sax.root.is_null()) fail(vocab_path.string(), "not a vocab.json (an object of token ids)");
  read_vocab(*t, sax.vocab, vocab_path.string());
  std::ifstream in(merges_path);
  if (!in) fail(merges_path.string(), "cannot be read");
  std::vector<std::pair<std::string, std::string>> merges;
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (n == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos)
      fail(merges_path.string(), "line " + std::to_string(n) + " is not two tokens separated by one space");
    merges.emplace_back(line.substr(0, sp), line.substr(sp + 1));
  }
  read_merges(*t, merges, merges_path.string());
  add_split(*t, std::string(kGpt2Pattern), vocab_path.string());
  finish(*t);
  return t;
}

// Whether the text may be cut at i (just after a '\n'): the next character is an ASCII graphic or a letter, never a
// space or line break in either regex dialect.
bool safe_cut(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b >= 0x21 && b <= 0x7E) return true;
  if (b < 0xC2 || b > 0xF4) return false;
  const size_t n = utf8_length(b);
  if (i + n > s.size() || !valid_utf8(s.substr(i, n))) return false;
  return u_isalpha(static_cast<UChar32>(decode_utf8(s, i)));
}

}  // namespace

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Tokenizer Tokenizer::load(const std::string& path) {
  const fs::path p(path);
  std::error_code ec;
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "tokenizer.json")) return Tokenizer(load_tokenizer_json(p / "tokenizer.json"));
    if (fs::exists(p / "vocab.json") && fs::exists(p / "merges.txt"))
      return Tokenizer(load_vocab_merges(p / "vocab.json", p / "merges.txt"));
    fail(path, "a directory with neither tokenizer.json nor vocab.json + merges.txt");
  }
  if (!fs::exists(p, ec)) fail(path, "no such file");
  if (p.filename() == "vocab.json" && fs::exists(p.parent_path() / "merges.txt"))
    return Tokenizer(load_vocab_merges(p, p.parent_path() / "merges.txt"));
  return Tokenizer(load_tokenizer_json(p));
}

std::vector<TokenId> Tokenizer::encode(std::string_view text) const {
  std::string storage;
  const std::string_view valid = repair_utf8(text, storage);
  std::vector<TokenId> out;
  out.reserve(valid.size() / 3 + 8);
  impl_->encode_valid(valid, out);
  return out;
}

std::vector<TokenId> Tokenizer::encode_parallel(std::string_view text, int threads, size_t min_chunk_bytes) const {
  min_chunk_bytes = std::max<size_t>(min_chunk_bytes, 1);
  if (threads <= 1 || !impl_->cut_after_newline || text.size() < 2 * min_chunk_bytes) return encode(text);
  // More chunks than threads, handed out dynamically, so that uneven text still keeps every thread busy.
  const size_t target = std::max(min_chunk_bytes, text.size() / (static_cast<size_t>(threads) * 8));
  std::vector<std::string_view> chunks;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.size();
    for (size_t at = start + target; at < text.size();) {
      const void* nl = std::memchr(text.data() + at, '\n', text.size() - at);
      if (!nl) break;
      const size_t cut = static_cast<size_t>(static_cast<const char*>(nl) - text.data()) + 1;
      if (cut < text.size() && safe_cut(text, cut)) {
        end = cut;
        break;
      }
      at = cut;
    }
    chunks.push_back(text.substr(start, end - start));
    start = end;
  }
  std::vector<std::vector<TokenId>> parts(chunks.size());
  std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (size_t i = 0; i < chunks.size(); ++i) {
    try {
      parts[i] = encode(chunks[i]);
    } catch (...) {
#pragma omp critical(hs_tokenizer_error)
      error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  size_t total = 0;
  for (const auto& p : parts) total += p.size();
  std::vector<TokenId> out;
  out.reserve(total);
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool skip_special_tokens) const {
  std::string out;
  for (TokenId id : ids) {
    // Ids without a token (a padded embedding's tail) are skipped, as HF does.
    if (id >= impl_->kind.size() || impl_->kind[id] == Kind::None) continue;
    if (skip_special_tokens && impl_->kind[id] == Kind::Special) continue;
    out += impl_->bytes_of[id];
  }
  return out;
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->bytes_of.size()); }

uint64_t Tokenizer::fingerprint() const { return impl_->fingerprint; }

std::optional<TokenId> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = impl_->added.find(std::string(token)); it != impl_->added.end()) return it->second;
  std::string bytes;
  if (!alphabet().to_bytes(token, bytes)) bytes = token;
  if (const auto it = impl_->vocab.find(bytes); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

std::optional<TokenId> Tokenizer::end_of_text_id() const { return token_to_id("<|endoftext|>"); }

bool Tokenizer::is_special(TokenId id) const { return id < impl_->kind.size() && impl_->kind[id] == Kind::Special; }

std::string Tokenizer::token_bytes(TokenId id) const {
  if (id >= impl_->bytes_of.size())
    throw std::out_of_range("tokenizer: id " + std::to_string(id) + " is not below the vocabulary size " +
                            std::to_string(impl_->bytes_of.size()));
  return impl_->bytes_of[id];
}

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_(skip_special_tokens) {}

std::string StreamDecoder::push(TokenId id) {
  const TokenId one[1] = {id};
  pending_ += tokenizer_->decode(one, skip_special_);
  // Hold back only a tail that is the start of a well-formed character still missing bytes; anything else (whole
  // characters, bytes that can never become one) goes out now.
  size_t keep = 0;
  for (size_t back = 1; back <= 3 && back <= pending_.size(); ++back) {
    const auto b = static_cast<unsigned char>(pending_[pending_.size() - back]);
    if ((b & 0xC0) == 0x80) continue;
    if (b >= 0xC2 && b <= 0xF4 && utf8_length(b) > back) {
      // A lead byte alone can always still be completed; with its second byte there, that byte must fit the lead
      // (E0 80, ED A0, F4 90 ... never will), which completing with 0x80s and validating tells.
      std::string probe = pending_.substr(pending_.size() - back);
      probe.append(utf8_length(b) - back, static_cast<char>(0x80));
      if (back == 1 || valid_utf8(probe)) keep = back;
    }
    break;
  }
  std::string out = pending_.substr(0, pending_.size() - keep);
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string StreamDecoder::finish() {
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace hs::tokenizer
