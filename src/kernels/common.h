// Conventions shared by every kernel in this folder (kernels know nothing of models or files).
//
// * Storage types. Templates over T in {float, bf16} give the storage type of activations: the
//   forward's inputs and outputs and what is saved for backward. All arithmetic is fp32 (double in the
//   references). Gradients of activations and of parameters are fp32, except that a backward whose dx feeds
//   only a product in T may write dx in T: the rounding the product's input needs, done once by the producer
//   (the same bits, without an fp32 copy written and read back).
// * Small parameters (norm weights, conv weights, A_log, dt_bias, gate vectors) are passed as
//   `const float*`; matrices are multiplied through kernels/matmul.h in the caller's compute dtype.
// * Layouts are row-major and contiguous; [B, T, heads, dim] means dim is fastest.
// * Backward functions ACCUMULATE (+=) into every gradient they produce, activations and parameters
//   alike (as in llm.c), so residual branches and shared weights need no extra adds. Callers zero. Where a
//   backward is the first writer of an activation gradient it can take accumulate(_dx) = false and write it
//   instead, so the caller clears nothing.
// * Anything a kernel allocates (saved tensors, workspace) goes through the MemoryAccountant passed
//   in: saved tensors as MemCategory::Activations, scratch as MemCategory::Workspace. A kernel makes
//   its allocations, then does its arithmetic inside compute(mem, [&] { ... }) (core/compute.h), which
//   skips it in planning mode: the kernel never asks which mode it runs in, and makes the real run's
//   allocations in either, so the planner's peak equals the real one.
// * OpenMP parallelises the outer loops; no kernel calls matmul() from inside a parallel region
//   (oneDNN runs its own threads).
//   A forward loop over fewer than kParallelMinWork elements stays on the calling thread: a fork/join (a wake-up
//   from sleep under OMP_WAIT_POLICY=passive) costs more than such a loop, and a decode step runs ~10 of them per
//   layer on one token's rows. Each row's arithmetic is the same either way, so the bits do not change.
// * Each kernel has a plain reference in namespace hs::kernels::reference (templated so it also runs
//   in double), the oracle for its tests together with central finite differences.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/dtype.h"
#include "core/memory.h"

namespace hs::kernels {

inline constexpr int64_t kParallelMinWork = int64_t{1} << 14;

// A [rows, channels] matrix held as consecutive column blocks in separate row-major arrays (the Gated DeltaNet
// conv's channels are [q | k | v], each kept as its own tensor): block i holds cols[i] columns at data[i], row
// stride cols[i]. One block is a plain matrix.
template <typename E> struct ColumnBlocks {
  static constexpr int kMax = 4;
  E* data[kMax] = {};
  int64_t cols[kMax] = {};
  int count = 0;
  ColumnBlocks() = default;
  ColumnBlocks(E* whole, int64_t channels) { add(whole, channels); }
  ColumnBlocks& add(E* d, int64_t c) {
    if (count == kMax) throw std::invalid_argument("ColumnBlocks: more than " + std::to_string(kMax) + " blocks");
    data[count] = d;
    cols[count] = c;
    ++count;
    return *this;
  }
  int64_t channels() const {
    int64_t n = 0;
    for (int i = 0; i < count; ++i) n += cols[i];
    return n;
  }
  // f(pointer to (row, c), c - c0, n) for the runs of columns [c0, c0 + nc) of one row, block by block.
  template <typename F> void for_each_run(int64_t row, int64_t c0, int64_t nc, F&& f) const {
    int64_t start = 0;
    for (int i = 0; i < count && start < c0 + nc; start += cols[i], ++i) {
      const int64_t lo = c0 > start ? c0 : start, hi = c0 + nc < start + cols[i] ? c0 + nc : start + cols[i];
      if (lo < hi) f(data[i] + row * cols[i] + (lo - start), lo - c0, hi - lo);
    }
  }
};

// Packed documents (docs/model.md, "Packed documents"): `positions` [batch, seq] (int32, row b * seq + t) holds
// each token's position within its document: 0 where a document starts (always at t = 0), else the previous
// token's plus one. Token t sees tokens [t - positions[row], t] of its sequence: the causal conv, the delta rule's
// state and attention all restart at a document start. Null: each sequence is one document (0..seq-1).
// The first token of token t's document (within its sequence).
inline int64_t document_start(const int32_t* positions, int64_t row, int64_t t) {
  return positions ? t - positions[row] : 0;
}
// Throws std::invalid_argument unless `positions` (when not null) follows the rule above.
void check_positions(const int32_t* positions, int64_t batch, int64_t seq, const char* what);

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float siluf(float x) { return x * sigmoidf(x); }
// softplus with the same threshold PyTorch uses (beta 1, threshold 20).
inline float softplusf(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// An fp32 array (a gradient) in the storage type T, for a product that runs in T: x itself for float, else x
// converted into `scratch`, which holds n elements of T (callers allocate it only when T is not float).
template <typename T>
const T* in_storage_type(const float* x, const Buffer& scratch, size_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    convert(x, scratch.as<T>(), n);
    return scratch.as<T>();
  }
}

}  // namespace hs::kernels
