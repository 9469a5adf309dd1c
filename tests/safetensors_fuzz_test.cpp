// Randomised robustness of the safetensors parser: thousands of mutated files must each parse to a
// layout that satisfies the format's invariants or throw FormatError; any other exception fails the
// test, and a crash or sanitizer report fails the run. Structured random headers carry an oracle, so a
// defect the parser lets through fails too. Fixed seeds keep it reproducible.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "test_util.h"

namespace hs::checkpoint {
namespace {

namespace fs = std::filesystem;
using namespace std::string_literals;
using Bytes = std::vector<std::byte>;
using test::read_bytes;

Bytes assemble(std::string_view header, std::span<const std::byte> data) {
  Bytes f(8 + header.size());
  const uint64_t n = header.size();
  std::memcpy(f.data(), &n, 8);
  std::memcpy(f.data() + 8, header.data(), header.size());
  f.insert(f.end(), data.begin(), data.end());
  return f;
}

struct Split {
  std::string header;
  Bytes data;
};

// Header text and data of a file whose length field is sane; nullopt otherwise.
std::optional<Split> split(const Bytes& f) {
  if (f.size() < 8) return std::nullopt;
  uint64_t n;
  std::memcpy(&n, f.data(), 8);
  if (n > f.size() - 8) return std::nullopt;
  return Split{std::string(reinterpret_cast<const char*>(f.data()) + 8, n), Bytes(f.begin() + 8 + n, f.end())};
}

enum class Outcome { Accepted, Rejected };

// Parses and, when the parser accepts, checks what acceptance promises.
Outcome parse_and_check(const Bytes& file) {
  SafetensorsLayout l;
  try {
    l = parse_safetensors(file, "fuzz");
  } catch (const FormatError&) {
    return Outcome::Rejected;
  }
  uint64_t expected = 0;
  std::set<std::string> names;
  for (const TensorInfo& t : l.tensors) {
    EXPECT_EQ(t.begin, expected) << t.name;
    EXPECT_LE(t.begin, t.end) << t.name;
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      EXPECT_GE(d, 0);
      numel *= static_cast<uint64_t>(d);
    }
    EXPECT_EQ(numel * file_dtype_size(t.dtype), t.nbytes()) << t.name;
    EXPECT_TRUE(names.insert(t.name).second) << t.name;
    expected = t.end;
  }
  EXPECT_EQ(l.data_start() + expected, file.size());
  return Outcome::Accepted;
}

// ---------------------------------------------------------------------------------------------------
// Byte-level and token-level mutations of valid files

class Mutator {
 public:
  explicit Mutator(uint32_t seed) : rng_(seed) {}

  size_t below(size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }
  bool coin() { return below(2) == 0; }

  std::string random_number() {
    static const char* const kNumbers[] = {"0",  "1",  "-1", "2", "7", "8", "4294967296", "9223372036854775807",
                                           "9223372036854775808", "18446744073709551615", "18446744073709551616",
                                           "1e3", "1.5", "-0", "0.0", "1e400", "00", "01"};
    if (coin()) return kNumbers[below(std::size(kNumbers))];
    return std::to_string(below(300));
  }

  std::string random_token() {
    static const char* const kTokens[] = {"{", "}", "[", "]", ",", ":", "\"", "\"F32\"", "\"BF16\"", "\"X\"",
                                          "\"dtype\"", "\"shape\"", "\"data_offsets\"", "\"__metadata__\"",
                                          "null", "true", "[]", "{}", "\\", "\\u0000", "\xff", " "};
    if (coin()) return random_number();
    return kTokens[below(std::size(kTokens))];
  }

