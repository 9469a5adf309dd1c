#include "kernels/mlp.h"

#include <algorithm>
#include <limits>
#include <type_traits>

#include "core/compute.h"
#include "core/profile.h"
#include "kernels/common.h"
#include "kernels/cpu.h"
#include "kernels/matmul.h"
#include "kernels/simd.h"
#include "kernels/vec_math.h"

namespace hs::kernels {
namespace {

// Below this many elements an OpenMP region costs more than the loop (the MoE calls these per expert).
constexpr int64_t kMinParallelWork = int64_t{1} << 14;

}  // namespace

// The row kernels are compute bound (an exp and a divide per element): compiled once for AVX2 (the build's baseline)
// and once for AVX-512, whose 512-bit vectors halve their instructions; the detail:: entry points below run the
// widest copy this CPU allows under HS_MAX_ISA. The results do not depend on the vector width (element-wise
// arithmetic; only the row_dot reduction is reassociated, the same way for every thread count).
namespace mlp_avx2 {
#include "kernels/mlp_paths.inc"
}  // namespace mlp_avx2
HS_BEGIN_AVX512_PATHS
namespace mlp_avx512 {
#include "kernels/mlp_paths.inc"
}  // namespace mlp_avx512
HS_END_ISA_PATHS


// [W_gate; W_up] copied into one [2I, H] matrix (2 I H values, small next to the [tokens, 2I] activations), so
// gate and up run as one dense product: written side by side into a [tokens, 2I] block by two products instead
// (ldc = 2I), oneDNN 2.6 leaves its AMX kernels for a generic gemm ~2.7x slower on this machine.
template <typename T> struct PackedGateUp {
  Buffer copy;
  const T* ptr = nullptr;
  PackedGateUp(const T* w_gate, const T* w_up, int64_t inter, int64_t hidden, MemoryAccountant& mem) {
    const int64_t half = inter * hidden;
    copy = mem.allocate_n<T>(static_cast<size_t>(2 * half), MemCategory::Workspace, "swiglu.w_gate_up");
    ptr = copy.as<T>();
    compute(mem, [&] {
      std::copy_n(w_gate, half, copy.as<T>());
      std::copy_n(w_up, half, copy.as<T>() + half);
    });
  }
};

namespace pieces {

template <typename T>
void swiglu_act_rows(int64_t rows, int64_t inter, const T* gate_up, const float* scale, T* act) {
  HS_RETURN_WIDEST(mlp, act_rows_impl(rows, inter, gate_up, scale, act));
}

template <typename T>
void swiglu_grad_rows(int64_t rows, int64_t inter, const T* gate_up, const float* dact, const float* scale,
                      T* d_gate_up, float* row_dot) {
  HS_RETURN_WIDEST(mlp, grad_rows_impl(rows, inter, gate_up, dact, scale, d_gate_up, row_dot));
}

template <typename T>
void swiglu_act_grad_rows(int64_t rows, int64_t inter, const T* gate_up, const float* dact, const float* scale,
                          T* act, T* d_gate_up, float* row_dot) {
  HS_RETURN_WIDEST(mlp, act_grad_rows_impl(rows, inter, gate_up, dact, scale, act, d_gate_up, row_dot));
}

template <typename T>
void swiglu_backward_from(int64_t tokens, int64_t hidden, int64_t inter, const T* x, const T* w_gate, const T* w_up,
                          const T* w_down, const SwigluSaved& saved, const T* dyt, float* dx, float* dw_gate,
                          float* dw_up, float* dw_down, MemoryAccountant& mem, float* row_dot, bool accumulate_dx) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "swiglu_backward_from");
  const auto n_ti = static_cast<size_t>(tokens * inter);
  Buffer act = mem.allocate_n<T>(n_ti, MemCategory::Workspace, "swiglu.act");
  Buffer dact = mem.allocate_n<float>(n_ti, MemCategory::Workspace, "swiglu.dact");
  Buffer d_gate_up = mem.allocate_n<T>(2 * n_ti, MemCategory::Workspace, "swiglu.d_gate_up");
  PackedGateUp<T> wgu(w_gate, w_up, inter, hidden, mem);
  Buffer dw_gate_up = mem.allocate_n<float>(static_cast<size_t>(2 * inter * hidden), MemCategory::Workspace,
                                            "swiglu.dw_gate_up");
  compute(mem, [&] {
    if (tokens == 0) return;
    const T* gu = saved.gate_up.as<T>();
    T* dgu = d_gate_up.as<T>();
    matmul(dyt, w_down, dact.as<float>(), tokens, inter, hidden, false, false);  // dact = dy W_down
    // One pass recomputes act = silu(g) * u for dW_down and forms d(gate | up).
    swiglu_act_grad_rows(tokens, inter, gu, dact.as<float>(), nullptr, act.as<T>(), dgu, row_dot);
    matmul(dyt, act.as<T>(), dw_down, hidden, inter, tokens, true, false, true);  // dW_down += dy^T act
    // Gate and up as one dense product each way (dx += d(gate|up) [W_gate; W_up], d[W_gate; W_up] = d(gate|up)^T x).
    matmul(dgu, wgu.ptr, dx, tokens, hidden, 2 * inter, false, false, accumulate_dx);
    float* dwgu = dw_gate_up.as<float>();
    matmul(dgu, x, dwgu, 2 * inter, hidden, tokens, true, false, false);
    const int64_t half = inter * hidden;
#pragma omp parallel for simd schedule(static) if (half > 65536)
    for (int64_t i = 0; i < half; ++i) {
      dw_gate[i] += dwgu[i];
      dw_up[i] += dwgu[half + i];
    }
  });
}

}  // namespace pieces

