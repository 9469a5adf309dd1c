#include "kernels/gemv.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

// The intrinsics of every path are compiled with per-function target attributes, whatever -march says, and a path
// runs only where the CPU reports its features (cpu::allows).
#include "core/settings.h"
#include "kernels/cpu.h"
#include "kernels/simd.h"
#if defined(__x86_64__)
#define HS_GEMV_X86 1
#endif

namespace hs::kernels {
namespace {

// A block: R weight rows against up to XR x rows per pass (x rows from L1/L2, read again for each weight row). Every
// output is one accumulator per (x row, weight row) fed chunk by chunk in ascending k, then reduced across its lanes,
// so the order in which a block visits its rows never changes a bit. Blocks: 8 x 1 for one x row, 3 x 8 (AVX-512-BF16)
// or 2 x 8 (AVX-512F) for more than 4, else 4 x 4. Measured on the 2-core EPYC (Zen 4 class; AVX-512-BF16; 2 threads;
// same runs, alternated; bf16 weights out of DRAM):
//  * Up to 4 x rows, a block reads its rows in memory order, all of one row and then the next: 8 short rows read a
//    vector of each in turn are 8 short streams that the prefetchers serve badly. One x row against 64 MiB: 11-15
//    GB/s at K = 256 / 512 and 27-33 at K = 2048 in turn, 29-36 and 36-40 GB/s in memory order. The AVX2 path
//    takes its rows two at a time in turn for 1-2 x rows, the pairs in memory order (block_avx2: 4 FMA chains, not
//    2, per x row).
//  * More than 4 x rows, the rows go in turn within each chunk (rows_in_turn_avx512bf16): one row at a time keeps
//    only XR chains of 6-cycle vdpbf16ps in flight, 3 x 8 keeps 24 (8 x rows against 32 MiB, K = 2048: 90 against
//    151 GFLOP/s; real-width b8 decode 59.6 -> 81.7 tokens/s). At 2-4 x rows the same in turn order was slower at
//    K = 512 (the experts' down products of a real b8 step 6.6-7.3 -> 9.2-9.5 ms) and left as memory order.
//  * fp32 weights on the AVX-512F path (fp32 checkpoints, e.g. the `+mtp` models trained here) go in turn from 2 x
//    rows (rows_in_turn_avx512; measured on the Intel Xeon with AMX, 2-4 x rows, K = 256: 5-25% faster).
// Every kernel's sums stay in registers: the loops over x rows and weight rows are unrolled (GCC otherwise kept the
// accumulator arrays on the stack and stored them every iteration).
constexpr int kRowsPerBlock = 8;  // the most
constexpr int kXRows = 8;
// Below this many weight bytes one thread does the whole product: a fork/join costs more than it saves.
constexpr int64_t kParallelBytes = int64_t{1} << 19;
constexpr int64_t kChunkBytes = int64_t{1} << 17;

// A block: the sums s[m][r] = dot(x_m, w_r) for MB rows of x (fp32 or bf16, row stride ldx) and kRowsPerBlock rows
// of W (pointers, K apart in memory is not assumed).
template <typename TX, typename TW> struct Block {
  const TX* x;
  int64_t ldx;
  const TW* w[kRowsPerBlock];
  int64_t K;
  const TW* pf[kRowsPerBlock];  // rows to prefetch while this block streams (a later block's), or all null
};

// Which later block a block prefetches (0: none): HS_GEMV_PREFETCH or set_gemv_prefetch_blocks, else (-1) by the
// blocking: 2 blocks ahead for the blocks of more than 4 x rows, none for the others. Measured with the rows in turn
// (before the orders above): LM-head product 248320 x 2048 bf16, bench/weight_pages_bench.cpp: 2 x 8 blocks streamed
// 17-19 GB/s 2 ahead against 14.5 without, 8 x 1 blocks 0.92-1.0x with any distance. Since: 3 x 8 blocks, K = 2048
// out of DRAM, 19.0-20.3 GB/s 2 ahead against 17.3-17.6 without (gemv_bench 35b.in_proj_qkv b8). Not measured at
// 4 x 4 blocks (M 2-4, and M > 1 on AVX2).
std::atomic<int>& prefetch_setting() {
  static std::atomic<int> n = [] {
    const char* e = settings::value(settings::Setting::GemvPrefetch);
    return e ? std::max(0, std::atoi(e)) : -1;
  }();
  return n;
}
// fp32 weights prefetch 2 blocks ahead at every blocking: the dense `+mtp` model's fp32 decode step (K = 256, 1 KiB
// rows; bench/speculative_rollback_bench, 200 steps, alternated runs, AVX-512 and capped at AVX2) took 13-18% less
// with it, one row and a 3-row verification alike.
int prefetch_blocks(int R, size_t weight_bytes) {
  const int n = prefetch_setting().load(std::memory_order_relaxed);
  if (n >= 0) return n;
  return R == 2 || R == 3 || weight_bytes == 4 ? 2 : 0;  // only where measured to help: 2 x 8 (and 3 x 8) blocks, fp32
}

// ---- scalar -------------------------------------------------------------------------------------------------------
template <int MB, int R, typename TW> void block_scalar(const Block<float, TW>& b, float s[kXRows][kRowsPerBlock]) {
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      const float* xm = b.x + m * b.ldx;
      float acc = 0.0f;
      for (int64_t k = 0; k < b.K; ++k) acc += xm[k] * to_f32(b.w[r][k]);
      s[m][r] = acc;
    }
}

#if HS_GEMV_X86
// ---- AVX2 + FMA: the AVX-512F path's sums in 8-lane halves. Each output keeps the AVX-512F path's 16 lanes, lane l
// summing x_k w_k for k = l mod 16 in ascending k with fused multiply-adds, as two 8-lane accumulators (k mod 16 < 8
// and >= 8), then reduces them as _mm512_reduce_add_ps does (lane l + 8 to lane l, then l + 4, l + 2, l + 1: hsum8 of
// the halves' sum); the last K mod 16 terms are one more step on zero-padded copies (zero products added, as the
// AVX-512F path's masked loads do). So AVX2 and AVX-512F give the same bits. Two weight rows go in turn within each
// 16-element chunk (R even, 1-2 x rows), so 4 independent FMA chains per x row are in flight: one 8-lane chain per row (the path
// before) was bound by the FMAs' 4-cycle latency, ~2 elements a cycle. Measured (Xeon, AVX-512 capped to avx2 by
// HS_MAX_ISA, one thread, the loaded shared 2-core machine, per-CPU-second rates, variants alternated in one binary,
// median of 3): 1 x 8192 x 2048 bf16 4.9 -> 7.6-8.6 GB/s, 1 x 2048 x 512 7.1-7.7 -> 16-17, 1 x 512 x 256 (in L2)
// 9.0-10.6 -> 12.9-14.6, 8 x 8192 x 2048 2.4 -> 3.1. One row at a time in halves (2 chains) was between; 4 rows in
// turn, and bf16 weights split into even / odd lanes by a shift and a mask of one 256-bit load (x stored even / odd),
// were no better within the noise and are not kept.
using simd::hsum8;
using simd::load8;
template <int MB, int R, typename TW>
__attribute__((target("avx2,fma"))) void block_avx2(const Block<float, TW>& b, float s[kXRows][kRowsPerBlock]) {
  // Weight rows in turn: 2 for one or two x rows (4 * MB accumulators); 1 above, where 2 would not fit the 16 ymm
  // registers (4 x 4: 61 stack moves in the object code, 12 with one row; 2 * MB chains are enough there). R = 3
  // exists here only as a template (the AVX-512 paths' blocks).
  constexpr int RP = R % 2 == 0 && MB <= 2 ? 2 : 1;
  const int64_t K16 = b.K / 16 * 16;
  const int rem = static_cast<int>(b.K - K16);
  alignas(32) float xt[MB][16];  // the last K mod 16 elements of each x row, zero-padded
  if (rem)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < 16; ++j) xt[m][j] = j < rem ? b.x[m * b.ldx + K16 + j] : 0.0f;
  for (int r0 = 0; r0 < R; r0 += RP) {  // RP rows at a time, the groups in memory order (see kRowsPerBlock)
    __m256 lo[MB][RP], hi[MB][RP];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
      for (int p = 0; p < RP; ++p) lo[m][p] = hi[m][p] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
      __m256 wl[RP], wh[RP];
#pragma GCC unroll 8
      for (int p = 0; p < RP; ++p) {
        wl[p] = load8(b.w[r0 + p] + k);
        wh[p] = load8(b.w[r0 + p] + k + 8);
      }
      if (b.pf[0] && ((k * static_cast<int64_t>(sizeof(TW))) & 63) == 0)
#pragma GCC unroll 8
        for (int p = 0; p < RP; ++p) _mm_prefetch(reinterpret_cast<const char*>(b.pf[r0 + p] + k), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m256 xl = _mm256_loadu_ps(b.x + m * b.ldx + k), xh = _mm256_loadu_ps(b.x + m * b.ldx + k + 8);
#pragma GCC unroll 8
        for (int p = 0; p < RP; ++p) {
          lo[m][p] = _mm256_fmadd_ps(xl, wl[p], lo[m][p]);
          hi[m][p] = _mm256_fmadd_ps(xh, wh[p], hi[m][p]);
        }
      }
    }
    if (rem) {
      alignas(32) TW wt[16];
#pragma GCC unroll 8
      for (int p = 0; p < RP; ++p) {
        for (int j = 0; j < 16; ++j) wt[j] = j < rem ? b.w[r0 + p][K16 + j] : TW(0.0f);
        const __m256 wl = load8(wt), wh = load8(wt + 8);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          lo[m][p] = _mm256_fmadd_ps(_mm256_load_ps(xt[m]), wl, lo[m][p]);
          hi[m][p] = _mm256_fmadd_ps(_mm256_load_ps(xt[m] + 8), wh, hi[m][p]);
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
      for (int p = 0; p < RP; ++p) s[m][r0 + p] = hsum8(_mm256_add_ps(lo[m][p], hi[m][p]));
  }
}

// ---- AVX-512F: 16 lanes, x in fp32, W fp32 or bf16 widened on load; the tail is a masked load (zeros add +0).
using simd::load16;
// The block's R weight rows in turn within each 16-element chunk: MB x R independent FMA chains in flight (one row at a
// time has MB, and with MB <= 4 was bound by the FMAs' 4-cycle latency). Each output's chain is the same (x_k w_k in
// ascending k, then _mm512_reduce_add_ps), so the bits are those of one row at a time. Measured: fp32, K = 256, 30,000
// rows (31 MB, the dense `+mtp` model's size), 2 threads, three alternated runs on a loaded machine: M = 2 1.16-1.17
// ms against 1.18-1.57 one row at a time, M = 3 1.26-1.36 against 1.36-1.73, M = 4 1.39-1.51 against 1.46-1.79; the
// whole decode step of that model (bench/speculative_rollback_bench) did not separate the two orders beyond this
// loaded VM's noise at one x row.
template <int MB, int R, typename TW>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void rows_in_turn_avx512(const Block<float, TW>& b,
                                                                               float s[kXRows][kRowsPerBlock]) {
  __m512 acc[MB][R];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < b.K; k += 16) {
    const __mmask16 mask = b.K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (b.K - k)) - 1);
    __m512 w[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) w[r] = load16(b.w[r] + k, mask);
    if (b.pf[0] && ((k * static_cast<int64_t>(sizeof(TW))) & 63) == 0)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(b.pf[r] + k), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, b.x + m * b.ldx + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, w[r], acc[m][r]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) s[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

// Rows in turn only where measured to help: fp32 weights and 2 or more x rows (measured at 2-4: the speculative
// verification's N + 1 rows, small batches). One x row, and bf16 weights widened here, keep the memory order the
// header's measurements chose (one row's 16-lane chain streams as fast as the memory at one x row; a block's short
// rows read in turn were served worse by the prefetchers on the EPYC).
template <int MB, int R, typename TW>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void block_avx512(const Block<float, TW>& b,
                                                                        float s[kXRows][kRowsPerBlock]) {
  if constexpr (MB >= 2 && std::is_same_v<TW, float>) return rows_in_turn_avx512<MB, R, TW>(b, s);
  for (int r = 0; r < R; ++r) {  // each row in turn, in memory order (see kRowsPerBlock); its sums in registers
    __m512 acc[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < b.K; k += 16) {
      const __mmask16 mask = b.K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (b.K - k)) - 1);
      const __m512 w = load16(b.w[r] + k, mask);
      if (b.pf[0] && ((k * static_cast<int64_t>(sizeof(TW))) & 63) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(b.pf[r] + k), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, b.x + m * b.ldx + k), w, acc[m]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) s[m][r] = _mm512_reduce_add_ps(acc[m]);
  }
}

