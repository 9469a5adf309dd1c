// Embedding: lookup for every (table, activation) storage pair, the gradient scatter with repeated ids
// against the reference and finite differences, thread-count independence, and the out-of-range error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/embedding.h"
#include "test_util.h"

namespace hs::kernels {
namespace {

using test::cast;
using test::randn;
using test::widen;

// Repeats on purpose (3, 0, 9 occur several times) so the scatter has to accumulate.
const std::vector<int32_t> kIds = {3, 0, 9, 3, 7, 3, 1, 0, 9, 5, 3, 2, 8};
constexpr int64_t kVocab = 10;

// The lookup is a copy plus at most one rounding (fp32 -> bf16) done the same way by both sides:
// bit-exact.
template <typename TW, typename TA> void forward_matches_reference(int64_t dim) {
  const int64_t n = static_cast<int64_t>(kIds.size());
  const auto table = cast<TW>(randn(kVocab * dim, 1));
  std::vector<TA> out(n * dim), out_ref(n * dim);
  embedding_forward(kIds.data(), n, table.data(), kVocab, dim, out.data());
  reference::embedding_forward(kIds.data(), n, table.data(), kVocab, dim, out_ref.data());
  EXPECT_EQ(0, std::memcmp(out.data(), out_ref.data(), out.size() * sizeof(TA)));
  EXPECT_EQ(to_f32(out[2 * dim + dim - 1]), to_f32(from_f32<TA>(to_f32(table[9 * dim + dim - 1]))));  // ids[2] = 9
}

TEST(Embedding, ForwardMatchesReferenceAllStorageTypes) {
  for (int64_t dim : {1, 37, 100}) {
    forward_matches_reference<float, float>(dim);
    forward_matches_reference<float, bf16>(dim);
    forward_matches_reference<bf16, float>(dim);
    forward_matches_reference<bf16, bf16>(dim);
  }
}

// The fast scatter adds each token's row into dtable in token order, in fp32, exactly as the reference
// does: bit-exact, including the non-zero starting values (accumulation).
TEST(Embedding, BackwardMatchesReference) {
  for (int64_t dim : {1, 37, 100}) {
    const int64_t n = static_cast<int64_t>(kIds.size());
    const auto dout = randn(n * dim, 2);
    std::vector<float> dtable(kVocab * dim, 0.5f), dtable_ref(dtable);
    embedding_backward(kIds.data(), n, dout.data(), kVocab, dim, dtable.data());
    reference::embedding_backward(kIds.data(), n, dout.data(), kVocab, dim, dtable_ref.data());
    EXPECT_EQ(0, std::memcmp(dtable.data(), dtable_ref.data(), dtable.size() * sizeof(float))) << dim;
    EXPECT_EQ(dtable[4 * dim], 0.5f);  // id 4 never occurs
  }
}

// The loss sum(dout * embed(table)) is linear in the table, so central differences are exact up to
// round-off (~1e-10 with h = 1e-6): 1e-8 absolute.
TEST(Embedding, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t n = static_cast<int64_t>(kIds.size()), dim = 3;
  auto table = widen(randn(kVocab * dim, 3));
  const auto dout = widen(randn(n * dim, 4));
  std::vector<double> out(n * dim), dtable(kVocab * dim);
  auto loss = [&] {
    reference::embedding_forward(kIds.data(), n, table.data(), kVocab, dim, out.data());
    double l = 0;
    for (int64_t i = 0; i < n * dim; ++i) l += dout[i] * out[i];
    return l;
  };
  reference::embedding_backward(kIds.data(), n, dout.data(), kVocab, dim, dtable.data());
  test::expect_grad_matches_fd(table, dtable, loss, "dtable", 0.0, 1e-8);
}

TEST(Embedding, BackwardIndependentOfThreadCount) {
  std::mt19937 rng(5);
  const int64_t n = 500, vocab = 17, dim = 70;
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
  const auto dout = randn(n * dim, 6);
  std::vector<float> d1(vocab * dim), d3(vocab * dim);
  test::with_threads(1, [&] { embedding_backward(ids.data(), n, dout.data(), vocab, dim, d1.data()); });
  test::with_threads(3, [&] { embedding_backward(ids.data(), n, dout.data(), vocab, dim, d3.data()); });
  EXPECT_EQ(0, std::memcmp(d1.data(), d3.data(), d1.size() * sizeof(float)));
}

// An out-of-range id is reported with its value, position and the vocabulary, before anything is written.
// The table in pieces of 1, 3 (the last one 1 row) and 4 rows and the whole vocabulary: the pieces' lookups together
// write every row exactly as the whole lookup, and their scatter-adds give the whole table's sums to the bit (a
// piece misplaced, skipped or visited twice would not).
TEST(Embedding, RowPiecesGiveTheWholeTableToTheBit) {
  const int64_t n = static_cast<int64_t>(kIds.size());
  for (int64_t dim : {1, 37}) {
    const auto table = cast<bf16>(randn(kVocab * dim, 3));
    const auto dout = randn(n * dim, 4);
    std::vector<float> out0(n * dim), dt0(kVocab * dim, 0.25f);
    embedding_forward(kIds.data(), n, table.data(), kVocab, dim, out0.data());
    embedding_backward(kIds.data(), n, dout.data(), kVocab, dim, dt0.data());
    for (int64_t rows : {1, 3, 4, 10}) {
      std::vector<float> out(n * dim, -7.0f), dt(kVocab * dim, 0.25f);
      for (int64_t a = 0; a < kVocab; a += rows) {
        const int64_t c = std::min(rows, kVocab - a);
        embedding_forward_rows(kIds.data(), n, table.data() + a * dim, a, c, kVocab, dim, out.data());
        std::vector<float> piece(dt.begin() + a * dim, dt.begin() + (a + c) * dim);
        embedding_backward_rows(kIds.data(), n, dout.data(), a, c, kVocab, dim, piece.data());
        std::copy(piece.begin(), piece.end(), dt.begin() + a * dim);
      }
      EXPECT_EQ(out, out0) << "rows " << rows;
      EXPECT_EQ(dt, dt0) << "rows " << rows;
    }
    // One piece writes only its own tokens' rows.
    std::vector<float> out(n * dim, -7.0f);
    embedding_forward_rows(kIds.data(), n, table.data() + 3 * dim, 3, 1, kVocab, dim, out.data());
    for (int64_t i = 0; i < n; ++i)
      EXPECT_EQ(out[i * dim], kIds[i] == 3 ? out0[i * dim] : -7.0f) << i;
  }
  std::vector<int32_t> bad = {1, 10};
  std::vector<float> out(2), d(1);
  EXPECT_THROW(embedding_forward_rows(bad.data(), 2, out.data(), 0, 1, kVocab, 1, out.data()), std::out_of_range);
  EXPECT_THROW(embedding_backward_rows(bad.data(), 2, out.data(), 0, 1, kVocab, 1, d.data()), std::out_of_range);
}

TEST(Embedding, OutOfRangeIdThrows) {
  const int64_t dim = 4;
  const auto table = randn(kVocab * dim, 7);
  for (int32_t bad : {-1, static_cast<int32_t>(kVocab), 1000000}) {
    const std::vector<int32_t> ids = {1, 2, bad, 3};
    std::vector<float> out(ids.size() * dim, 42.0f), dtable(kVocab * dim, 0.0f);
    try {
      embedding_forward(ids.data(), 4, table.data(), kVocab, dim, out.data());
      ADD_FAILURE() << "no exception for id " << bad;
    } catch (const std::out_of_range& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("position 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(kVocab)), std::string::npos) << msg;
    }
    EXPECT_EQ(out[0], 42.0f);
    EXPECT_THROW(embedding_backward(ids.data(), 4, out.data(), kVocab, dim, dtable.data()), std::out_of_range);
    EXPECT_EQ(dtable[dim], 0.0f);
  }
}

}  // namespace
}  // namespace hs::kernels
