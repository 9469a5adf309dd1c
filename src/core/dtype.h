// Element types of the engine and the bf16 <-> fp32 conversions.
#pragma once
#include <cstdint>
#include <cstring>
#include <string_view>

namespace hs {

enum class DType : uint8_t { F32, BF16, I32 };

constexpr size_t dtype_size(DType t) { return t == DType::BF16 ? 2 : 4; }

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
  }
  return "?";
}

// A floating-point dtype by name: "fp32" (also "f32", what dtype_name writes, and "float32") or "bf16" ("bfloat16");
// std::invalid_argument otherwise.
DType parse_dtype(std::string_view s);

// bfloat16 stored as its upper 16 bits of an IEEE float. Conversion from fp32 rounds to nearest even
// (NaN stays NaN), which is what PyTorch and oneDNN do.
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  explicit bf16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }

  static inline uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
  static inline float to_float(uint16_t b) {
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static_assert(sizeof(bf16) == 2);

// Uniform load/store so kernels can be written once as templates over the storage type T in
// {float, bf16} while all arithmetic happens in fp32.
inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return bf16::to_float(x.bits); }
inline double to_f32(double x) { return x; }
template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x) { bf16 b; b.bits = bf16::from_float(x); return b; }
template <> inline double from_f32<double>(float x) { return x; }

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<bf16>() { return DType::BF16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }

// Bulk conversions (vectorisable loops, OpenMP over large arrays).
void convert(const float* src, bf16* dst, size_t n);
void convert(const bf16* src, float* dst, size_t n);

}  // namespace hs
