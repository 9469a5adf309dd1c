// Conventions shared by every kernel in this folder (kernels know nothing of models or files).
//
// * Storage types. Templates over T in {float, bf16} give the storage type of activations: the
//   forward's inputs and outputs and what is saved for backward. All arithmetic is fp32 (double in the
//   references). Gradients of activations and of parameters are always fp32.
// * Small parameters (norm weights, conv weights, A_log, dt_bias, gate vectors) are passed as
//   `const float*`; matrices are multiplied through kernels/matmul.h in the caller's compute dtype.
// * Layouts are row-major and contiguous; [B, T, heads, dim] means dim is fastest.
// * Backward functions ACCUMULATE (+=) into every gradient they produce, activations and parameters
//   alike (as in llm.c), so residual branches and shared weights need no extra adds. Callers zero.
// * Anything a kernel allocates (saved tensors, workspace) goes through the MemoryAccountant passed
//   in: saved tensors as MemCategory::Activations, scratch as MemCategory::Workspace. In planning
//   mode (mem.planning()) a kernel makes exactly the allocations it would make and returns without
//   touching data, so the planner's peak equals the real one.
// * OpenMP parallelises the outer loops; no kernel calls matmul() from inside a parallel region
//   (oneDNN runs its own threads).
// * Each kernel has a plain reference in namespace hs::kernels::reference (templated so it also runs
//   in double), the oracle for its tests together with central finite differences.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/dtype.h"
#include "core/memory.h"

namespace hs::kernels {

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
