#include "core/collectives.h"

#include <cstring>
#include <stdexcept>

namespace hs {

void LocalCollectives::all_gather(const TensorView& shard, void* full, DType to, int64_t n) {
  if (shard.dtype == to) {
    std::memcpy(full, shard.data, static_cast<size_t>(n) * dtype_size(to));
  } else if (shard.dtype == DType::F32 && to == DType::BF16) {
    convert(static_cast<const float*>(shard.data), static_cast<bf16*>(full), static_cast<size_t>(n));
  } else if (shard.dtype == DType::BF16 && to == DType::F32) {
    convert(static_cast<const bf16*>(shard.data), static_cast<float*>(full), static_cast<size_t>(n));
  } else {
    throw std::invalid_argument("all_gather: unsupported conversion");
  }
}

void LocalCollectives::reduce_scatter(const float* full, int64_t n, float* shard) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) shard[i] += full[i];
}

}  // namespace hs
