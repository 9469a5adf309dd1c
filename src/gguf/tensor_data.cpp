#include "gguf/tensor_data.h"

#include <cstring>
#include <stdexcept>
#include <vector>
#include <string>

#include "gguf/gguf_file.h"
#include "kernels/quant.h"

namespace hs::gguf {

bool is_supported_storage_type(uint32_t type) {
  switch (type) {
    case ggml_type::F32: case ggml_type::F16: case ggml_type::BF16: case ggml_type::Q8_0: case ggml_type::Q4_0:
    case ggml_type::Q4_K: case ggml_type::Q5_K: case ggml_type::Q6_K: return true;
    default: return false;
  }
}

void to_f32(uint32_t type, std::span<const std::byte> bytes, std::span<float> out) {
  if (!is_supported_storage_type(type)) throw std::invalid_argument("to_f32: type " + ggml_type_name(type));
  kernels::dequantize_row(static_cast<kernels::GgmlType>(type), bytes.data(), out.data(),
                          static_cast<int64_t>(out.size()));
}

void reorder_v_heads(std::span<float> x, int64_t outer, int64_t stride, int64_t offset, int64_t hk, int64_t r,
                     int64_t block, bool to_tiled) {
  std::vector<float> row(static_cast<size_t>(hk * r * block));
  const size_t bytes = static_cast<size_t>(block) * sizeof(float);
  for (int64_t o = 0; o < outer; ++o) {
    float* base = x.data() + o * stride + offset;
    std::memcpy(row.data(), base, row.size() * sizeof(float));
    for (int64_t g = 0; g < hk; ++g)
      for (int64_t j = 0; j < r; ++j) {
        const int64_t grouped = g * r + j, tiled = j * hk + g;
        std::memcpy(base + (to_tiled ? tiled : grouped) * block, row.data() + (to_tiled ? grouped : tiled) * block, bytes);
      }
  }
}

}  // namespace hs::gguf
