// Matrix products through oneDNN (the v2 API shipped by Debian's libdnnl-dev 2.6). Primitives are
// created once per shape/layout and cached. With bf16 inputs oneDNN runs its AMX / AVX-512-BF16
// kernels and accumulates in fp32; on a CPU without AVX-512-BF16 (or under HS_MAX_ISA below it) the operands are
// widened to fp32 block by block and oneDNN's fp32 product runs (matmul.cpp, run_widened). Skinny products (one dimension <= 16 and another larger, in the
// layouts the model uses: x W^T with few outputs, dy W with few inputs, dy^T x with few rows) run on
// hybridscan's own loops instead, also accumulating in fp32, with each sum in a fixed order.
#pragma once
#include <cstdint>
#include <string_view>

#include "core/dtype.h"
#include "core/memory.h"
#include "kernels/cpu.h"

namespace hs::kernels {

// C = op(A) op(B)  (or C += ... when accumulate), all row-major.
//   op(A) is [M, K]: A is stored [M, K] (lda >= K) or, with trans_a, [K, M] (lda >= M).
//   op(B) is [K, N]: B is stored [K, N] (ldb >= N) or, with trans_b, [N, K] (ldb >= K).
//   C is [M, N] with ldc >= N.
// A leading dimension of 0 means "packed" (the row length given by the shape).
// For a linear layer with weight W [out, in] (the Hugging Face layout): y = x W^T is
// matmul(x, W, y, T, out, in, false, true); dx = dy W is matmul(dy, W, dx, T, in, out, false, false);
// dW += dy^T x is matmul(dy, x, dW, out, in, T, true, false, true).
struct MatmulLayout {
  int64_t lda = 0, ldb = 0, ldc = 0;
  // The caller issues this product with many different row counts (an expert's rows): one primitive takes the
  // count at execution instead of one primitive per count. The rows are M (A not transposed), or K for a
  // weight gradient dW += A^T B (A transposed: the rows are summed over).
  bool varying_rows = false;
};

void matmul(const float* A, const float* B, float* C, int64_t M, int64_t N, int64_t K, bool trans_a,
            bool trans_b, bool accumulate = false, MatmulLayout ld = {});
void matmul(const bf16* A, const bf16* B, float* C, int64_t M, int64_t N, int64_t K, bool trans_a,
            bool trans_b, bool accumulate = false, MatmulLayout ld = {});
void matmul(const bf16* A, const bf16* B, bf16* C, int64_t M, int64_t N, int64_t K, bool trans_a,
            bool trans_b, bool accumulate = false, MatmulLayout ld = {});

// The plain triple loop in double precision, the oracle for tests (src/kernels/reference/: tests and benchmarks
// link it, the engine does not).
template <typename TA, typename TC>
void matmul_reference(const TA* A, const TA* B, TC* C, int64_t M, int64_t N, int64_t K, bool trans_a,
                      bool trans_b, bool accumulate = false);

// ---- Weights in oneDNN's packed layout ----------------------------------------------------------------------
// oneDNN's brgemm matmul reads its weights operand in a blocked layout of its own choosing (on AVX-512 bf16:
// 32x64 blocks of [K, N], pairs of K adjacent; on AMX a layout for the tile loads) and, given plain row-major
// weights, copies them into that layout inside every call. A weight that several products read (the forward, the
// recompute, the backward data product) can instead be reordered once into that layout: a PackedWeight. While one
// is packed, every product whose B operand is that weight's memory in that use (same pointer, shape and dtype,
// plain leading dimension, fixed row count) reads the packed copy; the result is the same kernel on the same
// numbers, so the bits equal the plain product's (tests/matmul_test.cpp checks).
//   Forward:      y = x W^T, matmul(x, W, y, T, out, in, false, true)
//   BackwardData: dx = dy W, matmul(dy, W, dx, T, in, out, false, false)
// (The weight gradient dW = dy^T x reads no weight.) Products that take their row count at execution
// (MatmulLayout::varying_rows: the routed experts) run oneDNN's jit gemm, which wants plain weights, and skinny
// products run hybridscan's own loops: neither reads a packed copy.
enum class WeightUse : uint8_t { Forward, BackwardData };

// Bytes of the packed form of W [out, in] in dtype dt (F32 or BF16) for that use, from oneDNN's memory descriptor
// (padding included), or 0 when packing does not apply: a skinny product, or oneDNN would read W in its plain
// layout anyway (no brgemm kernel for this CPU and dtype). Planning and running query it the same way.
size_t packed_weight_bytes(DType dt, int64_t out, int64_t in, WeightUse use);

// The packed copy of one weight for one use, allocated through the accountant (packed_weight_bytes of it; nothing
// when that is 0). pack() reorders W into it once W's contents are final (a gather finished) and registers it;
// the destructor unregisters it, so it must not outlive W's memory. Planning allocates and never packs.
class PackedWeight {
 public:
  PackedWeight() = default;
  PackedWeight(const void* W, DType dt, int64_t out, int64_t in, WeightUse use, MemoryAccountant& mem,
               MemCategory cat, std::string_view tag);
  PackedWeight(PackedWeight&& o) noexcept { *this = std::move(o); }
  PackedWeight& operator=(PackedWeight&& o) noexcept;
  PackedWeight(const PackedWeight&) = delete;
  PackedWeight& operator=(const PackedWeight&) = delete;
  ~PackedWeight() { release(); }

