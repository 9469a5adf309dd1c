// The chunked gated delta rule's dispatch: delta_rule_paths.inc (the algorithm, its products and where the time
// goes) compiled once for AVX2, the build's baseline, and once for AVX-512, whose copy also vectorises the chunk's
// element-wise passes 512 bits wide; each entry point runs the widest copy this CPU allows under HS_MAX_ISA
// (kernels/cpu.h). The two microkernels give every element the same operations in the same order, and the passes
// around them are element-wise, so both copies give the same bits (tests/delta_rule_test.cpp runs both under
// scripts/test.sh's two passes).
#include "kernels/delta_rule.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "core/compute.h"
#include "core/profile.h"
#include "core/settings.h"
#include "kernels/cpu.h"
#include "kernels/simd.h"
#include "kernels/vec_math.h"

namespace hs::kernels {

#define HS_DELTA_RULE_AVX512 0
namespace delta_rule_avx2 {
#include "kernels/delta_rule_paths.inc"
}  // namespace delta_rule_avx2
#undef HS_DELTA_RULE_AVX512
#define HS_DELTA_RULE_AVX512 1
HS_BEGIN_AVX512_PATHS
namespace delta_rule_avx512 {
#include "kernels/delta_rule_paths.inc"
}  // namespace delta_rule_avx512
HS_END_ISA_PATHS
#undef HS_DELTA_RULE_AVX512


template <typename T>
void delta_rule_forward(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta,
                        const float* g, T* o, DeltaRuleSaved* saved, MemoryAccountant& mem, bool keep_tinv,
                        DeltaRuleProducts products) {
  HS_RETURN_WIDEST(delta_rule, delta_rule_forward(s, q, k, v, beta, g, o, saved, mem, keep_tinv, products));
}
template <typename T>
void delta_rule_forward_cached(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta,
                               const float* g, T* o, float* state, const int32_t* slots, MemoryAccountant& mem,
                               DeltaRuleProducts products) {
  HS_RETURN_WIDEST(delta_rule, delta_rule_forward_cached(s, q, k, v, beta, g, o, state, slots, mem, products));
}
template <typename T>
void delta_rule_backward(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta,
                         const float* g, const DeltaRuleSaved& saved, const float* dout, float* dq, float* dk, float* dv,
                         float* dbeta, float* dg, MemoryAccountant& mem, bool accumulate, DeltaRuleProducts products) {
  HS_RETURN_WIDEST(delta_rule,
                   delta_rule_backward(s, q, k, v, beta, g, saved, dout, dq, dk, dv, dbeta, dg, mem, accumulate, products));
}

bool delta_rule_bf16_products_available() { return delta_rule_avx2::cpu_has_bf16_products(); }

void detail::delta_rule_product(int64_t M, int64_t N, int64_t K, const float* A, const float* B, float* Cm,
                                DeltaRuleProducts products) {
  if (M % 4 != 0 || N % 16 != 0 || K % 16 != 0)
    throw std::invalid_argument("delta_rule_product: M must be a multiple of 4, N and K of 16");
  HS_RETURN_WIDEST(delta_rule, delta_rule_product(M, N, K, A, B, Cm, products));
}

#define HS_INSTANTIATE(T)                                                                                       \
  template void delta_rule_forward<T>(const DeltaRuleShape&, const T*, const T*, const T*, const float*,         \
                                      const float*, T*, DeltaRuleSaved*, MemoryAccountant&, bool,                \
                                      DeltaRuleProducts);                                                        \
  template void delta_rule_forward_cached<T>(const DeltaRuleShape&, const T*, const T*, const T*, const float*,  \
                                             const float*, T*, float*, const int32_t*, MemoryAccountant&,        \
                                             DeltaRuleProducts);                                                 \
  template void delta_rule_backward<T>(const DeltaRuleShape&, const T*, const T*, const T*, const float*,        \
                                       const float*, const DeltaRuleSaved&, const float*, float*, float*, float*, \
                                       float*, float*, MemoryAccountant&, bool, DeltaRuleProducts);
HS_INSTANTIATE(float)
HS_INSTANTIATE(bf16)
#undef HS_INSTANTIATE

}  // namespace hs::kernels
