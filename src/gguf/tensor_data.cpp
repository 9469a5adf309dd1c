#include "gguf/tensor_data.h"

#include <stdexcept>
#include <string>

#include "checkpoint/safetensors.h"
#include "gguf/gguf_file.h"

namespace hs::gguf {

bool is_supported_storage_type(uint32_t type) {
  return type == ggml_type::F32 || type == ggml_type::F16 || type == ggml_type::BF16;
}

void to_f32(uint32_t type, std::span<const std::byte> bytes, std::span<float> out) {
  using checkpoint::FileDType;
  const FileDType ft = type == ggml_type::F32 ? FileDType::F32 : type == ggml_type::F16 ? FileDType::F16 : FileDType::BF16;
  if (!is_supported_storage_type(type)) throw std::invalid_argument("to_f32: type " + ggml_type_name(type));
  checkpoint::convert_to_f32(ft, bytes.data(), out.data(), out.size());
}

}  // namespace hs::gguf
