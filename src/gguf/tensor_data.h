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

// Qwen3.5's value-head order: llama.cpp's converter stores value-head blocks tiled [K0 v0, K1 v0, ..., K0 v1, ...]
// (_reorder_v_heads) where transformers and the engine group them by key head [K0 v0, K0 v1, ..., K1 v0, ...];
// grouped block g r + j is tiled block j Hk + g. `block` consecutive elements move together; in each of `outer` rows
// (`stride` apart) the head blocks start at `offset`. to_tiled: grouped -> tiled (export), else tiled -> grouped.
void reorder_v_heads(std::span<float> x, int64_t outer, int64_t stride, int64_t offset, int64_t hk, int64_t r,
                     int64_t block, bool to_tiled);

}  // namespace hs::gguf
