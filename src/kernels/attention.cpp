// Gated attention's dispatch: the flash-style kernels of attention_paths.inc, compiled once per instruction set
// (AVX2; AVX-512F; AVX-512-BF16 with AMX), the widest this CPU runs under HS_MAX_ISA chosen at each call
// (kernels/cpu.h). bf16 storage takes bf16 dot products only on the last; elsewhere it is widened to fp32 for the
// products, so the paths differ in the order and precision of their sums (tests/attention_test.cpp bounds each
// against the reference).
#include "kernels/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "core/compute.h"
#include "core/profile.h"
#include "kernels/cpu.h"
#include "kernels/simd.h"
#include "kernels/vec_math.h"

// The .inc counts as a header to GCC, which then warns of its lambdas capturing types of its anonymous namespace.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsubobject-linkage"
#define HS_ATTENTION_PATH attention_avx2
#define HS_ATTENTION_BF16_DOT 0
#define HS_ATTENTION_AMX 0
#define HS_ATTENTION_AVX2 1
#include "kernels/attention_paths.inc"
#undef HS_ATTENTION_AVX2
#define HS_ATTENTION_AVX2 0
#undef HS_ATTENTION_PATH
#undef HS_ATTENTION_BF16_DOT
#undef HS_ATTENTION_AMX

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
#define HS_ATTENTION_PATH attention_avx512
#define HS_ATTENTION_BF16_DOT 0
#define HS_ATTENTION_AMX 0
#include "kernels/attention_paths.inc"
#undef HS_ATTENTION_PATH
#undef HS_ATTENTION_BF16_DOT
#undef HS_ATTENTION_AMX
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
#define HS_ATTENTION_PATH attention_avx512_bf16
#define HS_ATTENTION_BF16_DOT 1
#define HS_ATTENTION_AMX 1
#include "kernels/attention_paths.inc"
#undef HS_ATTENTION_PATH
#undef HS_ATTENTION_BF16_DOT
#undef HS_ATTENTION_AMX
#pragma GCC pop_options
#undef HS_ATTENTION_AVX2
#pragma GCC diagnostic pop

namespace hs::kernels {

template <typename T>
void gated_attention_forward(const AttentionShape& shape, const T* q, const T* k, const T* v, const T* gate, T* out,
                             AttentionSaved* saved, MemoryAccountant& mem) {
  if (cpu::allows(cpu::Level::Avx512Bf16))
    return attention_avx512_bf16::gated_attention_forward(shape, q, k, v, gate, out, saved, mem);
  if (cpu::allows(cpu::Level::Avx512))
    return attention_avx512::gated_attention_forward(shape, q, k, v, gate, out, saved, mem);
  attention_avx2::gated_attention_forward(shape, q, k, v, gate, out, saved, mem);
}

template <typename T>
void gated_attention_backward(const AttentionShape& shape, const T* q, const T* k, const T* v, const T* gate,
                              const AttentionSaved& saved, const float* dout, float* dq, float* dk, float* dv,
                              float* dgate, MemoryAccountant& mem) {
  if (cpu::allows(cpu::Level::Avx512Bf16))
    return attention_avx512_bf16::gated_attention_backward(shape, q, k, v, gate, saved, dout, dq, dk, dv, dgate, mem);
  if (cpu::allows(cpu::Level::Avx512))
    return attention_avx512::gated_attention_backward(shape, q, k, v, gate, saved, dout, dq, dk, dv, dgate, mem);
  attention_avx2::gated_attention_backward(shape, q, k, v, gate, saved, dout, dq, dk, dv, dgate, mem);
}

#define HS_INSTANTIATE(T)                                                                                         \
  template void gated_attention_forward<T>(const AttentionShape&, const T*, const T*, const T*, const T*, T*,     \
                                           AttentionSaved*, MemoryAccountant&);                                   \
  template void gated_attention_backward<T>(const AttentionShape&, const T*, const T*, const T*, const T*,        \
                                            const AttentionSaved&, const float*, float*, float*, float*, float*, \
                                            MemoryAccountant&);
HS_INSTANTIATE(float)
HS_INSTANTIATE(bf16)
#undef HS_INSTANTIATE

}  // namespace hs::kernels
