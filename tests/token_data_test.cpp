// Token files and the token sources training reads: the format round trip, refusal of bad or mismatched files, the
// memory-mapped reader against memory, the sampler and evaluation over either, bits per byte, a flat resident set on a
// large file, and bit-exact resume on token data.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "core/hash.h"
#include "dataset/token_file.h"
#include "dataset/vocabulary.h"
#include "model/params.h"
#include "test_util.h"
#include "token_file_util.h"
#include "train/data.h"
#include "train/evaluate.h"
#include "train/trainer.h"

namespace hs::dataset {
namespace {

namespace fs = std::filesystem;
using test::byte_encoder;
using test::byte_vocabulary;
using test::bytes_of;
using test::error_of;
using test::lorem;

std::vector<int32_t> read_all(const TokenSource& s) {
  std::vector<int32_t> v(static_cast<size_t>(s.size()));
  s.read(0, s.size(), v.data());
  return v;
}

// Documents in memory and from files, separators between them, both id widths: what is read back is what was written,
// and the header counts are right.
TEST(TokenFile, RoundTripBothWidths) {
  test::TempDir t;
  const std::string a = "In the beginning", b = "God created\nthe heaven", c = lorem(5000, 1);
  std::ofstream(t / "c.txt") << c;
  for (int64_t vocab : {300, 70000}) {
    const fs::path path = t / ("v" + std::to_string(vocab) + ".tok");
    WriterOptions wo;
    wo.block_bytes = 700;  // the file document spans many blocks
    TokenFileWriter w(path, byte_vocabulary(vocab, 77), byte_encoder(), wo);
    w.add_document(a);
    w.add_document(b);
    w.add_text_file(t / "c.txt");
    ASSERT_FALSE(fs::exists(path));  // nothing visible before commit
    const TokenFileHeader h = w.commit();
    auto f = TokenFile::open(path);
    const uint32_t eot = static_cast<uint32_t>(vocab - 1);
    std::vector<uint32_t> want = bytes_of(a);
    want.push_back(eot);
    for (uint32_t x : bytes_of(b)) want.push_back(x);
    want.push_back(eot);
    for (uint32_t x : bytes_of(c)) want.push_back(x);
    const std::vector<int32_t> got = read_all(TokenSource::mapped(f));
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(uint32_t(got[i]), want[i]) << i;
    EXPECT_EQ(f->header().dtype_bytes, vocab <= 65536 ? 2u : 4u);
    EXPECT_EQ(f->header().tokens, int64_t(want.size()));
    EXPECT_EQ(f->header().documents, 3);
    EXPECT_EQ(f->header().text_bytes, int64_t(a.size() + b.size() + c.size()));
    EXPECT_EQ(f->header().fingerprint, 77u);
    EXPECT_EQ(f->header().vocab_size, vocab);
    EXPECT_EQ(f->header().end_of_text, std::optional<uint32_t>(eot));
    EXPECT_EQ(h.tokens, f->header().tokens);
    EXPECT_EQ(f->token_bytes()[eot], 0);
    EXPECT_EQ(fs::file_size(path), f->header().data_offset + want.size() * f->header().dtype_bytes);
    EXPECT_EQ(f->header().data_offset % 64, 0u);
  }
}

// A text file is cut into blocks only just after a newline followed by an ASCII letter, and the blocks put together
// are the file.
TEST(TokenFile, BlocksCutOnlyAfterANewlineBeforeALetter) {
  test::TempDir t;
  const std::string text = lorem(20000, 2) + "\n\n  \n" + std::string(3000, 'x') + "\nEnd";
  std::ofstream(t / "a.txt") << text;
  std::vector<std::string> pieces;
  Encoder recording = [&](std::string_view s, int) {
    pieces.emplace_back(s);
    return bytes_of(s);
  };
  WriterOptions wo;
  wo.block_bytes = 512;
  wo.threads = 1;  // the recording encoder is not thread-safe
  TokenFileWriter w(t / "a.tok", byte_vocabulary(300), recording, wo);
  w.add_text_file(t / "a.txt");
  w.commit();
  ASSERT_GT(pieces.size(), 10u);
  std::string joined;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (i + 1 < pieces.size()) {
      ASSERT_EQ(pieces[i].back(), '\n') << i;
      ASSERT_TRUE(std::isalpha(static_cast<unsigned char>(pieces[i + 1].front()))) << i;
    }
    joined += pieces[i];
  }
  EXPECT_EQ(joined, text);
}

// With a real byte-level BPE (the Qwen3.5 split regex and normalizer, a 320-id prefix of its vocabulary), a file written
// in small blocks holds exactly the ids of encoding the whole text as one string: no block boundary changes a token.
TEST(TokenFile, BlocksGiveTheIdsOfTheWholeText) {
  const tokenizer::Tokenizer tok =
      tokenizer::Tokenizer::load(hs::test::source_dir() + "/tests/fixtures/tokenizer/qwen3_5_320/tokenizer.json");
  static const char* lines[] = {
      "In the beginning God created the heaven and the earth.\n", "And the earth was without form;\r\n",
      "    indented code(x) { return y; }\n", "\n\n\n", "   \t  \n", "Numbers 12345 and 3.14\n",
      "Caf\u00e9 na\u0131ve e\u0301 \u4e2d\u6587\u6d4b\u8bd5\n", "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440\n",
      "Emoji \U0001F44D\U0001F3FD \U0001F468\u200D\U0001F469\u200D\U0001F467\n", "<|endoftext|>Special inside\n",
      "'s 're 'll THEY'VE\n", "trailing spaces   \n", "\n\u0301combining after a newline\n", "x\n"};
  std::mt19937 rng(6);
  std::string text;
  while (text.size() < 60000) text += lines[rng() % std::size(lines)];
  test::TempDir t;
  std::ofstream(t / "a.txt", std::ios::binary) << text;
  WriterOptions wo;
  wo.block_bytes = 1000;
  TokenFileWriter w(t / "a.tok", vocabulary_of(tok), encoder_of(tok), wo);
  w.add_text_file(t / "a.txt");
  w.commit();
  const std::vector<uint32_t> want = tok.encode(text);
  const std::vector<int32_t> got = read_all(TokenSource::mapped(TokenFile::open(t / "a.tok")));
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(uint32_t(got[i]), want[i]) << i;
  // The length table adds up to the text as the tokenizer saw it: after NFC, which makes each e + U+0301 (3 bytes) one
  // 2-byte character; the separator written in the text counts 0 bytes, not 13.
  int64_t bytes = 0, separators = 0, composed = 0;
  const auto f = TokenFile::open(t / "a.tok");
  for (int32_t id : got) bytes += f->token_bytes()[size_t(id)], separators += uint32_t(id) == *tok.end_of_text_id();
  for (size_t at = text.find("e\u0301"); at != std::string::npos; at = text.find("e\u0301", at + 1)) ++composed;
  EXPECT_GT(separators, 0);
  EXPECT_GT(composed, 0);
  EXPECT_EQ(bytes + 13 * separators + composed, f->header().text_bytes);
}

TEST(TokenFile, RefusesFilesThatAreNotWholeTokenFiles) {
  test::TempDir t;
  const fs::path good = t / "good.tok";
  {
    TokenFileWriter w(good, byte_vocabulary(300), byte_encoder());
    w.add_document(lorem(1000, 3));
    w.commit();
  }
  const std::vector<std::byte> bytes = test::read_bytes(good);
  auto write = [&](const std::string& name, std::vector<std::byte> b) {
    std::ofstream(t / name, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
    return t / name;
  };
  auto open_error = [](const fs::path& p) { return error_of([&] { TokenFile::open(p); }); };

  std::vector<std::byte> b = bytes;
  b[0] = std::byte('X');
  EXPECT_NE(open_error(write("magic.tok", b)).find("is not a hybridscan token file"), std::string::npos);
  EXPECT_NE(open_error(write("short.tok", {bytes.begin(), bytes.begin() + 40})).find("is truncated: 40 bytes"),
            std::string::npos);
  EXPECT_NE(open_error(write("cut.tok", {bytes.begin(), bytes.end() - 1})).find("is truncated"), std::string::npos);
  b = bytes;
  b.push_back(std::byte(0));
  EXPECT_NE(open_error(write("long.tok", b)).find("has trailing bytes"), std::string::npos);
  b = bytes;
  b[33] ^= std::byte(1);  // the token count
  EXPECT_NE(open_error(write("count.tok", b)).find("corrupt header (checksum"), std::string::npos);
  b = bytes;
  b[100] ^= std::byte(1);  // the length table
  EXPECT_NE(open_error(write("table.tok", b)).find("corrupt header (checksum"), std::string::npos);
  b = bytes;
  b[8] = std::byte(9);
  EXPECT_NE(open_error(write("version.tok", b)).find("format version 9"), std::string::npos);
  // A header whose token count times the id width wraps around 2^64 to the bytes there are (2^62 uint32 ids: 0 bytes
  // past the header), checksum and all made right: refused, not mapped as 2^62 tokens to read out of bounds.
  {
    auto f0 = TokenFile::open(good);
    b.assign(bytes.begin(), bytes.begin() + static_cast<ptrdiff_t>(f0->header().data_offset));
    auto put64 = [&](size_t at, uint64_t v) { std::memcpy(b.data() + at, &v, 8); };
    const uint32_t four = 4;
    std::memcpy(b.data() + 12, &four, 4);  // the id width
    put64(32, uint64_t(1) << 62);          // the token count
    // The checksum: FNV-1a over bytes [0, 64) then the length table at [72, 72 + 2 vocab) (docs/token_format.md).
    uint64_t h = 0xcbf29ce484222325ull;
    auto fnv = [&](size_t from, size_t to) {
      for (size_t i = from; i < to; ++i) h = (h ^ uint64_t(b[i])) * 0x100000001b3ull;
    };
    fnv(0, 64);
    fnv(72, 72 + 2 * 300);
    put64(64, h);
    EXPECT_NE(open_error(write("wrap.tok", b)).find("more than " + std::to_string(b.size()) + " bytes can hold"),
              std::string::npos)
        << open_error(write("wrap.tok", b));
  }
  // An id outside the vocabulary (the ids are not covered by the checksum) is found when it is read.
  b = bytes;
  auto f0 = TokenFile::open(good);
  b[f0->header().data_offset + 11] = std::byte(0xFF);  // high byte of the sixth uint16 id: >= 300
  auto f = TokenFile::open(write("id.tok", b));
  std::vector<int32_t> out(20);
  EXPECT_NE(error_of([&] { f->read(0, 20, out.data()); }).find("is corrupt: token 5 is id 65"), std::string::npos);
  EXPECT_NE(error_of([&] { TokenFile::open(t / "absent.tok"); }).find("cannot open token file"), std::string::npos);
  // Nothing but the good file and the ones written here: a failed writer leaves no temporary behind.
  EXPECT_NE(error_of([&] {
              TokenFileWriter w(t / "bad.tok", byte_vocabulary(300), [](std::string_view, int) {
                return std::vector<uint32_t>{400};
              });
              w.add_document("x");
              w.commit();
            }).find("outside its vocabulary of 300"),
            std::string::npos);
  for (const auto& e : t.entries()) EXPECT_EQ(e.find(".tmp"), std::string::npos) << e;
}

TEST(TokenFile, MismatchedVocabularyOrTokenizerIsRefused) {
  test::TempDir t;
  TokenFileWriter w(t / "a.tok", byte_vocabulary(300, 0xabc), byte_encoder());
  w.add_document("abc");
  w.commit();
  auto f = TokenFile::open(t / "a.tok");
  EXPECT_NO_THROW(check_token_file(*f, 300, 0xabc, "tok.json"));
  EXPECT_NO_THROW(check_token_file(*f, 320, std::nullopt, ""));
  EXPECT_NE(error_of([&] { check_token_file(*f, 256, std::nullopt, ""); })
                .find("holds ids of a vocabulary of 300, more than the model's vocab_size 256"),
            std::string::npos);
  const std::string e = error_of([&] { check_token_file(*f, 300, 0xdef, "model/tokenizer.json"); });
  EXPECT_NE(e.find("fingerprint 0000000000000abc, but the model's tokenizer model/tokenizer.json has fingerprint "
                   "0000000000000def"),
            std::string::npos)
      << e;
  // Through the training data loader, before any step.
  train::DataOptions d;
  d.data = (t / "a.tok").string();
  EXPECT_NE(error_of([&] { train::load_tokens(d, {256, ""}); }).find("more than the model's vocab_size 256"),
            std::string::npos);
}

// The reader, the sampler and the evaluation batches give the same tokens from a mapped file as from memory; and for
// byte data the sampler draws exactly the windows it always has (the formula before token files, kept here).
TEST(TokenSource, MappedEqualsInMemoryForReadsSamplesAndEvalBatches) {
  test::TempDir t;
  const std::string text = lorem(30000, 4);
  TokenFileWriter w(t / "a.tok", byte_vocabulary(300), byte_encoder());
  w.add_document(text);
  w.commit();
  const TokenSource file = TokenSource::mapped(TokenFile::open(t / "a.tok"));
  std::vector<int32_t> ids;
  for (unsigned char c : text) ids.push_back(c);
  const TokenSource mem = TokenSource::in_memory(ids);
  ASSERT_EQ(file.size(), mem.size());
  EXPECT_EQ(read_all(file), ids);
  const TokenSource fs_ = file.slice(1000, 20000), ms = mem.slice(1000, 20000);
  EXPECT_EQ(read_all(fs_), read_all(ms));
  for (int64_t step : {0, 1, 7, 1000}) {
    const train::TokenBatch a = train::sample_batch(fs_, 4, 64, 9, step), b = train::sample_batch(ms, 4, 64, 9, step);
    EXPECT_EQ(a.inputs, b.inputs) << step;
    EXPECT_EQ(a.targets, b.targets) << step;
    const uint64_t span = uint64_t(ms.size() - 64);
    for (int64_t r = 0; r < 4; ++r) {
      const uint64_t start =
          splitmix64(splitmix64(9) ^ splitmix64(uint64_t(step) * 0x100000001b3ull + uint64_t(r))) % span;
      for (int64_t j = 0; j < 64; ++j) {
        ASSERT_EQ(b.inputs[size_t(r * 64 + j)], ids[1000 + start + size_t(j)]);
        ASSERT_EQ(b.targets[size_t(r * 64 + j)], ids[1000 + start + size_t(j) + 1]);
      }
    }
  }
  const int64_t n = train::eval_batch_count(fs_.size(), 100, 3);
  EXPECT_EQ(n, ((fs_.size() - 1 + 99) / 100 + 2) / 3);
  int64_t predicted = 0;
  for (int64_t i = 0; i < n; ++i) {
    const train::TokenBatch a = train::eval_batch(fs_, 100, 3, i), b = train::eval_batch(ms, 100, 3, i);
    EXPECT_EQ(a.inputs, b.inputs);
    EXPECT_EQ(a.targets, b.targets);
    for (int32_t x : a.targets) predicted += x >= 0;
  }
  EXPECT_EQ(predicted, fs_.size() - 1);  // every token after the first, once
}

// The file-backed part of the resident set (RssFile, plus RssShmem when the temporary directory is a tmpfs): what a
// mapped token file can grow. The anonymous part is the allocator's (AddressSanitizer's quarantine keeps every freed
// window batch for a while).
size_t file_resident_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  size_t kib = 0;
  while (std::getline(f, line))
    if (line.rfind("RssFile:", 0) == 0 || line.rfind("RssShmem:", 0) == 0) kib += std::stoull(line.substr(9));
  return kib * 1024;
}

// Sampling all over a 64 MB token file and reading all of it in evaluation windows leaves the resident set where it
// was: pages are released as windows are copied out (without that, the whole file would become resident).
TEST(TokenSource, ReadingALargeFileKeepsTheResidentSetFlat) {
  test::TempDir t;
  const int64_t tokens = int64_t(32) << 20;
  {
    WriterOptions wo;
    wo.block_bytes = size_t(4) << 20;
    TokenFileWriter w(t / "big.tok", byte_vocabulary(300), byte_encoder(), wo);
    const std::string chunk = lorem(size_t(1) << 20, 5);
    for (int64_t i = 0; i < tokens >> 20; ++i) w.add_document(chunk);
    w.commit();
  }
  const TokenSource src = TokenSource::mapped(TokenFile::open(t / "big.tok"));
  ASSERT_GE(src.size(), tokens);
  const size_t before = file_resident_bytes();
  int64_t sum = 0;
  for (int64_t step = 0; step < 2000; ++step) sum += train::sample_batch(src, 8, 256, 1, step).inputs[0];
  const int64_t n = train::eval_batch_count(src.size(), 4096, 8);
  for (int64_t i = 0; i < n; ++i) sum += train::eval_batch(src, 4096, 8, i).targets[0];
  const size_t after = file_resident_bytes();
  EXPECT_GT(sum, 0);
  EXPECT_LT(double(after) - double(before), 8.0 * (1 << 20)) << before << " -> " << after;
}

// Bits per byte by hand: with all-zero weights every logit is 0, so each predicted token costs ln V nats; with V = 256
// that is 8 bits, and bits per byte is 8 x (predicted tokens) / (their bytes in the length table).
TEST(Eval, BitsPerByteIsTotalBitsOverTheBytesOfThePredictedTokens) {
  model::ModelConfig c = model::preset("tiny");
  MemoryAccountant mem;
  model::ParamSet params(c, DType::F32, mem, MemCategory::Parameters, false);
  for (auto& p : params.all()) std::memset(p.tensor.data(), 0, p.tensor.nbytes());
  std::vector<uint16_t> lengths(256, 1);
  lengths[10] = 3;
  lengths[20] = 0;
  // Predicted: 10, 20, 30, 10, 5 (the first token, 7, is not): 3 + 0 + 1 + 3 + 1 = 8 bytes for 5 x 8 bits.
  const TokenSource src = TokenSource::in_memory({7, 10, 20, 30, 10, 5}, lengths);
  for (int64_t seq : {2, 5, 8}) {
    const train::EvalResult e = train::evaluate_tokens(params, src, seq, 2, DType::F32, mem);
    EXPECT_EQ(e.count, 5);
    EXPECT_EQ(e.text_bytes, 8);
    EXPECT_NEAR(e.ce, std::log(256.0), 1e-5);
    EXPECT_NEAR(e.bits_per_byte, 5.0 * 8.0 / 8.0, 1e-5) << seq;
  }
  // Byte tokens: bits per byte is the cross-entropy in bits.
  const train::EvalResult b = train::evaluate_tokens(params, TokenSource::in_memory({1, 2, 3, 4}), 4, 1, DType::F32, mem);
  EXPECT_EQ(b.text_bytes, 3);
  EXPECT_NEAR(b.bits_per_byte, b.ce / std::log(2.0), 1e-9);
}

// Training from a token file: N steps, save, resume, M steps give the losses of N+M steps in one run, bit for bit.
TEST(Train, ResumeIsBitExactOnATokenFile) {
  test::TempDir t;
  {
    TokenFileWriter w(t / "a.tok", byte_vocabulary(256), byte_encoder());
    for (int i = 0; i < 20; ++i) w.add_document(lorem(700, uint32_t(10 + i)));
    w.commit();
  }
  // Once per packing named on the first run's command line; the resume names none (auto), so the checkpoint's
  // packing must come back: auto alone would pack this file's 20 documents, and a stream run would resume packed.
  for (const train::Packing packing : {train::Packing::Stream, train::Packing::Documents}) {
  SCOPED_TRACE(train::packing_name(packing));
  auto options = [&](const std::string& name) {
    const std::string out = name + "-" + train::packing_name(packing);
    train::TrainOptions o;
    o.model = "tiny";
    o.data = (t / "a.tok").string();
    o.steps = 4;
    o.batch = 2;
    o.seq = 32;
    o.opt.warmup = 1;
    o.eval_every = 2;
    o.eval_batches = 1;
    o.out = (t / out).string();
    o.progress = false;
    o.step.compute = DType::F32;
    o.step.packing = packing;
    return o;
  };
  std::ostringstream log;
  const train::TrainSummary full = train::run_training(options("full"), log);
  train::TrainOptions first = options("part");
  first.stop_after = 2;
  const train::TrainSummary part = train::run_training(first, log);
  train::TrainOptions rest = options("rest");
  rest.data.clear();  // taken back from the checkpoint
  rest.step.packing = train::Packing::Auto;  // not given: taken back from the checkpoint
  rest.resume = (t / ("part-" + train::packing_name(packing)) / "checkpoint-2").string();
  const train::TrainSummary resumed = train::run_training(rest, log);
  ASSERT_EQ(full.losses.size(), 4u);
  ASSERT_EQ(part.losses.size(), 2u);
  ASSERT_EQ(resumed.losses.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(full.losses[i], part.losses[i]) << i;
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(full.losses[2 + i], resumed.losses[i]) << i;
  EXPECT_EQ(full.eval_ce, resumed.eval_ce);
  EXPECT_GT(full.eval_bits_per_byte, 0);
  EXPECT_NE(log.str().find("memory-mapped"), std::string::npos) << log.str();
  }
}

}  // namespace
}  // namespace hs::dataset
