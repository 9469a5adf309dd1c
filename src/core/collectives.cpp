#include "core/collectives.h"

#include <cstring>
#include <stdexcept>

namespace hs {

Collectives::Request& Collectives::Request::operator=(Request&& o) noexcept {
  if (this != &o) {
    wait_quietly();
    finish_ = std::move(o.finish_);
    o.finish_ = nullptr;
  }
  return *this;
}

void Collectives::Request::wait() {
  if (!finish_) return;
  std::function<void()> f = std::move(finish_);
  finish_ = nullptr;
  f();
}

void Collectives::Request::wait_quietly() noexcept {
  try {
    wait();
  } catch (...) {
  }
}

void convert_elements(const void* src, DType from, void* dst, DType to, int64_t n) {
  if (from == to) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(to));
  } else if (from == DType::F32 && to == DType::BF16) {
    convert(static_cast<const float*>(src), static_cast<bf16*>(dst), static_cast<size_t>(n));
  } else if (from == DType::BF16 && to == DType::F32) {
    convert(static_cast<const bf16*>(src), static_cast<float*>(dst), static_cast<size_t>(n));
  } else {
    throw std::invalid_argument("all_gather: unsupported conversion");
  }
}

Collectives::Request LocalCollectives::start_all_gather(const TensorView& shard, void* full, DType to, int64_t n) {
  convert_elements(shard.data, shard.dtype, full, to, n);
  return {};
}

Collectives::Request LocalCollectives::start_reduce_scatter(float* full, int64_t n, float* shard) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) shard[i] += full[i];
  return {};
}

}  // namespace hs
