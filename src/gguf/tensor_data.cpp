#include "gguf/tensor_data.h"

#include <stdexcept>
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

}  // namespace hs::gguf