  Bytes mutate(Bytes f) {
    switch (below(9)) {
      case 0: {  // bit flips, mostly in the length field and header
        const size_t flips = 1 + below(4);
        for (size_t i = 0; i < flips && !f.empty(); ++i) {
          const size_t at = coin() ? below(std::min<size_t>(f.size(), 512)) : below(f.size());
          f[at] ^= static_cast<std::byte>(1u << below(8));
        }
        return f;
      }
      case 1: f.resize(below(f.size() + 1)); return f;  // truncation
      case 2: {                                        // extension
        const size_t extra = 1 + below(16);
        for (size_t i = 0; i < extra; ++i) f.push_back(static_cast<std::byte>(below(256)));
        return f;
      }
      case 3: {  // length field: nearby, random, or huge
        if (f.size() < 8) return f;
        uint64_t n;
        std::memcpy(&n, f.data(), 8);
        const uint64_t choices[] = {n + 1, n - 1, n + 8, n - 8, below(f.size() + 16), uint64_t(1) << 40,
                                    UINT64_MAX, 100'000'000, 100'000'001, f.size() - 8, f.size() - 7};
        n = choices[below(std::size(choices))];
        std::memcpy(f.data(), &n, 8);
        return f;
      }
      default: break;
    }
    const auto parts = split(f);
    if (!parts) return f;
    std::string h = parts->header;
    Bytes data = parts->data;
    switch (below(5)) {
      case 0: {  // replace a number token (keeps the JSON well-formed, so deep checks run)
        std::vector<size_t> starts;
        for (size_t i = 0; i < h.size(); ++i) {
          const char prev = i ? h[i - 1] : ' ';
          if (std::isdigit(static_cast<unsigned char>(h[i])) && !std::isalnum(static_cast<unsigned char>(prev)) &&
              prev != '.')
            starts.push_back(i);
        }
        if (starts.empty()) break;
        const size_t s = starts[below(starts.size())];
        size_t e = s;
        while (e < h.size() && std::isdigit(static_cast<unsigned char>(h[e]))) ++e;
        h.replace(s, e - s, random_number());
        break;
      }
      case 1: {  // replace a string token
        std::vector<size_t> quotes;
        for (size_t i = 0; i < h.size(); ++i)
          if (h[i] == '"') quotes.push_back(i);
        if (quotes.size() < 2) break;
        const size_t q = below(quotes.size() / 2) * 2;
        static const char* const kStrings[] = {"\"F32\"", "\"F16\"", "\"BF16\"", "\"I64\"", "\"BOOL\"", "\"F8_E4M3\"",
                                               "\"X\"", "\"\"", "\"__metadata__\"", "\"dtype\"", "\"shape\"",
                                               "\"data_offsets\"", "7", "[]", "{}", "null"};
        h.replace(quotes[q], quotes[q + 1] - quotes[q] + 1, kStrings[below(std::size(kStrings))]);
        break;
      }
      case 2: h.insert(below(h.size() + 1), random_token()); break;
      case 3:
        if (!h.empty()) h.erase(below(h.size()), 1 + below(8));
        break;
      case 4: data.resize(below(data.size() + 8)); break;
    }
    return assemble(h, data);
  }

  // A random JSON value, mostly objects with the field names the parser looks for.
  std::string random_json(int depth) {
    const size_t kind = depth >= 4 ? 3 + below(3) : below(6);
    switch (kind) {
      case 0: case 1: {
        std::string s = "{";
        const size_t n = below(4);
        static const char* const kKeys[] = {"dtype", "shape", "data_offsets", "__metadata__", "w", "a", ""};
        for (size_t i = 0; i < n; ++i) {
          if (i) s += ",";
          s += "\""s + kKeys[below(std::size(kKeys))] + "\":" + random_json(depth + 1);
        }
        return s + "}";
      }
      case 2: {
        std::string s = "[";
        const size_t n = below(4);
        for (size_t i = 0; i < n; ++i) {
          if (i) s += ",";
          s += random_json(depth + 1);
        }
        return s + "]";
      }
      case 3: return random_number();
      case 4: return coin() ? "\"F32\"" : "\"k\"";
      default: return coin() ? "null" : "true";
    }
  }

