#include "kernels/embedding.h"

#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/profile.h"

namespace hs::kernels {
namespace {

// Checked serially before any parallel region: an exception cannot leave an OpenMP loop.
void check_ids(const int32_t* ids, int64_t n, int64_t vocab) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      throw std::out_of_range("embedding: token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                              " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

// Columns per backward task: an equal share per thread, rounded up to whole 64-byte lines so no two
// threads write the same line. The share may depend on the thread count: each element's sum still runs
// over the tokens in order.
int64_t column_block(int64_t dim) {
  const int64_t share = (dim + omp_get_max_threads() - 1) / omp_get_max_threads();
  return std::max<int64_t>(16, (share + 15) / 16 * 16);
}

}  // namespace

template <typename TW, typename TA>
void embedding_forward(const int32_t* ids, int64_t n, const TW* table, int64_t vocab, int64_t dim, TA* out) {
  embedding_forward_rows(ids, n, table, 0, vocab, vocab, dim, out);  // every row is in the one piece
}

void embedding_backward(const int32_t* ids, int64_t n, const float* dout, int64_t vocab, int64_t dim, float* dtable) {
  embedding_backward_rows(ids, n, dout, 0, vocab, vocab, dim, dtable);
}

template <typename TW, typename TA>
void embedding_forward_rows(const int32_t* ids, int64_t n, const TW* rows, int64_t first, int64_t count, int64_t vocab,
                            int64_t dim, TA* out) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "embedding_forward");
  check_ids(ids, n, vocab);
#pragma omp parallel for schedule(static) if (n * dim >= kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = static_cast<int64_t>(ids[i]) - first;
    if (row < 0 || row >= count) continue;
    const TW* src = rows + row * dim;
    TA* dst = out + i * dim;
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) dst[c] = from_f32<TA>(to_f32(src[c]));
  }
}

void embedding_backward_rows(const int32_t* ids, int64_t n, const float* dout, int64_t first, int64_t count,
                             int64_t vocab, int64_t dim, float* drows) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "embedding_backward");
  check_ids(ids, n, vocab);
  const int64_t block = column_block(dim), nblocks = (dim + block - 1) / block;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t c0 = blk * block, c1 = std::min(dim, c0 + block);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = static_cast<int64_t>(ids[i]) - first;
      if (row < 0 || row >= count) continue;
      float* dst = drows + row * dim;
      const float* src = dout + i * dim;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
    }
  }
}

#define HS_EMBED_ROWS(TW, TA)                                                                                       \
  template void embedding_forward_rows<TW, TA>(const int32_t*, int64_t, const TW*, int64_t, int64_t, int64_t, int64_t, \
                                               TA*);
HS_EMBED_ROWS(float, float)
HS_EMBED_ROWS(float, bf16)
HS_EMBED_ROWS(bf16, float)
HS_EMBED_ROWS(bf16, bf16)
#undef HS_EMBED_ROWS

template void embedding_forward<float, float>(const int32_t*, int64_t, const float*, int64_t, int64_t, float*);
template void embedding_forward<float, bf16>(const int32_t*, int64_t, const float*, int64_t, int64_t, bf16*);
template void embedding_forward<bf16, float>(const int32_t*, int64_t, const bf16*, int64_t, int64_t, float*);
template void embedding_forward<bf16, bf16>(const int32_t*, int64_t, const bf16*, int64_t, int64_t, bf16*);

}  // namespace hs::kernels
