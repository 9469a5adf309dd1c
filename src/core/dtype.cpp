#include "core/dtype.h"

#include <stdexcept>
#include <string>

namespace hs {

DType parse_dtype(std::string_view s) {
  if (s == "fp32" || s == "f32" || s == "float32") return DType::F32;
  if (s == "bf16" || s == "bfloat16") return DType::BF16;
  throw std::invalid_argument("unknown dtype '" + std::string(s) + "' (use fp32 or bf16)");
}

void convert(const float* src, bf16* dst, size_t n) {
#pragma omp parallel for schedule(static) if (n > (1u << 16))
  for (size_t i = 0; i < n; ++i) dst[i].bits = bf16::from_float(src[i]);
}

void convert(const bf16* src, float* dst, size_t n) {
#pragma omp parallel for schedule(static) if (n > (1u << 16))
  for (size_t i = 0; i < n; ++i) dst[i] = bf16::to_float(src[i].bits);
}

}  // namespace hs
