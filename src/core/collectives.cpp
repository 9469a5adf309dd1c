#include "core/collectives.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace hs {

void Collectives::all_reduce_sum(float* x, int64_t n) {
  std::vector<float> scratch(static_cast<size_t>(all_reduce_scratch_elems(n)));
  all_reduce_sum(x, n, scratch.data());
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

Collectives::Request LocalCollectives::start_reduce_scatter_to(float* full, int64_t n, std::vector<float*> dest) {
  return start_reduce_scatter(full, n, dest.at(0));
}

namespace {
void check_range(int64_t n, int64_t begin, int64_t end) {
  if (begin < 0 || begin > end || end > n)
    throw std::invalid_argument("collectives: range [" + std::to_string(begin) + ", " + std::to_string(end) +
                                ") is not within the tensor's " + std::to_string(n) + " elements");
}
}  // namespace

Collectives::Request LocalCollectives::start_all_gather_range(const TensorView& shard, int64_t n, int64_t begin,
                                                              int64_t end, void* out, DType to) {
  check_range(n, begin, end);
  const char* from = static_cast<const char*>(shard.data) + static_cast<size_t>(begin) * dtype_size(shard.dtype);
  convert_elements(from, shard.dtype, out, to, end - begin);
  return {};
}

Collectives::Request LocalCollectives::start_reduce_scatter_range(const float* full, int64_t n, int64_t begin,
                                                                  int64_t end, float* shard, float*) {
  check_range(n, begin, end);
  float* to = shard + begin;
  const int64_t len = end - begin;
#pragma omp parallel for schedule(static) if (len > 65536)
  for (int64_t i = 0; i < len; ++i) to[i] += full[i];
  return {};
}

Collectives::Request LocalCollectives::start_all_to_all_v(const void* send, std::vector<int64_t> send_counts,
                                                          std::vector<int64_t> send_displs, void* recv,
                                                          std::vector<int64_t> recv_counts,
                                                          std::vector<int64_t> recv_displs, size_t elem_bytes) {
  if (send_counts.at(0) != recv_counts.at(0))
    throw std::invalid_argument("all_to_all_v: send and receive counts differ");
  if (send_counts[0] == 0) return {};
  std::memcpy(static_cast<char*>(recv) + recv_displs.at(0) * elem_bytes,
              static_cast<const char*>(send) + send_displs.at(0) * elem_bytes,
              static_cast<size_t>(send_counts[0]) * elem_bytes);
  return {};
}

}  // namespace hs
