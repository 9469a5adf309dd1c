// Matrix products through oneDNN (the v2 API shipped by Debian's libdnnl-dev 2.6). Primitives are
// created once per shape/layout and cached. With bf16 inputs oneDNN runs its AMX / AVX-512 bf16
// kernels and accumulates in fp32. Skinny products (one dimension <= 16 and another larger, in the
// layouts the model uses: x W^T with few outputs, dy W with few inputs, dy^T x with few rows) run on
// hybridscan's own loops instead, also accumulating in fp32, with each sum in a fixed order.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace hs::kernels {

// C = op(A) op(B)  (or C += ... when accumulate), all row-major.
//   op(A) is [M, K]: A is stored [M, K] (lda >= K) or, with trans_a, [K, M] (lda >= M).
//   op(B) is [K, N]: B is stored [K, N] (ldb >= N) or, with trans_b, [N, K] (ldb >= K).
//   C is [M, N] with ldc >= N.
// A leading dimension of 0 means "packed" (the row length given by the shape).
// For a linear layer with weight W [out, in] (the Hugging Face layout): y = x W^T is
// matmul(x, W, y, T, out, in, false, true); dx = dy W is matmul(dy, W, dx, T, in, out, false, false);
// dW += dy^T x is matmul(dy, x, dW, out, in, T, true, false, true).
struct MatmulLayout {
  int64_t lda = 0, ldb = 0, ldc = 0;
  // The caller issues this product with many different row counts (an expert's rows): one primitive takes the
  // count at execution instead of one primitive per count. The rows are M (A not transposed), or K for a
  // weight gradient dW += A^T B (A transposed: the rows are summed over).
  bool varying_rows = false;
};

void matmul(const float* A, const float* B, float* C, int64_t M, int64_t N, int64_t K, bool trans_a,
            bool trans_b, bool accumulate = false, MatmulLayout ld = {});
void matmul(const bf16* A, const bf16* B, float* C, int64_t M, int64_t N, int64_t K, bool trans_a,
            bool trans_b, bool accumulate = false, MatmulLayout ld = {});
void matmul(const bf16* A, const bf16* B, bf16* C, int64_t M, int64_t N, int64_t K, bool trans_a,
            bool trans_b, bool accumulate = false, MatmulLayout ld = {});

// The plain triple loop in double precision, the oracle for tests.
template <typename TA, typename TC>
void matmul_reference(const TA* A, const TA* B, TC* C, int64_t M, int64_t N, int64_t K, bool trans_a,
                      bool trans_b, bool accumulate = false);

// Number of distinct primitives created so far (tests check that the cache is used).
int64_t matmul_primitives_created();

// Inference: while one of these lives on a thread, that thread's products x W^T (trans_b, A not transposed, no
// accumulation, B packed) of at most kGemvMaxRows rows run on gemv (kernels/gemv.h), which streams W once for all
// rows, instead of oneDNN, whose per-call cost dominates such products. Decoding sets it around a step (the layer
// code it shares with training stays as it is); training never does, so its products and their bits are unchanged.
class SmallRowProducts {
 public:
  SmallRowProducts();
  ~SmallRowProducts();
  SmallRowProducts(const SmallRowProducts&) = delete;
  SmallRowProducts& operator=(const SmallRowProducts&) = delete;

 private:
  bool previous_;
};

}  // namespace hs::kernels
