// Token embedding lookup and its gradient scatter.
#pragma once
#include <cstdint>

#include "kernels/common.h"

namespace hs::kernels {

// out[i, :] = table[ids[i], :] for i < n; table is [vocab, dim] in the weight storage type TW, out is
// [n, dim] in the activation storage type TA. Every id is checked before anything is written: an id
// outside [0, vocab) throws std::out_of_range naming the id, its position and the vocab.
// Instantiated for TW, TA in {float, bf16}.
template <typename TW, typename TA>
void embedding_forward(const int32_t* ids, int64_t n, const TW* table, int64_t vocab, int64_t dim, TA* out);

// dtable[ids[i], :] += dout[i, :]. Columns are partitioned over threads and every thread visits the
// tokens in order, so repeated ids accumulate in the same order for any thread count (bit-identical
// results, no atomics). Ids are checked as in the forward.
void embedding_backward(const int32_t* ids, int64_t n, const float* dout, int64_t vocab, int64_t dim, float* dtable);

// The table in vocabulary pieces: `rows` holds table rows [first, first + count) ([count, dim]). The forward
// writes out[i, :] only for the tokens whose id falls in the piece (the rest of out is left as it is, so the
// pieces 0..P-1 together write every row); the backward adds dout[i, :] into drows[ids[i] - first, :] for those
// tokens, in token order as embedding_backward, so a table's pieces get the same sums as the whole table. Every id
// is checked against [0, vocab) as above.
template <typename TW, typename TA>
void embedding_forward_rows(const int32_t* ids, int64_t n, const TW* rows, int64_t first, int64_t count, int64_t vocab,
                            int64_t dim, TA* out);
void embedding_backward_rows(const int32_t* ids, int64_t n, const float* dout, int64_t first, int64_t count,
                             int64_t vocab, int64_t dim, float* drows);

// Defined in src/kernels/reference/ (hs_kernel_references: tests and benchmarks link it, the engine does not).
namespace reference {
// Instantiated for (TW, TA) in {float, bf16}^2 and (double, double).
template <typename TW, typename TA>
void embedding_forward(const int32_t* ids, int64_t n, const TW* table, int64_t vocab, int64_t dim, TA* out);
// P in {float, double}.
template <typename P>
void embedding_backward(const int32_t* ids, int64_t n, const P* dout, int64_t vocab, int64_t dim, P* dtable);
}  // namespace reference

}  // namespace hs::kernels
