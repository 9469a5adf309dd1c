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
// plus chunk floats; nothing else, whatever N is. Throws std::out_of_range for a target >= V.
template <typename T>
XentResult lm_head_xent(const T* x, const T* W, const int32_t* targets, int64_t tokens, int64_t hidden, int64_t vocab,
                        float grad_scale, float* dx, float* dW, MemoryAccountant& mem, int64_t chunk = 0);

namespace reference {
// The naive version: all logits at once, in S (float or double). Accumulates dx, dW when given.
template <typename S>
XentResult lm_head_xent(const S* x, const S* W, const int32_t* targets, int64_t tokens, int64_t hidden, int64_t vocab,
                        S grad_scale, S* dx, S* dW);
}  // namespace reference

}  // namespace hs::kernels
