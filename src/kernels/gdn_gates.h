// Gated DeltaNet gates (fp32 outputs): beta = sigmoid(b), g = -exp(A_log[h]) * softplus(a + dt_bias[h]).
#pragma once
#include <cstdint>

#include "kernels/common.h"

namespace hs::kernels {

// b, a, beta, g are [rows, heads]; A_log and dt_bias are [heads]. g <= 0 is the per-step log-decay.
template <typename T>
void gdn_gates_forward(const T* b, const T* a, const float* A_log, const float* dt_bias, float* beta, float* g,
                       int64_t rows, int64_t heads);

// Accumulates db, da [rows, heads] and dA_log, ddt_bias [heads]. The per-head sums over rows are done
// by one thread per head in row order: bit-identical for any thread count.
template <typename T>
void gdn_gates_backward(const T* b, const T* a, const float* A_log, const float* dt_bias, const float* dbeta,
                        const float* dg, float* db, float* da, float* dA_log, float* ddt_bias, int64_t rows,
                        int64_t heads);

// Plain references, math in double: (T, P) in {(float, float), (bf16, float), (double, double)}.
// Defined in src/kernels/reference/ (hs_kernel_references: tests and benchmarks link it, the engine does not).
namespace reference {
template <typename T, typename P>
void gdn_gates_forward(const T* b, const T* a, const P* A_log, const P* dt_bias, P* beta, P* g, int64_t rows,
                       int64_t heads);
template <typename T, typename P>
void gdn_gates_backward(const T* b, const T* a, const P* A_log, const P* dt_bias, const P* dbeta, const P* dg, P* db,
                        P* da, P* dA_log, P* ddt_bias, int64_t rows, int64_t heads);
}  // namespace reference

}  // namespace hs::kernels
