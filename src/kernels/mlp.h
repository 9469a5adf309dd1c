// The SwiGLU feed-forward block of the dense Qwen3.5 models (and the MoE's shared expert):
// y = down(silu(gate(x)) * up(x)), weights in the Hugging Face [out, in] layout, all products through
// kernels/matmul.h in the storage type T (bf16 x bf16 -> fp32 accumulate).
#pragma once
#include <cstdint>

#include "core/dtype.h"
#include "core/memory.h"

namespace hs::kernels {

// Saved for backward: the gate and up pre-activations [tokens, 2 * inter] in T (gate in columns
// 0..inter-1, up in inter..2*inter-1). silu(gate) * up is recomputed in backward.
struct SwigluSaved {
  Buffer gate_up;
};

// x [tokens, hidden]; w_gate, w_up [inter, hidden]; w_down [hidden, inter]; y [tokens, hidden].
// saved == nullptr: inference (the pre-activations are workspace, freed on return).
template <typename T>
void swiglu_forward(int64_t tokens, int64_t hidden, int64_t inter, const T* x, const T* w_gate, const T* w_up,
                    const T* w_down, T* y, SwigluSaved* saved, MemoryAccountant& mem);

// Accumulates into dw_gate, dw_up [inter, hidden], dw_down [hidden, inter], and into dx [tokens, hidden] (or,
// with accumulate_dx = false, writes dx: the caller needs no cleared buffer).
// row_dot (optional, [tokens], overwritten) receives sum_i dact[t, i] * act[t, i] with act = silu(g) * u
// and dact = dy W_down, which equals <dy[t], y[t]>: the gradient of a per-token gate multiplying y
// (the MoE's shared-expert gate) without keeping y itself.
template <typename T>
void swiglu_backward(int64_t tokens, int64_t hidden, int64_t inter, const T* x, const T* w_gate, const T* w_up,
                     const T* w_down, const SwigluSaved& saved, const float* dy, float* dx, float* dw_gate,
                     float* dw_up, float* dw_down, MemoryAccountant& mem, float* row_dot = nullptr,
                     bool accumulate_dx = true);

// Row-wise SwiGLU pieces, a public part of this interface: the MoE's grouped experts and the fused decode step
// (src/infer/fused_step.h) compose them.
namespace pieces {
// gate_up is [rows, 2 * inter] in T.
// act[r, i] = T(scale[r] * silu(g) * u) (scale == nullptr: 1). g and u are the stored T values, so the
// forward and the recomputation in backward agree bit for bit.
template <typename T>
void swiglu_act_rows(int64_t rows, int64_t inter, const T* gate_up, const float* scale, T* act);
// From dact [rows, inter] (fp32): d_gate_up[r] = scale[r] * (dact * u * silu'(g) | dact * silu(g)) in T
// and, when row_dot != nullptr, row_dot[r] = sum_i dact * silu(g) * u (before scaling).
template <typename T>
void swiglu_grad_rows(int64_t rows, int64_t inter, const T* gate_up, const float* dact, const float* scale,
                      T* d_gate_up, float* row_dot);
// Both of the above in one pass (one sigmoid per element): act as swiglu_act_rows(rows, inter, gate_up,
// scale, act) and d_gate_up, row_dot as swiglu_grad_rows, bit for bit.
template <typename T>
void swiglu_act_grad_rows(int64_t rows, int64_t inter, const T* gate_up, const float* dact, const float* scale,
                          T* act, T* d_gate_up, float* row_dot);
// swiglu_backward with dy already in T (dyt [tokens, hidden]), e.g. scaled and rounded by the caller in the
// same pass; swiglu_backward(dy) is this with dyt = T(dy).
template <typename T>
void swiglu_backward_from(int64_t tokens, int64_t hidden, int64_t inter, const T* x, const T* w_gate, const T* w_up,
                          const T* w_down, const SwigluSaved& saved, const T* dyt, float* dx, float* dw_gate,
                          float* dw_up, float* dw_down, MemoryAccountant& mem, float* row_dot = nullptr,
                     bool accumulate_dx = true);
}  // namespace pieces

// Defined in src/kernels/reference/ (hs_kernel_references: tests and benchmarks link it, the engine does not).
namespace reference {
// Plain loops in S (float or double); the same maths without intermediate rounding.
template <typename S>
void swiglu_forward(int64_t tokens, int64_t hidden, int64_t inter, const S* x, const S* w_gate, const S* w_up,
                    const S* w_down, S* y);
// Accumulates (+=) like the fast kernel.
template <typename S>
void swiglu_backward(int64_t tokens, int64_t hidden, int64_t inter, const S* x, const S* w_gate, const S* w_up,
                     const S* w_down, const S* dy, S* dx, S* dw_gate, S* dw_up, S* dw_down);
}  // namespace reference

}  // namespace hs::kernels