// ---- AVX-512-BF16: x and W in bf16, 32 products per vdpbf16ps (pairs summed into 16 fp32 lanes).
// More than 4 x rows (R = 3): the block's rows in turn within each 32-element chunk, R * MB sums in registers. One
// row in turn has only MB chains of vdpbf16ps (6 cycles each here) in flight; 3 x 8 keeps 24. 8 x rows against
// 32 MiB of bf16 weights, K = 2048, 2 threads, same run: 90 GFLOP/s one row at a time, 151 with three in turn
// (cache-resident, one thread: 82 against 161). The sums are the same either way.
template <int MB, int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void rows_in_turn_avx512bf16(
    const Block<bf16, bf16>& b, float s[kXRows][kRowsPerBlock]) {
  __m512 acc[MB][R];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < b.K; k += 32) {
    const __mmask32 mask = b.K - k >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (b.K - k)) - 1);
    __m512bh w[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) w[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, b.w[r] + k);
    if (b.pf[0])
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(b.pf[r] + k), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, b.x + m * b.ldx + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, w[r]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) s[m][r] = _mm512_reduce_add_ps(acc[m][r]);  // unrolled: acc stays in registers
}
template <int MB, int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void block_avx512bf16(
    const Block<bf16, bf16>& b, float s[kXRows][kRowsPerBlock]) {
  if constexpr (R == 3) return rows_in_turn_avx512bf16<MB, R>(b, s);
  for (int r = 0; r < R; ++r) {  // each row in turn, in memory order (see kRowsPerBlock); its sums in registers
    __m512 acc[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < b.K; k += 32) {
      const __mmask32 mask = b.K - k >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (b.K - k)) - 1);
      const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(mask, b.w[r] + k);
      if (b.pf[0]) _mm_prefetch(reinterpret_cast<const char*>(b.pf[r] + k), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, b.x + m * b.ldx + k), w);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) s[m][r] = _mm512_reduce_add_ps(acc[m]);
  }
}
#endif

