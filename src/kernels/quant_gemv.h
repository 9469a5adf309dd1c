// Products of a few activation rows with a quantized weight matrix (GGUF blocks, kernels/quant.h), for decoding:
// y[M, N] = x[M, K] W^T, W [N, K] stored as N rows of ggml_row_bytes(type, K) bytes (as a .gguf file holds a
// tensor of ne = {K, N}), M <= kGemvMaxRows. Like kernels::gemv it is bound by the bytes of W: each weight block is
// read once for all M rows, threads split the rows of W.
//
// The activations are quantized per row first, as llama.cpp does: 32-element blocks of int8 for Q8_0 / Q4_0 weights
// (scale kept in fp32, where llama.cpp's Q8_0 rounds it to fp16), Q8_K super-blocks (ggml's quantize_row_q8_K_ref)
// for the K-quants. Every weight-block x activation-block product is then an exact integer dot.
//
// The arithmetic, the same on every path (Scalar, AVX2, AVX-512; VNNI or not), hence bit-identical results:
// for each output (m, n), 8 fp32 lanes acc[i] and one fp32 `off`, all starting at 0; for each weight block b in
// order (a 32-element block, or a 256-element super-block):
//   f = dx * dw                                          (fp32 product: the activation's and the block's scale)
//   T_i = sum over the block's 32-element chunks c of sc(c, i) * sum_{j<4} q[32c + 4i + j] * xq[32c + 4i + j]
//                                                         (exact int32; q the stored level, sc the sub-block scale)
//   acc[i] = fma(f, float(T_i), acc[i])
//   off = fma(f, float(O), off)          with O the level offset's integer: Q4_0 -8 sum(xq), Q6_K -32 sum sc * sum xq
//   off = fma(dx * dmin, float(-Mn), off)  (Q4_K, Q5_K: Mn = sum over sub-blocks of min * sum xq)
// and y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)) + off.
// The bound: |y - sum_k w_k x^q_k| <= (nb + 8) 2^-24 sum |terms| (fp32 sums of exact products), x^q the quantized
// activations; the activations' own quantization error is llama.cpp's.
// Q8_0 weights must lie in [-127, 127] (every quantizer writes them so; AVX2's sign trick cannot negate -128).
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/cpu.h"
#include "kernels/gemv.h"
#include "kernels/quant.h"

