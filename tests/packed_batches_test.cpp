// The data side of packed documents (train::sample_batch / eval_batch with a Packing): positions restart after every
// document separator and the separator's target (the next document's first token) is ignored, the windows and ids are
// those of the stream, and --packing stream gives today's batches bit for bit.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dataset/token_file.h"
#include "test_util.h"
#include "train/data.h"

namespace hs::train {
namespace {

using dataset::TokenFile;
using dataset::TokenFileWriter;

constexpr int32_t kSep = 299;

// A token file of byte documents separated by id 299.
TokenSource documents_file(const test::TempDir& t, const std::vector<std::string>& docs) {
  dataset::Vocabulary v;
  v.fingerprint = 1;
  v.size = 300;
  v.end_of_text = kSep;
  v.token_bytes.assign(300, 1);
  v.token_bytes.back() = 0;
  TokenFileWriter w(t / "docs.tok", v, [](std::string_view s, int) {
    std::vector<uint32_t> ids;
    for (char c : s) ids.push_back(static_cast<unsigned char>(c));
    return ids;
  });
  for (const auto& d : docs) w.add_document(d);
  w.commit();
  return TokenSource::mapped(TokenFile::open(t / "docs.tok"));
}

// What every packed row must satisfy, against its own inputs.
void expect_packed_row(const TokenBatch& b, int64_t r) {
  for (int64_t j = 0; j < b.seq; ++j) {
    const size_t i = static_cast<size_t>(r * b.seq + j);
    const int32_t want = j == 0 || b.inputs[i - 1] == kSep ? 0 : b.positions[i - 1] + 1;
    ASSERT_EQ(b.positions[i], want) << "row " << r << " token " << j;
    if (b.inputs[i] == kSep) {
      ASSERT_EQ(b.targets[i], -1) << "a separator predicts another document";
    }
  }
}

TEST(PackedBatches, PositionsRestartAfterEachSeparatorAndItsTargetIsIgnored) {
  test::TempDir t;
  std::vector<std::string> docs;
  for (int i = 0; i < 40; ++i) docs.push_back(std::string(static_cast<size_t>(1 + (i * 37) % 90), char('a' + i % 26)));
  const TokenSource src = documents_file(t, docs);
  ASSERT_TRUE(src.document_separator().has_value());
  EXPECT_TRUE(packs_documents(src, Packing::Auto));
  int64_t restarts = 0;
  for (int64_t step : {0, 1, 5}) {
    const TokenBatch stream = sample_batch(src, 4, 96, 3, step);
    const TokenBatch same = sample_batch(src, 4, 96, 3, step, Packing::Stream);
    const TokenBatch packed = sample_batch(src, 4, 96, 3, step, Packing::Documents);
    EXPECT_TRUE(stream.positions.empty());
    EXPECT_EQ(stream.inputs, same.inputs);
    EXPECT_EQ(stream.targets, same.targets);
    EXPECT_TRUE(same.positions.empty());
    // The same windows; only the separators' targets differ.
    EXPECT_EQ(packed.inputs, stream.inputs);
    ASSERT_EQ(packed.positions.size(), packed.inputs.size());
    for (size_t i = 0; i < packed.targets.size(); ++i)
      EXPECT_EQ(packed.targets[i], packed.inputs[i] == kSep ? -1 : stream.targets[i]);
    for (int64_t r = 0; r < 4; ++r) expect_packed_row(packed, r);
    for (size_t i = 1; i < packed.positions.size(); ++i) restarts += packed.positions[i] == 0 && i % 96 != 0;
  }
  EXPECT_GT(restarts, 10);  // the windows do cross documents
  const int64_t n = eval_batch_count(src.size(), 50, 3);
  int64_t predicted_stream = 0, predicted_packed = 0, separators = 0;
  for (int64_t i = 0; i < n; ++i) {
    const TokenBatch s = eval_batch(src, 50, 3, i), p = eval_batch(src, 50, 3, i, Packing::Documents);
    EXPECT_EQ(s.inputs, p.inputs);
    for (int64_t r = 0; r < p.batch; ++r) expect_packed_row(p, r);
    for (size_t j = 0; j < s.targets.size(); ++j) {
      predicted_stream += s.targets[j] >= 0;
      predicted_packed += p.targets[j] >= 0;
      separators += s.targets[j] >= 0 && s.inputs[j] == kSep;
    }
  }
  EXPECT_EQ(predicted_stream, src.size() - 1);
  EXPECT_EQ(predicted_packed, predicted_stream - separators);
  EXPECT_EQ(separators, 39);  // one between each two documents, each predicted by the stream only
}

TEST(PackedBatches, AutoIsStreamForASingleDocumentOrMemoryTokens) {
  test::TempDir t;
  const TokenSource one = documents_file(t, {"just one document"});
  EXPECT_FALSE(one.document_separator().has_value());
  EXPECT_FALSE(packs_documents(one, Packing::Auto));
  EXPECT_FALSE(packs_documents(TokenSource::in_memory({1, 2, 3}), Packing::Auto));
  EXPECT_TRUE(packs_documents(one, Packing::Documents));
  const TokenBatch b = sample_batch(one, 2, 8, 1, 0, Packing::Documents);
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t j = 0; j < 8; ++j) EXPECT_EQ(b.positions[static_cast<size_t>(r * 8 + j)], j);
}

// Version 2: a pre-tokenized document with its loss mask among text documents. The file reads back the ids and the
// mask (1 for the text documents' tokens and the separators), its header says version 2; the sampled and evaluated
// targets are -1 exactly where the predicted token's mask is 0, in both packings. A file without masks stays
// version 1 and reads as before.
TEST(PackedBatches, LossMaskSectionRoundTripsAndMasksTargets) {
  test::TempDir t;
  dataset::Vocabulary v;
  v.fingerprint = 1;
  v.size = 300;
  v.end_of_text = kSep;
  v.token_bytes.assign(300, 1);
  v.token_bytes.back() = 0;
  auto bytes = [](std::string_view s, int) {
    std::vector<uint32_t> ids;
    for (char c : s) ids.push_back(static_cast<unsigned char>(c));
    return ids;
  };
  std::vector<int32_t> chat(200), want_ids, want_mask;
  std::vector<uint8_t> chat_mask(200);
  for (size_t i = 0; i < chat.size(); ++i) {
    chat[i] = static_cast<int32_t>(100 + i % 50);
    chat_mask[i] = (i / 20) % 2;  // alternating turns of 20 tokens
  }
  TokenFileWriter w(t / "mask.tok", v, bytes);
  w.add_document(std::string(150, 'a'));
  w.add_tokens(chat, chat_mask);
  w.add_document(std::string(120, 'b'));
  const dataset::TokenFileHeader h = w.commit();
  EXPECT_EQ(h.version, 2u);
  for (int i = 0; i < 150; ++i) want_ids.push_back('a'), want_mask.push_back(1);
  want_ids.push_back(kSep), want_mask.push_back(1);
  for (size_t i = 0; i < chat.size(); ++i) want_ids.push_back(chat[i]), want_mask.push_back(chat_mask[i]);
  want_ids.push_back(kSep), want_mask.push_back(1);
  for (int i = 0; i < 120; ++i) want_ids.push_back('b'), want_mask.push_back(1);
  const auto f = TokenFile::open(t / "mask.tok");
  ASSERT_TRUE(f->has_mask());
  EXPECT_EQ(f->header().version, 2u);
  EXPECT_EQ(f->header().documents, 3);
  const TokenSource src = TokenSource::mapped(f);
  ASSERT_EQ(src.size(), static_cast<int64_t>(want_ids.size()));
  std::vector<int32_t> ids(want_ids.size());
  std::vector<uint8_t> mask(want_ids.size());
  src.read(0, src.size(), ids.data());
  src.read_mask(0, src.size(), mask.data());
  EXPECT_EQ(ids, want_ids);
  EXPECT_EQ(std::vector<int32_t>(mask.begin(), mask.end()), want_mask);
  for (Packing p : {Packing::Stream, Packing::Documents}) {
    int64_t masked = 0;
    for (int64_t step = 0; step < 20; ++step) {
      const TokenBatch b = sample_batch(src, 2, 64, 7, step, p);
      const TokenBatch plain = sample_batch(src, 2, 64, 7, step, Packing::Stream);
      for (size_t i = 0; i < b.targets.size(); ++i) {
        // The window's token after i: its mask decides (the separators' own rule aside).
        const bool sep = p == Packing::Documents && b.inputs[i] == kSep;
        if (b.targets[i] == -1 && !sep) ++masked;
        if (!sep && plain.targets[i] >= 0) {
          // Find the token's place: windows are contiguous, so compare through the ids.
          ASSERT_TRUE(b.targets[i] == -1 || b.targets[i] == plain.targets[i]);
        }
      }
    }
    EXPECT_GT(masked, 0) << packing_name(p);
  }
  // Evaluation: every token after the first is predicted once, except the masked ones.
  int64_t predicted = 0;
  for (int64_t i = 0; i < eval_batch_count(src.size(), 50, 2); ++i)
    for (int32_t x : eval_batch(src, 50, 2, i).targets) predicted += x >= 0;
  int64_t unmasked = 0;
  for (size_t i = 1; i < want_mask.size(); ++i) unmasked += want_mask[i];
  EXPECT_EQ(predicted, unmasked);
  // A file without masks is version 1, as before.
  TokenFileWriter w1(t / "plain.tok", v, bytes);
  w1.add_document("abc");
  EXPECT_EQ(w1.commit().version, 1u);
  EXPECT_FALSE(TokenFile::open(t / "plain.tok")->has_mask());
  // A mask of another length is refused, naming both lengths.
  TokenFileWriter w2(t / "bad.tok", v, bytes);
  const std::string e = test::error_of([&] { w2.add_tokens(chat, std::span<const uint8_t>(chat_mask).first(10)); });
  EXPECT_NE(e.find("200 ids came with a loss mask of 10 entries"), std::string::npos) << e;
}

TEST(PackedBatches, PackingFlagValues) {
  EXPECT_EQ(parse_packing("documents"), Packing::Documents);
  EXPECT_EQ(parse_packing("stream"), Packing::Stream);
  EXPECT_EQ(parse_packing("auto"), Packing::Auto);
  EXPECT_THROW(parse_packing("docs"), std::invalid_argument);
  for (Packing p : {Packing::Auto, Packing::Stream, Packing::Documents}) EXPECT_EQ(parse_packing(packing_name(p)), p);
}

}  // namespace
}  // namespace hs::train