// One block of x rows (mb of them) against one block of W rows with the chosen path.
template <typename TX, typename TW, int MB, int R>
void run_block(cpu::Level isa, const Block<TX, TW>& b, float s[kXRows][kRowsPerBlock]) {
  if constexpr (std::is_same_v<TX, bf16>) {
#if HS_GEMV_X86
    block_avx512bf16<MB, R>(b, s);
#endif
    (void)isa;
  } else {
    switch (isa) {
#if HS_GEMV_X86
      case cpu::Level::Avx512: block_avx512<MB, R>(b, s); return;
      case cpu::Level::Avx2: block_avx2<MB, R>(b, s); return;
#endif
      default: block_scalar<MB, R>(b, s); return;
    }
  }
}

// mb (1..8) x rows against the R weight rows of a 2 x 8 or 3 x 8 block.
template <typename TX, typename TW, int R>
void dispatch_up_to_8_rows(cpu::Level isa, int mb, const Block<TX, TW>& b, float s[kXRows][kRowsPerBlock]) {
  switch (mb) {
    case 1: run_block<TX, TW, 1, R>(isa, b, s); return;
    case 2: run_block<TX, TW, 2, R>(isa, b, s); return;
    case 3: run_block<TX, TW, 3, R>(isa, b, s); return;
    case 4: run_block<TX, TW, 4, R>(isa, b, s); return;
    case 5: run_block<TX, TW, 5, R>(isa, b, s); return;
    case 6: run_block<TX, TW, 6, R>(isa, b, s); return;
    case 7: run_block<TX, TW, 7, R>(isa, b, s); return;
    default: run_block<TX, TW, 8, R>(isa, b, s); return;
  }
}