namespace hs::kernels {

// The weight types the products take: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K.
bool quant_gemv_supports(GgmlType t);
// The path quant_gemv takes by default: AVX-512 where allowed, else AVX2. Both work on 256-bit registers, one weight
// row per register; the dots are vpdpbusd where the CPU has it (AVX-512-VNNI at the AVX-512 level; AVX-VNNI, the VEX
// form, at either level), else vpmaddubsw + vpmaddwd.
cpu::Level quant_gemv_level();
// For tests and benchmarks: whether the paths may use vpdpbusd (default: yes, where the CPU has it). Results do not
// depend on it.
void set_quant_gemv_vnni(bool allowed);
bool quant_gemv_uses_vnni();

// An activation block for Q8_0 / Q4_0 weights: 32 int8 (x / d to nearest, ties to even, as ggml's AVX2
// quantize_row_q8_0 rounds; d = max |x| / 127), the fp32 scale, and the sum of the int8 (for Q4_0's offset of 8).
struct QuantAct32 {
  int8_t qs[kQK];
  float d;
  int32_t sum;
};
static_assert(sizeof(QuantAct32) == 40);

// Activation rows quantized for one weight type: M rows of K elements, each row K/32 blocks (Q8_0 / Q4_0 weights)
// or K/256 Q8_K super-blocks (K-quants).
struct QuantizedRows {
  GgmlType weight_type = GgmlType::Q8_0;
  int64_t M = 0, K = 0;
  int64_t row_bytes = 0;
  std::vector<uint8_t> data;  // reused across calls (no allocation once large enough)
  // When set, the rows are written here instead (external_bytes must hold M * row_bytes; quantize_rows throws
  // std::invalid_argument otherwise): memory the caller accounts for (the prefill's workspace).
  uint8_t* external = nullptr;
  size_t external_bytes = 0;
  const uint8_t* row(int64_t m) const { return (external ? external : data.data()) + m * row_bytes; }
};
// Bytes of M activation rows of K elements quantized for weights of type t (QuantizedRows::row_bytes * M).
int64_t quantized_rows_bytes(GgmlType t, int64_t M, int64_t K);
// x (fp32 or bf16; rows ldx apart, 0: K) quantized for products with weights of type t. K must be a multiple of t's
// block. Throws std::invalid_argument for a type without products.
template <typename T> void quantize_rows(GgmlType t, const T* x, int64_t M, int64_t K, int64_t ldx, QuantizedRows& out);

// y = x W^T (y rows ldy apart, 0: N): quantizes x, then quant_gemv_rows over all N on OpenMP threads.
template <typename T>
void quant_gemv(GgmlType t, const T* x, const void* W, float* y, int64_t M, int64_t N, int64_t K, int64_t ldx = 0,
                int64_t ldy = 0);
template <typename T>
void quant_gemv(GgmlType t, const T* x, const void* W, float* y, int64_t M, int64_t N, int64_t K, int64_t ldx,
                int64_t ldy, cpu::Level isa);

// Row m of xq as the values the products use (d * q), n = K floats.
void dequantize_quantized_row(const QuantizedRows& xq, int64_t m, float* out);

// Rows [n0, n1) of y = xq W^T on the calling thread alone (no OpenMP), for callers with their own threads. Every
// element has the bits quant_gemv gives it, whatever the split.
void quant_gemv_rows(const QuantizedRows& xq, const void* W, float* y, int64_t ldy, int64_t n0, int64_t n1,
                     cpu::Level isa);

// Only the given row ranges [first, second) of W are read and only those y columns written (the rest of y is left
// as it was): a mixture of experts stacked as one [E * F, K] matrix passes its routed experts' ranges
// [e * F, (e + 1) * F). Ranges are split among OpenMP threads; the bits are quant_gemv's.
void quant_gemv_ranges(const QuantizedRows& xq, const void* W, float* y, int64_t ldy,
                       const std::vector<std::pair<int64_t, int64_t>>& ranges, cpu::Level isa);

// Prefill products: y[M, N] = x[M, K] W^T for any M (fp32 y, rows ldy apart). Three ways, chosen by `how`:
//  * Int8: the decode arithmetic above for every row (x quantized per row, weight rows in tiles that stay in cache
//    while all of x passes over them): the same bits as quant_gemv gives each row.
//  * Dequantized: tiles of weight rows dequantized to x's dtype (fp32, or bf16: the weights rounded to bf16) and
//    multiplied by kernels::matmul (oneDNN).
//  * DequantizedBf16: the same in bf16 whatever x's dtype: fp32 x rounded to bf16 once (to nearest even), the tiles
//    dequantized to bf16, oneDNN's bf16 products (AMX or AVX-512-BF16) summing in fp32. Each input is off by at most
//    2^-9 of itself: finer than Int8's Q8 activations (up to half a quantum, 1/254 of a block's largest) and, for
//    the 4-6 bit types, far below the weights' own quantization step.
// The default (Auto) is the one measured faster (docs/quantization.md): int8 for M <= kGemvMaxRows (a few rows: the
// decode product, each weight block read once; a dequantized tile would cost more than the product); above it,
// DequantizedBf16 where oneDNN makes bf16 products on this CPU (matmul_bf16_on_onednn), elsewhere Dequantized for fp32
// x, and for bf16 x dequantized for Q8_0 / Q4_0 and int8 for the K-quants.
enum class QuantMatmul { Auto, Int8, Dequantized, DequantizedBf16 };
// The way Auto takes for these shapes and activations (never Auto).
QuantMatmul quant_matmul_way(GgmlType t, int64_t M, QuantMatmul how, bool fp32_activations);
// Scratch bytes quant_matmul needs for these shapes and way (x in T): the quantized activation rows (int8), or one
// dequantized tile of weight rows (dequantized; DequantizedBf16 with fp32 x: also x's rows in bf16).
template <typename T> int64_t quant_matmul_workspace_bytes(GgmlType t, int64_t M, int64_t N, int64_t K, QuantMatmul how);
// workspace: null (quant_matmul allocates its scratch itself), or at least quant_matmul_workspace_bytes bytes,
// 64-byte aligned (std::invalid_argument if too small).
template <typename T>
void quant_matmul(GgmlType t, const T* x, const void* W, float* y, int64_t M, int64_t N, int64_t K, int64_t ldx = 0,
                  int64_t ldy = 0, QuantMatmul how = QuantMatmul::Auto, void* workspace = nullptr,
                  int64_t workspace_bytes = 0);

namespace reference {
// The sums quant_gemv rounds, in double: y[m, n] = sum_k w_k x_k with w the dequantized weights (dequantize_row) and x
// the quantized activations (dequantize_quantized_row), and mag[m, n] = sum_k |x_k| (|scale part of w_k| + |offset
// part of w_k|), the magnitude fp32 rounding errors scale with (the offset: Q4_0's 8 d, Q4_K / Q5_K's dmin * min,
// Q6_K's 32 d sc). Both [M, N] row-major.
void quant_gemv(const QuantizedRows& xq, const void* W, int64_t N, std::vector<double>& y, std::vector<double>& mag);
}  // namespace reference

}  // namespace hs::kernels
