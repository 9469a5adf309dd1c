// GGUF tensor bytes to compute values: the one place that reads ggml blocks (quantized storage will replace the copy
// made here; docs/gguf.md).
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>

namespace hs::gguf {

// F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K.
bool is_supported_storage_type(uint32_t type);
// out = the elements of `bytes`, a whole number of rows of `type` (out.size() elements).
void to_f32(uint32_t type, std::span<const std::byte> bytes, std::span<float> out);

}  // namespace hs::gguf