// mb x rows against R weight rows: R = 8 with mb = 1, R = 4 with mb <= 4, R = 2 or 3 with mb <= 8.
template <typename TX, typename TW>
void dispatch_block(cpu::Level isa, int mb, int R, const Block<TX, TW>& b, float s[kXRows][kRowsPerBlock]) {
  if (R == 8) return run_block<TX, TW, 1, 8>(isa, b, s);
  if (R == 3) return dispatch_up_to_8_rows<TX, TW, 3>(isa, mb, b, s);
  if (R == 2) return dispatch_up_to_8_rows<TX, TW, 2>(isa, mb, b, s);
  switch (mb) {
    case 1: run_block<TX, TW, 1, 4>(isa, b, s); return;
    case 2: run_block<TX, TW, 2, 4>(isa, b, s); return;
    case 3: run_block<TX, TW, 3, 4>(isa, b, s); return;
    default: run_block<TX, TW, 4, 4>(isa, b, s); return;
  }
}

// The blocks [blk0, blk1) of y = x W^T (R weight rows each, R and the x rows per pass as chosen for M and isa); x as
// the path reads it (bf16 for avx512bf16, else fp32 rows ldx apart). Each output is one block's sum whatever the
// range, so any split of the blocks gives the same bits.
template <typename TX, typename TW, typename TY>
void product_blocks(cpu::Level isa, const TX* x, int64_t ldx, const TW* W, TY* y, int64_t ldy, int64_t M, int64_t N,
                    int64_t K, int R, int XR, int64_t blk0, int64_t blk1) {
  const int pf = prefetch_blocks(R, sizeof(TW));
  for (int64_t blk = blk0; blk < blk1; ++blk) {
    const int64_t n0 = blk * R, nr = std::min<int64_t>(R, N - n0);
    Block<TX, TW> b{x, ldx, {}, K, {}};
    // A short last block repeats its last row (computed, not stored).
    for (int r = 0; r < R; ++r) b.w[r] = W + (n0 + std::min<int64_t>(r, nr - 1)) * K;
    if (pf > 0 && blk + pf < blk1) {
      const int64_t p0 = (blk + pf) * R, pr = std::min<int64_t>(R, N - p0);
      for (int r = 0; r < R; ++r) b.pf[r] = W + (p0 + std::min<int64_t>(r, pr - 1)) * K;
    }
    for (int64_t m0 = 0; m0 < M; m0 += XR) {
      const int mb = static_cast<int>(std::min<int64_t>(XR, M - m0));
      b.x = x + m0 * ldx;
      float s[kXRows][kRowsPerBlock];
      dispatch_block(isa, mb, R, b, s);
      b.pf[0] = nullptr;  // the next pass over x rows reads the block from cache: prefetched once is enough
      for (int m = 0; m < mb; ++m)
        for (int64_t r = 0; r < nr; ++r) y[(m0 + m) * ldy + n0 + r] = from_f32<TY>(s[m][r]);
    }
  }
}

