#include "core/dtype.h"

namespace hs {

void convert(const float* src, bf16* dst, size_t n) {
#pragma omp parallel for schedule(static) if (n > (1u << 16))
  for (size_t i = 0; i < n; ++i) dst[i].bits = bf16::from_float(src[i]);
}

void convert(const bf16* src, float* dst, size_t n) {
#pragma omp parallel for schedule(static) if (n > (1u << 16))
  for (size_t i = 0; i < n; ++i) dst[i] = bf16::to_float(src[i].bits);
}

}  // namespace hs