 private:
  std::mt19937 rng_;
};

std::vector<Bytes> seed_files() {
  const fs::path dir = fs::path(hs::test::source_dir()) / "tests" / "fixtures" / "safetensors";
  std::vector<Bytes> seeds;
  for (const char* name : {"all_dtypes.safetensors", "no_metadata.safetensors", "empty.safetensors",
                           "unpadded.safetensors", "sharded/model-00003-of-00003.safetensors"})
    seeds.push_back(read_bytes(dir / name));
  return seeds;
}

TEST(SafetensorsFuzz, MutatedFilesParseOrThrowFormatError) {
  const std::vector<Bytes> seeds = seed_files();
  for (const Bytes& s : seeds) ASSERT_EQ(parse_and_check(s), Outcome::Accepted);
  Mutator m(20240601);
  size_t accepted = 0;
  constexpr int kIterations = 8000;
  for (int i = 0; i < kIterations; ++i) {
    Bytes f = seeds[m.below(seeds.size())];
    const size_t rounds = 1 + m.below(3);  // stacked mutations reach states one step cannot
    for (size_t r = 0; r < rounds; ++r) f = m.mutate(std::move(f));
    try {
      accepted += parse_and_check(f) == Outcome::Accepted;
    } catch (const std::exception& e) {
      FAIL() << "iteration " << i << ": exception other than FormatError: " << e.what();
    }
  }
  // Most mutations break the file; some (a padding byte flipped, a zero-size shape changed) do not.
  EXPECT_GT(accepted, 0u);
  EXPECT_LT(accepted, static_cast<size_t>(kIterations) / 2);
}

TEST(SafetensorsFuzz, RandomJsonHeaders) {
  Mutator m(7);
  for (int i = 0; i < 3000; ++i) {
    const std::string header = m.random_json(0);
    const Bytes data(m.below(3) * 4);
    try {
      parse_and_check(assemble(header, data));
    } catch (const std::exception& e) {
      FAIL() << header << ": exception other than FormatError: " << e.what();
    }
  }
  // Deep nesting must neither overflow the stack nor pass.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_EQ(parse_and_check(assemble(deep, {})), Outcome::Rejected);
  EXPECT_EQ(parse_and_check(assemble("{\"w\":" + deep + "}", {})), Outcome::Rejected);
}

// ---------------------------------------------------------------------------------------------------
// Structured headers with an oracle: a valid random layout, then at most one defect that certainly
// makes it invalid. The parser must accept exactly the defect-free ones.

struct Entry {
  std::string name;
  std::string dtype;
  std::vector<std::string> shape;  // JSON tokens, so a defect can be a non-integer
  uint64_t begin = 0, end = 0;
};

std::string render(const std::vector<Entry>& es, const std::string& metadata) {
  std::string h = "{";
  if (!metadata.empty()) h += "\"__metadata__\":" + metadata;
  for (const Entry& e : es) {
    if (h.size() > 1) h += ",";
    h += "\"" + e.name + "\":{\"dtype\":\"" + e.dtype + "\",\"shape\":[";
    for (size_t i = 0; i < e.shape.size(); ++i) h += (i ? "," : "") + e.shape[i];
    h += "],\"data_offsets\":["s + std::to_string(e.begin) + "," + std::to_string(e.end) + "]}";
  }
  return h + "}";
}

TEST(SafetensorsFuzz, StructuredHeadersWithOracle) {
  Mutator m(99);
  const FileDType kTypes[] = {FileDType::F64, FileDType::F32, FileDType::BF16, FileDType::F16, FileDType::I8,
                              FileDType::BOOL, FileDType::U64, FileDType::F8_E5M2};
  enum Defect {
    None, UnknownDtype, NegativeDim, FractionalDim, Shifted, Gap, Resized, Trailing, Truncated, Reversed,
    DuplicateName, BadMetadata, kDefects
  };
  size_t seen[kDefects] = {};
  for (int iter = 0; iter < 3000; ++iter) {
    std::vector<Entry> es;
    uint64_t offset = 0;
    const size_t count = 1 + m.below(6);
    for (size_t i = 0; i < count; ++i) {
      Entry e;
      e.name = "t"s + std::to_string(i);
      const FileDType dt = kTypes[m.below(std::size(kTypes))];
      e.dtype = std::string(file_dtype_name(dt));
      uint64_t n = file_dtype_size(dt);
      const size_t rank = m.below(4);
      for (size_t d = 0; d < rank; ++d) {
        const size_t dim = m.below(5) == 0 ? 0 : 1 + m.below(4);
        e.shape.push_back(std::to_string(dim));
        n *= dim;
      }
      e.begin = offset;
      e.end = offset += n;
      es.push_back(std::move(e));
    }
    std::shuffle(es.begin(), es.end(), std::mt19937(iter));  // header order is free
    std::string metadata = m.coin() ? "{\"format\":\"pt\"}" : "";
    uint64_t data_size = offset;

    // Only tensors holding bytes can be shifted or resized detectably.
    std::vector<size_t> nonempty;
    for (size_t i = 0; i < es.size(); ++i)
      if (es[i].end > es[i].begin) nonempty.push_back(i);
    auto defect = static_cast<Defect>(m.below(kDefects));
    if ((defect == Shifted || defect == Gap || defect == Resized || defect == Reversed) && nonempty.empty())
      defect = None;
    if (defect == Truncated && data_size == 0) defect = None;
    Entry& victim = es[nonempty.empty() ? 0 : nonempty[m.below(nonempty.size())]];
    switch (defect) {
      case UnknownDtype: victim.dtype = m.coin() ? "F31" : "f32"; break;
      case NegativeDim: victim.shape.push_back("-1"); break;
      case FractionalDim: victim.shape.push_back(m.coin() ? "1.0" : "\"1\""); break;
      case Shifted: ++victim.begin, ++victim.end; break;
      case Gap: {  // moves everything from the victim on, so the only fault is a hole before it
        const uint64_t at = victim.begin, gap = 1 + m.below(8);
        for (Entry& e : es)
          if (e.begin >= at) e.begin += gap, e.end += gap;
        data_size += gap;
        break;
      }
      case Resized: victim.shape.push_back("2"); break;  // doubles a non-zero byte count
      case Trailing: data_size += 1 + m.below(8); break;
      case Truncated: data_size -= 1 + m.below(data_size); break;
      case Reversed: std::swap(victim.begin, victim.end); break;
      case DuplicateName: es.push_back(es[m.below(es.size())]); break;
      case BadMetadata: metadata = m.coin() ? "{\"epoch\":3}" : "[]"; break;
      default: break;
    }
    ++seen[defect];
    const Bytes file = assemble(render(es, metadata), Bytes(data_size));
    const Outcome want = defect == None ? Outcome::Accepted : Outcome::Rejected;
    try {
      ASSERT_EQ(parse_and_check(file), want) << "defect " << defect << ": " << render(es, metadata);
    } catch (const std::exception& e) {
      FAIL() << "exception other than FormatError: " << e.what();
    }
  }
  for (int d = 0; d < kDefects; ++d) EXPECT_GT(seen[d], 100u) << "defect " << d << " rarely drawn";
}

}  // namespace
}  // namespace hs::checkpoint
