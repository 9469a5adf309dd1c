// Products of a few rows with a weight matrix, for inference: y[M, N] = x[M, K] W^T with W [N, K] row-major (the
// Hugging Face [out, in] layout, read where it lies, e.g. memory-mapped) and M <= kGemvMaxRows (the sequences of a
// decode step, or an expert's rows). Such a product is bound by the bytes of W: each row of W is streamed once for
// all M rows, sums accumulate in fp32, and threads split the rows of W (disjoint weight bytes per core). oneDNN
// spends more on the call than on the arithmetic at these shapes (one token of a `small` model is ~100 products).
// Blocks: 8 weight rows x 1 x row at M = 1 (AVX2 and AVX-512), 4 x 4 up to 4 rows, 3 x 8 (AVX-512-BF16) or 2 x 8
// (AVX-512F) above; 4 x 4 elsewhere. The AVX2 path keeps the AVX-512F path's 16 lanes as two 8-lane halves (same
// bits as AVX-512F), with two weight rows in turn for 1-2 x rows (4 FMA chains in flight per x row).
//
// Instruction sets are chosen at run time: AVX-512-BF16 (vdpbf16ps on bf16 x and W), AVX-512F, AVX2+FMA, scalar.
// HS_MAX_ISA caps the choice (kernels/cpu.h), and the isa argument forces one (tests run every path the machine
// allows). Every path sums the exact products x_k w_k in fp32 (only the
// order differs), so |y - y_exact| <= K * 2^-24 * sum_k |x_k w_k| (+ the output's rounding in bf16).
#pragma once
#include <cstdint>

#include "core/dtype.h"
#include "kernels/cpu.h"

namespace hs::kernels {

constexpr int64_t kGemvMaxRows = 16;

// The path gemv takes by default: the widest within cpu::level() (AVX-512-BF16, AVX-512F, AVX2 + FMA; an AMX CPU takes
// the AVX-512-BF16 one). An explicit `isa` argument forces a path: any level cpu::allows(), Scalar included.
cpu::Level gemv_level();

// y = x W^T. x rows are ldx elements apart, y rows ldy (0: packed). x and W are both fp32 or both bf16 (the compute
// dtype); y is fp32 or the compute dtype. Throws std::invalid_argument for M outside [0, kGemvMaxRows] or an isa the
// CPU lacks. Allocation-free after the first call at a given M*K (per calling thread).
template <typename T, typename TY>
void gemv(const T* x, const T* W, TY* y, int64_t M, int64_t N, int64_t K, int64_t ldx = 0, int64_t ldy = 0);
template <typename T, typename TY>
void gemv(const T* x, const T* W, TY* y, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldy, cpu::Level isa);

// For a caller that runs its own threads (one parallel region for a whole decode step, src/infer/fused_step.h):
// rows [n0, n1) of y = x W^T on the calling thread alone, no OpenMP. n0 and n1 must be multiples of
// gemv_row_align(M, isa) (n1 may also be N). Every element has the bits gemv gives it, whatever the split.
int64_t gemv_row_align(int64_t M, cpu::Level isa);

// Software prefetch: while a block of weight rows streams, the block `n` blocks later (within the same call's range)
// is prefetched line by line (0: none, the hardware prefetchers alone). By default (-1) 2 ahead for the 2 x 8 and 3 x 8 blocks
// (M > 4 on the AVX-512 paths: 2 weight rows in flight) and for fp32 weights (weight_bytes 4) at every blocking, none
// elsewhere; HS_GEMV_PREFETCH=n or the setter (for benchmarks) fixes n for every M and path. Results do not depend on
// it (a prefetch changes no value).
int gemv_prefetch_blocks(int64_t M, cpu::Level isa, size_t weight_bytes = 2);
void set_gemv_prefetch_blocks(int n);
template <typename T, typename TY>
void gemv_rows(const T* x, const T* W, TY* y, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldy, int64_t n0,
               int64_t n1, cpu::Level isa);

}  // namespace hs::kernels