  void pack();
  bool active() const { return !buf_.empty(); }  // packing applies (a buffer was allocated)
  size_t bytes() const { return buf_.bytes(); }

 private:
  void release();
  const void* W_ = nullptr;
  DType dt_ = DType::F32;
  int64_t out_ = 0, in_ = 0;
  WeightUse use_ = WeightUse::Forward;
  Buffer buf_;
  bool registered_ = false;
};

// Products that read a packed weight so far (tests check that the packed path is taken).
int64_t matmul_packed_products();
// oneDNN executions so far (a product cut into tiles counts each; tests check which products reach oneDNN).
int64_t matmul_onednn_calls();

// A product's bits are the same for any OpenMP thread count, at every level. oneDNN's AVX-512 brgemm (the products
// of a fixed shape there) gives every thread whole output blocks summed in one order; its jit gemm (every product
// below AVX-512, and products of varying row counts at every level) cuts K among threads depending on their count, so
// matmul.cpp cuts those products into a shape-only grid of tiles itself and runs each on one thread (run_onednn).
// Every loop of the engine's own keeps its order whatever the thread count (tests: Moe.BitIdenticalForAnyThreadCount,
// Decode.FusedStepIsBitIdenticalToTheLayeredPath, Matmul.OneDnnProductsBitIdenticalAcrossThreads).

// Number of distinct primitives created so far (tests check that the cache is used).
int64_t matmul_primitives_created();

// Inference: while one of these lives on a thread, that thread's products x W^T (trans_b, A not transposed, no
// accumulation, B packed) of at most kGemvMaxRows rows run on gemv (kernels/gemv.h), which streams W once for all
// rows, instead of oneDNN, whose per-call cost dominates such products. Decoding sets it around a step (the layer
// code it shares with training stays as it is); training never does, so its products and their bits are unchanged.
class SmallRowProducts {
 public:
  SmallRowProducts();
  ~SmallRowProducts();
  SmallRowProducts(const SmallRowProducts&) = delete;
  SmallRowProducts& operator=(const SmallRowProducts&) = delete;

 private:
  bool previous_;
};

// The engine's own loops for skinny products (one dimension <= 16) run at the widest level within cpu::level():
// AVX-512, else AVX2 + FMA (Scalar under a cpu::ScopedLevel), chosen at each call.
cpu::Level skinny_level();

}  // namespace hs::kernels