// Weight rows per block and x rows per pass: 8 x 1 for one x row on the AVX2 and AVX-512 paths (AVX2 too since the
// real-width b1 decode under HS_MAX_ISA=avx2 measured 20.0-20.4 -> 21.2-21.5 tokens/s with it), 3 x 8 (AVX-512-BF16)
// or 2 x 8 for more than 4 on AVX-512; else 4 x 4.
struct Blocking {
  int R, XR;
};
inline Blocking blocking(cpu::Level isa, int64_t M) {
  const bool avx512 = isa == cpu::Level::Avx512 || isa == cpu::Level::Avx512Bf16;
  if ((avx512 || isa == cpu::Level::Avx2) && M == 1) return {8, 1};
  if (isa == cpu::Level::Avx512Bf16 && M > 4) return {3, 8};
  if (avx512 && M > 4) return {2, 8};
  return {4, 4};
}

// y = x W^T over all blocks of W's rows.
template <typename TX, typename TW, typename TY>
void product(cpu::Level isa, const TX* x, int64_t ldx, const TW* W, TY* y, int64_t ldy, int64_t M, int64_t N,
             int64_t K) {
  const auto [R, XR] = blocking(isa, M);
  const int64_t blocks = (N + R - 1) / R;
  const int64_t block_bytes = R * K * static_cast<int64_t>(sizeof(TW));
  const bool parallel = blocks * block_bytes >= kParallelBytes;
  // Threads take chunks of ~kChunkBytes of W as they come free: on a shared machine one thread may be descheduled
  // for a while, and the other then streams its part instead of waiting at the end (each output is still one
  // thread's sum, so the bits do not depend on who computes it).
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / block_bytes);
  if (!parallel) return product_blocks(isa, x, ldx, W, y, ldy, M, N, K, R, XR, 0, blocks);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t c = 0; c < (blocks + chunk - 1) / chunk; ++c)
    product_blocks(isa, x, ldx, W, y, ldy, M, N, K, R, XR, c * chunk, std::min(blocks, (c + 1) * chunk));
}

