// The final projection fused with cross-entropy. Tokens are processed in chunks so that the
// [tokens x vocab] logits (vocab up to 248k) never exist at once: per chunk, logits = x W^T in fp32,
// log-sum-exp in fp32, and (for training) the logits' gradient is formed in place and multiplied back
// into dx and dW before the next chunk.
#pragma once
#include <cstdint>

#include "core/dtype.h"
#include "core/memory.h"

namespace hs::kernels {

struct XentResult {
  double loss_sum = 0;  // sum of -log p(target) over counted tokens
  int64_t count = 0;    // tokens with target >= 0
};

// The default chunk: max(1, floor(64 MiB / (4 * vocab))) tokens, so a chunk's fp32 logits take at
// most 64 MiB (67 tokens at vocab 248320, 110 at 151936) while the matmul still sees enough rows.
int64_t default_xent_chunk(int64_t vocab);

// x [N, H], W [V, H] in T; targets [N], entries < 0 are ignored. Returns the sum and the count.
// If dx != nullptr also runs the backward of loss_total = grad_scale * loss_sum, accumulating dx [N, H]
// and, unless dW == nullptr, dW [V, H]. chunk <= 0 picks default_xent_chunk(V). Workspace (via mem):
// chunk x V fp32 logits, plus chunk x V in T for the logits' gradient when T is bf16 and dx != nullptr,
// plus chunk floats; nothing else, whatever N is. Throws std::out_of_range for a target >= V. plan_backward: the
// backward runs even though dx is null, as over shapes in planning mode (every buffer null); callers pass it with a
// real dx.
template <typename T>
XentResult lm_head_xent(const T* x, const T* W, const int32_t* targets, int64_t tokens, int64_t hidden, int64_t vocab,
                        float grad_scale, float* dx, float* dW, MemoryAccountant& mem, int64_t chunk = 0,
                        bool plan_backward = false);

// The LM head in vocabulary pieces: piece k is rows [k * rows, min(V, (k + 1) * rows)) of W [V, H], which the
// caller provides (gathered or cast) when asked and may free when told, so that W never exists whole.
template <typename T>
class XentPieces {
 public:
  virtual ~XentPieces() = default;
  // Piece k's rows, [rows_k, H] in T, valid until the next call of weights() for another piece or finish().
  virtual const T* weights(int64_t k) = 0;
  // Backward: where piece k's dW [rows_k, H] (fp32, zeroed or holding earlier sums) accumulates; null: no dW.
  virtual float* grad(int64_t k) = 0;
  // Backward: piece k's dW is complete (after its grad()).
  virtual void grad_done(int64_t k) = 0;
};

// lm_head_xent over W in pieces of `rows` rows (the last may be shorter): the forward visits pieces 0..P-1, keeping
// per token a running maximum M and sum S of exp(logit - M) (a piece's own maximum m and sum s join as
// S = S e^(M - M') + s e^(m - M'), M' = max(M, m)) and picking up the target's logit in its piece; the loss is
// M + log S - logit(target). With dx: the backward visits the pieces again in reverse (P-1 first: the forward's
// last piece, not asked for twice), recomputes each piece's logits and forms grad_scale (e^(l - M) / S - onehot)
// with the final M, S, accumulating dx and the piece's dW (asked for with grad(k), handed back with grad_done(k)).
// Tokens are chunked as in lm_head_xent (default_xent_chunk of the piece's rows). One piece (rows >= V) gives
// lm_head_xent's arithmetic (both use the same per-row formulas). Workspace via mem: chunk x rows fp32 logits (and
// in T for bf16 with dx), and 3 N floats (M, S, the target's logit). The source's calls happen in planning mode
// too, in the same order (plan_backward: whether the backward runs there, dx being null over shapes). Throws
// std::out_of_range for a target >= V, std::invalid_argument for rows < 1.
template <typename T>
XentResult lm_head_xent_pieced(const T* x, const int32_t* targets, int64_t tokens, int64_t hidden, int64_t vocab,
                               int64_t rows, XentPieces<T>& pieces, float grad_scale, float* dx, MemoryAccountant& mem,
                               int64_t chunk = 0, bool plan_backward = false);

// Defined in src/kernels/reference/ (hs_kernel_references: tests and benchmarks link it, the engine does not).
namespace reference {
// The naive version: all logits at once, in S (float or double). Accumulates dx, dW when given.
template <typename S>
XentResult lm_head_xent(const S* x, const S* W, const int32_t* targets, int64_t tokens, int64_t hidden, int64_t vocab,
                        S grad_scale, S* dx, S* dW);
}  // namespace reference

}  // namespace hs::kernels