template <typename T>
void swiglu_forward(int64_t tokens, int64_t hidden, int64_t inter, const T* x, const T* w_gate, const T* w_up,
                    const T* w_down, T* y, SwigluSaved* saved, MemoryAccountant& mem) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "swiglu_forward");
  Buffer gate_up = mem.allocate_n<T>(static_cast<size_t>(tokens * 2 * inter),
                                     saved ? MemCategory::Activations : MemCategory::Workspace, "swiglu.gate_up");
  Buffer act = mem.allocate_n<T>(static_cast<size_t>(tokens * inter), MemCategory::Workspace, "swiglu.act");
  PackedGateUp<T> wgu(w_gate, w_up, inter, hidden, mem);
  compute(mem, [&] {
    T* gu = gate_up.as<T>();
    // Gate and up land side by side in one [tokens, 2I] block, the layout the MoE uses too.
    matmul(x, wgu.ptr, gu, tokens, 2 * inter, hidden, false, true);
    pieces::swiglu_act_rows(tokens, inter, gu, nullptr, act.as<T>());
    matmul(act.as<T>(), w_down, y, tokens, hidden, inter, false, true);
  });
  if (saved) saved->gate_up = std::move(gate_up);
}

template <typename T>
void swiglu_backward(int64_t tokens, int64_t hidden, int64_t inter, const T* x, const T* w_gate, const T* w_up,
                     const T* w_down, const SwigluSaved& saved, const float* dy, float* dx, float* dw_gate,
                     float* dw_up, float* dw_down, MemoryAccountant& mem, float* row_dot, bool accumulate_dx) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "swiglu_backward");
  const auto n_th = static_cast<size_t>(tokens * hidden);
  // The products run in T, so a bf16 model multiplies bf16 gradients (as PyTorch autograd does).
  Buffer dy_cast;
  if constexpr (!std::is_same_v<T, float>) dy_cast = mem.allocate_n<T>(n_th, MemCategory::Workspace, "swiglu.dy");
  const T* dyt = compute(mem, [&] { return in_storage_type<T>(dy, dy_cast, n_th); });
  pieces::swiglu_backward_from(tokens, hidden, inter, x, w_gate, w_up, w_down, saved, dyt, dx, dw_gate, dw_up,
                               dw_down, mem, row_dot, accumulate_dx);
}


#define HS_INSTANTIATE_SWIGLU(T)                                                                                       \
  template void swiglu_forward<T>(int64_t, int64_t, int64_t, const T*, const T*, const T*, const T*, T*, SwigluSaved*, \
                                  MemoryAccountant&);                                                                  \
  template void swiglu_backward<T>(int64_t, int64_t, int64_t, const T*, const T*, const T*, const T*,                  \
                                   const SwigluSaved&, const float*, float*, float*, float*, float*,                   \
                                   MemoryAccountant&, float*, bool);                                                   \
  template void pieces::swiglu_act_rows<T>(int64_t, int64_t, const T*, const float*, T*);                              \
  template void pieces::swiglu_grad_rows<T>(int64_t, int64_t, const T*, const float*, const float*, T*, float*);     \
  template void pieces::swiglu_act_grad_rows<T>(int64_t, int64_t, const T*, const float*, const float*, T*, T*,      \
                                                float*);                                                             \
  template void pieces::swiglu_backward_from<T>(int64_t, int64_t, int64_t, const T*, const T*, const T*, const T*,   \
                                                const SwigluSaved&, const T*, float*, float*, float*, float*,        \
                                                MemoryAccountant&, float*, bool);
HS_INSTANTIATE_SWIGLU(float)
HS_INSTANTIATE_SWIGLU(bf16)
#undef HS_INSTANTIATE_SWIGLU
#undef HS_WIDE_SIMD

}  // namespace hs::kernels
