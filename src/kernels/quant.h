// GGUF's tensor types and their block formats, byte-compatible with ggml (ggml-common.h): what a .gguf file stores
// and what the quantized products read. The formats are described in docs/quantization.md.
//
// Dequantization gives the bits PyPI `gguf`'s gguf.quants.dequantize gives (each element one fp32 product of the
// block's fp16 scales and its integer, minus the min's product where the type has one; no fused multiply-add), and
// the quantizers are ggml's reference ones (quantize_row_*_ref in ggml-quants.c, the ones llama-quantize runs
// without an importance matrix), operation for operation in fp32, so a block we write is the block ggml writes.
// tests/quant_format_test.cpp checks both against the Python package, tests/quant_ggml_test.cpp the K-quant
// quantizers against libggml's.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace hs::kernels {

// ggml's numeric type ids (enum ggml_type; GGUF stores them in each tensor's header). Only the types this engine
// reads or computes with are named here; ggml_type_name() names every other id ggml defines, for refusals.
enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q8_0 = 8,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,  // activations of the K-quant products; not a storage type of llama.cpp's files
  BF16 = 30,
};

constexpr int64_t kQK = 32;    // elements of a Q8_0 / Q4_0 block
constexpr int64_t kQKK = 256;  // elements of a K-quant super-block

// The structs mirror ggml's block_* exactly (field order, sizes; fp16 scales as their bits). A row of n elements is
// n / block_elems consecutive blocks; ggml's row size is that many blocks' bytes, with no padding between blocks, so
// the fp16 fields are only 2-byte aligned.
struct BlockQ8_0 {
  uint16_t d;  // scale (fp16)
  int8_t qs[kQK];
};
struct BlockQ4_0 {
  uint16_t d;           // scale (fp16); element j = d * (nibble - 8)
  uint8_t qs[kQK / 2];  // element j in the low nibble of qs[j], element j + 16 in its high nibble
};
// Eight sub-blocks of 32, each with a 6-bit scale and a 6-bit min: element = d * sc * q - dmin * m.
struct BlockQ4_K {
  uint16_t d, dmin;        // fp16 super-scales of the sub-blocks' scales and mins
  uint8_t scales[12];      // 8 scales and 8 mins of 6 bits (packing: unpack_scale_min_k4)
  uint8_t qs[kQKK / 2];    // 4 groups of 32 bytes: sub-block 2g in the low nibbles, 2g + 1 in the high ones
};
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[kQKK / 8];    // bit s of qh[l]: the fifth bit of element l of sub-block s
  uint8_t qs[kQKK / 2];    // the low four bits, as in Q4_K
};
// Sixteen sub-blocks of 16 with signed 8-bit scales: element = d * scale * (q - 32), q of 6 bits.
struct BlockQ6_K {
  uint8_t ql[kQKK / 2];    // low four bits
  uint8_t qh[kQKK / 4];    // high two bits
  int8_t scales[kQKK / 16];
  uint16_t d;
};
// Activations for the K-quant products: one fp32 scale, 256 int8 values, and the sums of each 16 of them.
struct BlockQ8_K {
  float d;
  int8_t qs[kQKK];
  int16_t bsums[kQKK / 16];
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_K) == 144 &&
              sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210 && sizeof(BlockQ8_K) == 292);

struct GgmlTypeInfo {
  GgmlType type;
  const char* name;     // as PyPI gguf's GGMLQuantizationType and gguf-dump spell it: "Q4_K", "BF16"
  int64_t block_elems;  // 1 for F32 / F16 / BF16
  int64_t block_bytes;
};

// The type's traits, or nullptr for an id this engine does not read (every id but the enum's).
const GgmlTypeInfo* ggml_type_info(uint32_t id);
const GgmlTypeInfo& ggml_type_info(GgmlType t);
// Any ggml type id's name ("Q4_1", "IQ2_XXS", ...), or "type <id>" for an id ggml does not define either.
std::string ggml_type_name(uint32_t id);
// Bytes of a row of n elements; throws std::invalid_argument unless n is a multiple of the type's block.
int64_t ggml_row_bytes(GgmlType t, int64_t n);

// IEEE binary16 <-> fp32 (F16C, part of the build's baseline): exact widening; narrowing rounds to nearest even (as
// numpy does), overflow to inf. Inline: the products widen block scales in their inner loops.
inline float fp16_to_fp32(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t fp32_to_fp16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

// out[0, n) = the n elements stored in `blocks` (a row, or consecutive rows, of type t). n must be a multiple of the
// block (std::invalid_argument otherwise). Bit-identical to gguf.quants.dequantize (F32/F16/BF16 included).
void dequantize_row(GgmlType t, const void* blocks, float* out, int64_t n);
// The same values rounded to bf16 (to nearest even, as bf16::from_float does; BF16 rows copied as stored). Not Q8_K.
void dequantize_row(GgmlType t, const void* blocks, bf16* out, int64_t n);
// blocks = x[0, n) in type t, as ggml's quantize_row_*_ref writes it (F16 / BF16: rounded to nearest even; BF16 NaNs
// made quiet as ggml does). Q8_K is the activations' format (quantize_row_q8_K_ref, bsums included).
void quantize_row(GgmlType t, const float* x, void* blocks, int64_t n);

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block (ggml's get_scale_min_k4).
inline void unpack_scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

}  // namespace hs::kernels