// The path of level `isa` (AMX has none of its own: the AVX-512-BF16 one); throws when it is above cpu::level().
cpu::Level path_of(cpu::Level isa, const char* what) {
  if (!cpu::allows(isa))
    throw std::invalid_argument(std::string(what) + ": the " + cpu::level_name(isa) +
                                " path is above the level in force (" + cpu::level_name(cpu::level()) + ")");
#if HS_GEMV_X86
  return isa == cpu::Level::Amx ? cpu::Level::Avx512Bf16 : isa;
#else
  return cpu::Level::Scalar;
#endif
}

}  // namespace

cpu::Level gemv_level() { return path_of(cpu::level(), "gemv"); }

template <typename T, typename TY>
void gemv(const T* x, const T* W, TY* y, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldy, cpu::Level isa) {
  if (M < 0 || M > kGemvMaxRows)
    throw std::invalid_argument("gemv: " + std::to_string(M) + " rows (at most " + std::to_string(kGemvMaxRows) + ")");
  isa = path_of(isa, "gemv");
  if (M == 0 || N <= 0) return;
  if (ldx == 0) ldx = K;
  if (ldy == 0) ldy = N;
  if (K <= 0) {
    for (int64_t m = 0; m < M; ++m) std::fill_n(y + m * ldy, N, from_f32<TY>(0.0f));
    return;
  }
  if constexpr (std::is_same_v<T, bf16>) {
    if (isa == cpu::Level::Avx512Bf16) return product(isa, x, ldx, W, y, ldy, M, N, K);
  }
  if (isa == cpu::Level::Avx512Bf16) isa = cpu::Level::Avx512;  // fp32 operands: the AVX-512F path
  if constexpr (std::is_same_v<T, float>) {
    product(isa, x, ldx, W, y, ldy, M, N, K);
  } else {
    // bf16 x widened once to fp32 (exact), in a per-thread scratch that only grows.
    thread_local std::vector<float> xf;
    if (xf.size() < static_cast<size_t>(M * K)) xf.resize(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xf[static_cast<size_t>(m * K + k)] = to_f32(x[m * ldx + k]);
    product(isa, xf.data(), K, W, y, ldy, M, N, K);
  }
}

int gemv_prefetch_blocks(int64_t M, cpu::Level isa, size_t weight_bytes) {
  return prefetch_blocks(blocking(path_of(isa, "gemv"), M).R, weight_bytes);
}
void set_gemv_prefetch_blocks(int n) { prefetch_setting().store(std::max(-1, n), std::memory_order_relaxed); }

int64_t gemv_row_align(int64_t M, cpu::Level isa) { return blocking(path_of(isa, "gemv_rows"), M).R; }

template <typename T, typename TY>
void gemv_rows(const T* x, const T* W, TY* y, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldy, int64_t n0,
               int64_t n1, cpu::Level isa) {
  if (M < 0 || M > kGemvMaxRows)
    throw std::invalid_argument("gemv_rows: " + std::to_string(M) + " rows (at most " + std::to_string(kGemvMaxRows) +
                                ")");
  isa = path_of(isa, "gemv_rows");
  const int64_t align = gemv_row_align(M, isa);
  if (n0 < 0 || n1 > N || n0 > n1 || (n0 % align != 0) || (n1 % align != 0 && n1 != N))
    throw std::invalid_argument("gemv_rows: rows [" + std::to_string(n0) + ", " + std::to_string(n1) +
                                ") are not a block range of " + std::to_string(N));
  if (M == 0 || n0 == n1) return;
  if (ldx == 0) ldx = K;
  if (ldy == 0) ldy = N;
  if (K <= 0) {
    for (int64_t m = 0; m < M; ++m) std::fill(y + m * ldy + n0, y + m * ldy + n1, from_f32<TY>(0.0f));
    return;
  }
  // gemv_rows' blocks are gemv_row_align(M, isa)'s, so an fp32 product on an AVX-512-BF16 CPU takes its 3 x 8
  // blocks (M > 4) on the AVX-512F path below, where gemv() would take 2 x 8: the same sums, a different grouping.
  const auto [R, XR] = blocking(isa, M);
  const int64_t b0 = n0 / R, b1 = (n1 + R - 1) / R;
  if constexpr (std::is_same_v<T, bf16>) {
    if (isa == cpu::Level::Avx512Bf16) return product_blocks(isa, x, ldx, W, y, ldy, M, N, K, R, XR, b0, b1);
  }
  if (isa == cpu::Level::Avx512Bf16) isa = cpu::Level::Avx512;
  if constexpr (std::is_same_v<T, float>) {
    product_blocks(isa, x, ldx, W, y, ldy, M, N, K, R, XR, b0, b1);
  } else {
    thread_local std::vector<float> xf;
    if (xf.size() < static_cast<size_t>(M * K)) xf.resize(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xf[static_cast<size_t>(m * K + k)] = to_f32(x[m * ldx + k]);
    product_blocks(isa, xf.data(), K, W, y, ldy, M, N, K, R, XR, b0, b1);
  }
}

template <typename T, typename TY>
void gemv(const T* x, const T* W, TY* y, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldy) {
  gemv(x, W, y, M, N, K, ldx, ldy, gemv_level());
}

#define HS_INSTANTIATE(T, TY)                                                                               \
  template void gemv<T, TY>(const T*, const T*, TY*, int64_t, int64_t, int64_t, int64_t, int64_t);         \
  template void gemv<T, TY>(const T*, const T*, TY*, int64_t, int64_t, int64_t, int64_t, int64_t, cpu::Level);  \
  template void gemv_rows<T, TY>(const T*, const T*, TY*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,  \
                                 int64_t, cpu::Level);
HS_INSTANTIATE(float, float)
HS_INSTANTIATE(bf16, float)
HS_INSTANTIATE(bf16, bf16)
#undef HS_INSTANTIATE

}  // namespace hs::kernels
