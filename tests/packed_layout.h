// The packed batch the packed-documents tests share (packed_kernels_test.cpp per kernel, packed_documents_test.cpp
// through the whole model): two sequences of kSeq tokens, one packing documents of lengths 1, 63, 64, 65, 127, the
// other 300 and 20, so that documents start at chunk and attention-tile edges (64, 128) and inside them (1, 193, 300).
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace hs::test::packed {

constexpr int64_t kSeq = 320;
inline const std::vector<std::vector<int64_t>> kDocs = {{1, 63, 64, 65, 127}, {300, 20}};

// A document: sequence b, positions [start, start + len).
struct Doc {
  int64_t b, start, len;
};

inline std::vector<Doc> documents() {
  std::vector<Doc> out;
  for (int64_t b = 0; b < static_cast<int64_t>(kDocs.size()); ++b) {
    int64_t at = 0;
    for (int64_t len : kDocs[b]) {
      out.push_back({b, at, len});
      at += len;
    }
    EXPECT_EQ(at, kSeq);
  }
  return out;
}

// Every token's position in its document, sequence after sequence (the positions the kernels and batches take).
inline std::vector<int32_t> positions() {
  std::vector<int32_t> pos;
  for (const auto& seq : kDocs)
    for (int64_t len : seq)
      for (int64_t i = 0; i < len; ++i) pos.push_back(static_cast<int32_t>(i));
  return pos;
}

// Rows [d.start, d.start + d.len) of sequence d.b of a [B, kSeq, width] array, as a [1, len, width] array.
template <typename E>
std::vector<E> rows_of(const std::vector<E>& x, const Doc& d, int64_t width = 1) {
  const auto first = x.begin() + (d.b * kSeq + d.start) * width;
  return std::vector<E>(first, first + d.len * width);
}

}  // namespace hs::test::packed
