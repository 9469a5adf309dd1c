#include "kernels/matmul.h"

#include "core/profile.h"
#include "kernels/common.h"
#include "kernels/cpu.h"
#include "kernels/gemv.h"
#include "kernels/paths.h"
#include "kernels/simd.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <optional>
#include <string>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <vector>

namespace hs::kernels {
namespace {

using dnnl::memory;

thread_local bool t_small_rows = false;  // a SmallRowProducts scope is open on this thread

// M or K == kRuntime: the primitive takes that dimension at execution (see varying_rows in run below).
constexpr int64_t kRuntime = DNNL_RUNTIME_DIM_VAL;

struct Key {
  int64_t M, N, K, lda, ldb, ldc;
  bool ta, tb, acc;
  int in_dt, out_dt;
  bool packed_b = false;  // B in its packed layout (the PackedDesc of its dtype, K and N), ldb unused
  auto tie() const { return std::tie(M, N, K, lda, ldb, ldc, ta, tb, acc, in_dt, out_dt, packed_b); }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

struct Prim {
  dnnl::matmul prim;
  memory::desc a, b, c;
};

// The packed layout oneDNN picks for a B operand [K, N] of one dtype (read plain, or transposed: tb), when it
// differs from the plain one.
struct PackedKey {
  int dt;
  int64_t K, N;
  bool tb;
  auto tie() const { return std::tie(dt, K, N, tb); }
  bool operator<(const PackedKey& o) const { return tie() < o.tie(); }
};

// A registered packed weight: products with B == the plain weight in this use read `data` (of layout `desc`).
struct PackedEntry {
  PackedKey key;
  const void* data;
  memory::desc desc;
};

struct Runtime {
  // HS_MAX_ISA reaches oneDNN before its first primitive (the engine is made first).
  const bool capped = (cpu::apply_cap_to_onednn(), true);
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mu;
  std::map<Key, std::shared_ptr<Prim>> cache;  // null: a packed-B primitive oneDNN only runs on a reference kernel
  int64_t created = 0;
  std::map<PackedKey, std::optional<memory::desc>> packed_layouts;
  std::multimap<const void*, PackedEntry> packed;  // by the plain weight's address
  std::atomic<int64_t> n_packed{0};                // entries in `packed` (read without the lock)
  std::atomic<int64_t> packed_products{0};
  std::atomic<int64_t> onednn_calls{0};
};

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

memory::data_type dnnl_type(int t) { return t == 0 ? memory::data_type::f32 : memory::data_type::bf16; }

dnnl::stream& thread_stream() {
  thread_local dnnl::stream s(runtime().engine);  // one per calling thread, made once
  return s;
}

// A plain B operand [K, N]: row-major with leading dimension ldb, or (tb) the transpose of a row-major [N, K].
memory::desc plain_b(int dt, int64_t K, int64_t N, bool tb, int64_t ldb) {
  return tb ? memory::desc({K, N}, dnnl_type(dt), {1, ldb}) : memory::desc({K, N}, dnnl_type(dt), {ldb, 1});
}

// Whether bf16 products run on oneDNN's bf16 kernels: only where the CPU has AVX-512-BF16 (under HS_MAX_ISA) and
// oneDNN makes the primitive (asked once, with a small one, so a cap set by ONEDNN_MAX_CPU_ISA counts too).
// Elsewhere the engine widens the operands to fp32 (run_widened below): Debian's oneDNN 2.6 (and 3.2) makes no
// bf16 matmul below AVX-512, and on AVX-512 without BF16 its emulated bf16 gemm measured about half its fp32
// speed at the step's shapes (2.6.3 and 3.2.0, 2 threads: 4096x256x768 62 against 150 GFLOP/s; README).
bool onednn_runs_bf16() {
  static const bool runs = [] {
    Runtime& rt = runtime();
    if (!cpu::allows(cpu::Level::Avx512Bf16)) return false;
    try {
      const memory::desc a({32, 32}, memory::data_type::bf16, {32, 1});
      const memory::desc c({32, 32}, memory::data_type::f32, {32, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, a, c), rt.engine);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return runs;
}

// Products the skinny loops below take (one dimension <= kSkinny, another larger) never read a packed weight.
constexpr int64_t kSkinny = 16;

// The layout oneDNN's matmul picks for B (format_tag::any), or nothing when packing does not apply: a skinny
// weight, a layout that is the plain one, or no brgemm kernel (then any layout falls to slower code). The layout
// depends on the ISA, the dtype, K and N, not on the row count (checked on AVX-512 bf16; a primitive for another
// row count that does not accept it is caught in get_prim and runs plain). Caller holds rt.mu.
std::optional<memory::desc> packed_layout_locked(Runtime& rt, const PackedKey& pk) {
  auto it = rt.packed_layouts.find(pk);
  if (it != rt.packed_layouts.end()) return it->second;
  std::optional<memory::desc> out;
  if (std::min(pk.K, pk.N) > kSkinny && (pk.dt == 0 || onednn_runs_bf16())) {
    constexpr int64_t kRows = 512;
    memory::desc a({kRows, pk.K}, dnnl_type(pk.dt), {pk.K, 1});
    memory::desc b({pk.K, pk.N}, dnnl_type(pk.dt), memory::format_tag::any);
    memory::desc c({kRows, pk.N}, memory::data_type::f32, {pk.N, 1});
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), rt.engine);
    const memory::desc chosen = pd.weights_desc();
    const std::string impl = pd.impl_info_str();
    if (impl.rfind("brg", 0) == 0 && chosen != plain_b(pk.dt, pk.K, pk.N, pk.tb, pk.tb ? pk.K : pk.N) &&
        chosen != plain_b(pk.dt, pk.K, pk.N, !pk.tb, pk.tb ? pk.N : pk.K))
      out = chosen;
  }
  rt.packed_layouts.emplace(pk, out);
  return out;
}

// The B operand [K, N] that a use of W [out, in] reads.
PackedKey packed_key(DType dt, int64_t out, int64_t in, WeightUse use) {
  if (dt != DType::F32 && dt != DType::BF16) throw std::invalid_argument("packed weights are f32 or bf16");
  const int d = dt == DType::F32 ? 0 : 1;
  return use == WeightUse::Forward ? PackedKey{d, in, out, true} : PackedKey{d, out, in, false};
}

std::shared_ptr<Prim> get_prim(const Key& k, const memory::desc* packed_b = nullptr) {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mu);
  auto it = rt.cache.find(k);
  if (it != rt.cache.end()) return it->second;
  // Row-major [rows, cols] with a leading dimension; a transposed operand is the same memory viewed
  // with swapped strides.
  memory::desc a = k.ta ? memory::desc({k.M, k.K}, dnnl_type(k.in_dt), {1, k.lda})
                        : memory::desc({k.M, k.K}, dnnl_type(k.in_dt), {k.lda, 1});
  memory::desc b = packed_b ? *packed_b : plain_b(k.in_dt, k.K, k.N, k.tb, k.ldb);
  memory::desc c({k.M, k.N}, dnnl_type(k.out_dt), {k.ldc, 1});
  dnnl::primitive_attr attr;
  if (k.acc) {
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  dnnl::matmul::desc d(a, b, c);
  dnnl::matmul::primitive_desc pd;
  try {
    pd = dnnl::matmul::primitive_desc(d, attr, rt.engine);
  } catch (const dnnl::error&) {
    if (!packed_b) throw;
  }
  if (packed_b && (!pd || std::string(pd.impl_info_str()).rfind("brg", 0) != 0)) {
    rt.cache.emplace(k, nullptr);  // no kernel, or a slow one, for the packed layout at this shape: plain instead
    return nullptr;
  }
  auto p = std::make_shared<Prim>(Prim{dnnl::matmul(pd), a, b, c});
  rt.cache.emplace(k, p);
  ++rt.created;
  return p;
}

// ---- Skinny products ------------------------------------------------------------------------------------
// A product with one dimension of at most kSkinny (the GDN beta/alpha projections have Hv outputs, the router
// has one per expert) is memory-bound: oneDNN still tiles it for AMX and measured 0.4-1.4 ms for 4096x256x4 on
// this machine, ~50x its arithmetic. These loops stream the large operand once with the small one in registers
// or L1. Each output element is summed in a fixed order (by k, or by row p) whatever the thread count, in fp32
// like oneDNN. (kSkinny is defined above.)

// The small operand as dense fp32 [rows, cols], read from rows `ld` elements apart.
template <typename T> std::vector<float> dense_f32(const T* src, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<float> d(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) d[static_cast<size_t>(r * cols + c)] = to_f32(src[r * ld + c]);
  return d;
}

template <typename TC> void store(TC* c, float v, bool acc) {
  if (acc) v += to_f32(*c);
  *c = from_f32<TC>(v);
}

// These products stream a few MB at most at the shapes the models have (4096 x 256 bf16 is 2 MB) and take ~0.1-0.5 ms
// on one thread; forking a second thread for them measured 4-8x slower than one thread on this shared 2-core EPYC
// (bench/throughput_report_gemm, 4096x4x256 bf16: 0.46-0.66 ms on 1 thread, 2.6-5.2 ms on 2, three alternated
// rounds), so they split over threads only when the streamed operand is larger than this many elements.
constexpr int64_t kSkinnyParallelWork = int64_t{1} << 22;

// One row's N dot products over K with A's row already in fp32 (a) and B dense fp32 [N, K]: C_j = sum_k a_k B_jk, in
// the order GCC gave the previous scalar loop's `omp simd reduction` on this AMD AVX-512 build (read off its code): 16
// lanes, lane l summing k = l (mod 16) over the whole 16-element chunks with fused multiply-adds, then the K % 16 tail
// fused into lane 0, then s = 0 + lane 0 + lane 1 + ... + lane 15 in order. Both vector paths keep that order (AVX2 as
// two 8-lane halves) and the scalar path now spells it out (GCC picks 8 lanes for the same loop when tuning for Intel
// parts), so every path gives the same bits on every build (tests/matmul_test.cpp).
inline float lanes_in_order(const float* lane, const float* a, const float* b, int64_t k, int64_t K) {
  float l0 = lane[0];
  for (; k < K; ++k) l0 = std::fma(a[k], b[k], l0);
  float s = 0.0f;
  s += l0;
  for (int i = 1; i < 16; ++i) s += lane[i];
  return s;
}
#if defined(__x86_64__)
template <int NJ>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) inline void dots_avx512(const float* a, const float* b, int64_t K, float* out) {
  __m512 acc[NJ];
  for (int j = 0; j < NJ; ++j) acc[j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 av = _mm512_loadu_ps(a + k);
    for (int j = 0; j < NJ; ++j) acc[j] = _mm512_fmadd_ps(av, _mm512_loadu_ps(b + j * K + k), acc[j]);
  }
  alignas(64) float lane[NJ][16];
  for (int j = 0; j < NJ; ++j) _mm512_store_ps(lane[j], acc[j]);
  for (int j = 0; j < NJ; ++j) out[j] = lanes_in_order(lane[j], a, b + j * K, k, K);
}
template <int NJ>
__attribute__((target("avx2,fma"))) inline void dots_avx2(const float* a, const float* b, int64_t K, float* out) {
  __m256 lo[NJ], hi[NJ];
  for (int j = 0; j < NJ; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 a0 = _mm256_loadu_ps(a + k), a1 = _mm256_loadu_ps(a + k + 8);
    for (int j = 0; j < NJ; ++j) {
      lo[j] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(b + j * K + k), lo[j]);
      hi[j] = _mm256_fmadd_ps(a1, _mm256_loadu_ps(b + j * K + k + 8), hi[j]);
    }
  }
  alignas(32) float lane[NJ][16];
  for (int j = 0; j < NJ; ++j) {
    _mm256_store_ps(lane[j], lo[j]);
    _mm256_store_ps(lane[j] + 8, hi[j]);
  }
  for (int j = 0; j < NJ; ++j) out[j] = lanes_in_order(lane[j], a, b + j * K, k, K);
}
#endif

// out[j] = dot(a, B_j) for j < N, in groups of four accumulators (the row of a stays in L1 across the groups).
inline void row_dots(cpu::Level isa, const float* a, const float* b, int64_t N, int64_t K, float* out) {
#if defined(__x86_64__)
  if (isa != cpu::Level::Scalar) {
    int64_t j = 0;
    const bool wide = isa == cpu::Level::Avx512;
    for (; j + 4 <= N; j += 4) wide ? dots_avx512<4>(a, b + j * K, K, out + j) : dots_avx2<4>(a, b + j * K, K, out + j);
    switch (N - j) {
      case 3: wide ? dots_avx512<3>(a, b + j * K, K, out + j) : dots_avx2<3>(a, b + j * K, K, out + j); break;
      case 2: wide ? dots_avx512<2>(a, b + j * K, K, out + j) : dots_avx2<2>(a, b + j * K, K, out + j); break;
      case 1: wide ? dots_avx512<1>(a, b + j * K, K, out + j) : dots_avx2<1>(a, b + j * K, K, out + j); break;
      default: break;
    }
    return;
  }
#else
  (void)isa;
#endif
  // The scalar path spells the vector paths' order out (16 lanes of fused multiply-adds, the tail into lane 0, the
  // lanes summed in order), so every path and every compiler gives the same bits.
  for (int64_t j = 0; j < N; ++j) {
    const float* br = b + j * K;
    float lane[16] = {};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      for (int l = 0; l < 16; ++l) lane[l] = std::fma(a[k + l], br[k + l], lane[l]);
    out[j] = lanes_in_order(lane, a, br, k, K);
  }
}

// Small N, A [M, K] rows and B stored [N, K] (trans_b): C[i, j] = dot(A_i, B_j), both contiguous in K.
template <typename TA, typename TC>
void skinny_n(const TA* A, int64_t lda, const TA* B, int64_t ldb, TC* C, int64_t ldc, int64_t M, int64_t N,
              int64_t K, bool acc) {
  const std::vector<float> b = dense_f32(B, N, K, ldb);  // row j is B_j
  const float* bp = b.data();
  const cpu::Level isa = skinny_level();
#pragma omp parallel if (M * K > kSkinnyParallelWork)
  {
    std::vector<float> a(static_cast<size_t>(K));
    float out[kSkinny];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
      const TA* ar = A + i * lda;
      if constexpr (std::is_same_v<TA, float>) {
        row_dots(isa, ar, bp, N, K, out);
      } else {
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) a[static_cast<size_t>(k)] = to_f32(ar[k]);
        row_dots(isa, a.data(), bp, N, K, out);
      }
      for (int64_t j = 0; j < N; ++j) store(C + i * ldc + j, out[j], acc);
    }
  }
}

// Small K, A [M, K] and B [K, N] (no transposes): C_i = sum_k A[i, k] B_k, streaming rows of C. Each output is
// 0, then one fused multiply-add per k ascending, then (acc) plus the old C: the same operations on every path (the
// scalar loop's are contracted to fused multiply-adds by the compiler), so the same bits.
#if defined(__x86_64__)
// One row: r[j] = sum_k a[k] B[k, j] for j < N (N a multiple of the vector width; B rows ldb apart), plus c[j]
// when c is given.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void skinny_k_row_avx512(const float* a, const float* b, int64_t K, int64_t ldb, int64_t N,
                                                            const float* c, float* r) {
  for (int64_t j = 0; j < N; j += 64) {
    const int nv = static_cast<int>(std::min<int64_t>(4, (N - j) / 16));
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; ++k) {
      const __m512 av = _mm512_set1_ps(a[k]);
      const float* bk = b + k * ldb + j;
      for (int v = 0; v < nv; ++v) acc[v] = _mm512_fmadd_ps(av, _mm512_loadu_ps(bk + 16 * v), acc[v]);
    }
    for (int v = 0; v < nv; ++v) {
      if (c) acc[v] = _mm512_add_ps(acc[v], _mm512_loadu_ps(c + j + 16 * v));
      _mm512_storeu_ps(r + j + 16 * v, acc[v]);
    }
  }
}
__attribute__((target("avx2,fma"))) void skinny_k_row_avx2(const float* a, const float* b, int64_t K, int64_t ldb, int64_t N,
                                                           const float* c, float* r) {
  for (int64_t j = 0; j < N; j += 32) {
    const int nv = static_cast<int>(std::min<int64_t>(4, (N - j) / 8));
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t k = 0; k < K; ++k) {
      const __m256 av = _mm256_set1_ps(a[k]);
      const float* bk = b + k * ldb + j;
      for (int v = 0; v < nv; ++v) acc[v] = _mm256_fmadd_ps(av, _mm256_loadu_ps(bk + 8 * v), acc[v]);
    }
    for (int v = 0; v < nv; ++v) {
      if (c) acc[v] = _mm256_add_ps(acc[v], _mm256_loadu_ps(c + j + 8 * v));
      _mm256_storeu_ps(r + j + 8 * v, acc[v]);
    }
  }
}
#endif

template <typename TA, typename TC>
void skinny_k(const TA* A, int64_t lda, const TA* B, int64_t ldb, TC* C, int64_t ldc, int64_t M, int64_t N,
              int64_t K, bool acc) {
  const std::vector<float> b = dense_f32(B, K, N, ldb);  // row k is B_k
  const float* bp = b.data();
  const cpu::Level isa = skinny_level();
  [[maybe_unused]] const int64_t width = isa == cpu::Level::Avx512 ? 16 : isa == cpu::Level::Avx2 ? 8 : 0;
#pragma omp parallel if (M * N > kSkinnyParallelWork)
  {
    std::vector<float> row(static_cast<size_t>(N));
    float* r = row.data();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
      const TA* ar = A + i * lda;
      TC* cr = C + i * ldc;
      int64_t j0 = 0;
#if defined(__x86_64__)
      if (width > 0 && N >= width) {
        // The vector columns straight into an fp32 C (and its old values added there); a bf16 C through the row.
        float a[kSkinny];
        for (int64_t k = 0; k < K; ++k) a[k] = to_f32(ar[k]);
        j0 = N / width * width;
        float* out = r;
        const float* old = nullptr;
        if constexpr (std::is_same_v<TC, float>) {
          out = cr;
          if (acc) old = cr;
        }
        if (isa == cpu::Level::Avx512) skinny_k_row_avx512(a, bp, K, N, j0, old, out);
        else skinny_k_row_avx2(a, bp, K, N, j0, old, out);
        if constexpr (!std::is_same_v<TC, float>)
          for (int64_t j = 0; j < j0; ++j) store(cr + j, r[j], acc);
        if (j0 == N) continue;
      }
#endif
      std::fill(row.begin(), row.end(), 0.f);
      for (int64_t k = 0; k < K; ++k) {
        const float av = to_f32(ar[k]);
        const float* br = bp + k * N;
#pragma omp simd
        for (int64_t j = j0; j < N; ++j) r[j] += av * br[j];
      }
      for (int64_t j = j0; j < N; ++j) store(cr + j, r[j], acc);
    }
  }
}

// Small M, A stored [K, M] (trans_a) and B [K, N]: C_m = sum_p A[p, m] B_p, a reduction over the K rows of B.
// Threads split the columns of C, so each sum runs over p in order. The vector paths keep a block of columns for a
// group of rows m in registers (one fused multiply-add per p, p ascending: the same operations as the scalar loop,
// which the compiler contracts to fused multiply-adds, so the same bits on every path).
#if defined(__x86_64__)
using simd::load16;
// c[m][0..32) = sum_p A[p, m0 + m] B[p, j0 .. j0 + 32) for m < MB.
template <int MB, typename TA>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void skinny_m_cols_avx512(const TA* A, int64_t lda, const TA* B, int64_t ldb,
                                                             int64_t K, int64_t m0, int64_t j0, float (*c)[32]) {
  __m512 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K; ++p) {
    const TA* br = B + p * ldb + j0;
    const __m512 b0 = load16(br), b1 = load16(br + 16);
    const TA* ar = A + p * lda + m0;
    for (int m = 0; m < MB; ++m) {
      const __m512 av = _mm512_set1_ps(to_f32(ar[m]));
      acc[m][0] = _mm512_fmadd_ps(av, b0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(av, b1, acc[m][1]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    _mm512_storeu_ps(c[m], acc[m][0]);
    _mm512_storeu_ps(c[m] + 16, acc[m][1]);
  }
}
using simd::load8;
// The same over 16 columns.
template <int MB, typename TA>
__attribute__((target("avx2,fma"))) void skinny_m_cols_avx2(const TA* A, int64_t lda, const TA* B, int64_t ldb,
                                                           int64_t K, int64_t m0, int64_t j0, float (*c)[32]) {
  __m256 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < K; ++p) {
    const TA* br = B + p * ldb + j0;
    const __m256 b0 = load8(br), b1 = load8(br + 8);
    const TA* ar = A + p * lda + m0;
    for (int m = 0; m < MB; ++m) {
      const __m256 av = _mm256_set1_ps(to_f32(ar[m]));
      acc[m][0] = _mm256_fmadd_ps(av, b0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(av, b1, acc[m][1]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    _mm256_storeu_ps(c[m], acc[m][0]);
    _mm256_storeu_ps(c[m] + 8, acc[m][1]);
  }
}
// Rows m0 .. m0 + mb (mb <= 8 on AVX-512, <= 6 on AVX2) over one block of columns.
template <typename TA>
void skinny_m_cols(cpu::Level isa, int64_t mb, const TA* A, int64_t lda, const TA* B, int64_t ldb, int64_t K,
                   int64_t m0, int64_t j0, float (*c)[32]) {
#define HS_SKINNY_M_CASE(n)                                                                    \
  case n:                                                                                      \
    if (isa == cpu::Level::Avx512) skinny_m_cols_avx512<n>(A, lda, B, ldb, K, m0, j0, c);      \
    else skinny_m_cols_avx2<n>(A, lda, B, ldb, K, m0, j0, c);                                 \
    return;
  switch (mb) {
    HS_SKINNY_M_CASE(1)
    HS_SKINNY_M_CASE(2)
    HS_SKINNY_M_CASE(3)
    HS_SKINNY_M_CASE(4)
    HS_SKINNY_M_CASE(5)
    HS_SKINNY_M_CASE(6)
    case 7: skinny_m_cols_avx512<7>(A, lda, B, ldb, K, m0, j0, c); return;
    default: skinny_m_cols_avx512<8>(A, lda, B, ldb, K, m0, j0, c); return;
  }
#undef HS_SKINNY_M_CASE
}
#endif

template <typename TA, typename TC>
void skinny_m(const TA* A, int64_t lda, const TA* B, int64_t ldb, TC* C, int64_t ldc, int64_t M, int64_t N,
              int64_t K, bool acc) {
  constexpr int64_t kCols = 64;
  [[maybe_unused]] const cpu::Level isa = skinny_level();
#if defined(__x86_64__)
  if (isa != cpu::Level::Scalar) {
    // Blocks of 32 (AVX-512) or 16 (AVX2) columns; the ragged last columns go to the scalar loop below.
    const int64_t cols = isa == cpu::Level::Avx512 ? 32 : 16, max_mb = isa == cpu::Level::Avx512 ? 8 : 6;
    const int64_t nblocks = N / cols;
#pragma omp parallel for schedule(static) if (K * N > kSkinnyParallelWork)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t j0 = blk * cols;
      float c[kSkinny][32];
      for (int64_t m0 = 0; m0 < M; m0 += max_mb)
        skinny_m_cols(isa, std::min(max_mb, M - m0), A, lda, B, ldb, K, m0, j0, c + m0);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < cols; ++j) store(C + m * ldc + j0 + j, c[m][j], acc);
    }
    const int64_t done = nblocks * cols;
    if (done == N) return;
    B += done, C += done, N -= done;
  }
#endif
  const int64_t nblocks = (N + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) if (K * N > kSkinnyParallelWork)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t j0 = blk * kCols, w = std::min(kCols, N - j0);
    float c[kSkinny][kCols] = {};
    for (int64_t p = 0; p < K; ++p) {
      const TA* br = B + p * ldb + j0;
      float b[kCols];
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) b[j] = to_f32(br[j]);
      for (int64_t m = 0; m < M; ++m) {
        const float a = to_f32(A[p * lda + m]);
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) c[m][j] += a * b[j];
      }
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < w; ++j) store(C + m * ldc + j0 + j, c[m][j], acc);
  }
}

// The product on oneDNN, leading dimensions resolved in k; tile: a tile of run_onednn's grid, whose rows and columns
// are given at execution.
void run_onednn_call(const void* A, const void* B, void* C, int64_t M, int64_t N, int64_t K, bool ta, bool tb, Key k,
                     bool varying_rows, int in_dt, int out_dt, bool tile = false) {
  // A row count that varies from call to call (varying_rows) is taken at execution: M when A is not
  // transposed, K (the summed rows) for a weight gradient dW += A^T B. oneDNN then runs its jit gemm instead of
  // the AMX brgemm primitive of the exact shape: 0.7-0.8x as fast for row-wise products at the MoE's shapes, but
  // 1.2-2.1x as fast for its weight gradients (K = 1000 rows: 256x256 100 vs 211 us, 512x256 203 vs 255 us), and
  // no primitive is created per count, so the caller needs neither fixed pieces nor a padded tail. (A transposed
  // A with a transposed B ignores the flag.)
  const bool runtime_k = varying_rows && ta && !tb;
  const bool runtime_m = (varying_rows && !ta) || tile;
  if (runtime_k) k.K = kRuntime;
  if (runtime_m) k.M = kRuntime;
  if (tile) k.N = kRuntime;
  Runtime& rt = runtime();
  // A registered packed copy of B (a weight in one of its uses): a fixed row count, A not transposed, B plain.
  if (!varying_rows && !ta && k.ldb == (tb ? K : N) && rt.n_packed.load(std::memory_order_acquire) > 0) {
    std::optional<PackedEntry> hit;
    {
      std::lock_guard<std::mutex> lock(rt.mu);
      const PackedKey want{in_dt, K, N, tb};
      for (auto [i, end] = rt.packed.equal_range(B); i != end; ++i)
        if (!(i->second.key < want) && !(want < i->second.key)) {
          hit = i->second;
          break;
        }
    }
    if (hit) {
      Key pk = k;
      pk.packed_b = true;
      pk.ldb = 0;
      if (auto p = get_prim(pk, &hit->desc)) {
        memory ma(p->a, rt.engine, const_cast<void*>(A));
        memory mb(p->b, rt.engine, const_cast<void*>(hit->data));
        memory mc(p->c, rt.engine, C);
        p->prim.execute(thread_stream(), {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
        thread_stream().wait();
        rt.packed_products.fetch_add(1, std::memory_order_relaxed);
        rt.onednn_calls.fetch_add(1, std::memory_order_relaxed);
        return;
      }
    }
  }
  auto p = get_prim(k);
  dnnl::stream& s = thread_stream();
  // A primitive with a dimension given at execution takes the operands' shapes here.
  const bool at_execution = runtime_k || runtime_m || tile;
  memory ma(!at_execution ? p->a
            : ta          ? memory::desc({M, K}, dnnl_type(in_dt), {1, k.lda})
                          : memory::desc({M, K}, dnnl_type(in_dt), {k.lda, 1}),
            rt.engine, const_cast<void*>(A));
  memory mb(at_execution ? plain_b(in_dt, K, N, tb, k.ldb) : p->b, rt.engine, const_cast<void*>(B));
  memory mc(at_execution ? memory::desc({M, N}, dnnl_type(out_dt), {k.ldc, 1}) : p->c, rt.engine, C);
  p->prim.execute(s, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  s.wait();
  rt.onednn_calls.fetch_add(1, std::memory_order_relaxed);
}

// Whether oneDNN's own threading keeps a product's bits whatever the thread count: its AVX-512 brgemm kernels (the
// products of a fixed shape there) give each thread whole output blocks. Its jit gemm does not: it cuts the summed
// dimension K among threads when M x N is small beside K, so the partial sums meet in an order that depends on the
// thread count. That gemm runs every product below AVX-512 (Debian's oneDNN 2.6 has no other fp32 matmul there) and
// the products whose rows are given at execution (varying_rows) at every level (measured: a bf16 weight gradient of
// 40 x 48 summed over 20000 rows, on an AMX Xeon). The level is asked of oneDNN itself, once: the ISA it runs
// (HS_MAX_ISA's cap, handed over before its first primitive), not cpu::level(), which a test's ScopedLevel lowers for
// the engine's own loops only.
bool onednn_threads_keep_bits(bool varying_rows) {
  static const bool brgemm = [] {
    runtime();  // the cap reaches oneDNN first
    return cpu::onednn_isa().rfind("avx512", 0) == 0;
  }();
  return brgemm && !varying_rows;
}

// Where they do not, the engine cuts the product itself: C in a grid of tiles that depends on the shape only, each
// tile one single-threaded oneDNN call over the whole K, the tiles shared among the threads. Each element is then
// summed by one thread in the order the single-threaded gemm gives a tile of that shape, so any thread count gives the
// same bits. The tiles take their rows and columns at execution (one primitive per K and leading dimensions). A tile
// is at most 128 x 256 and at least 32 x 64 (or the whole side): up to 8 x 4 tiles where the sides allow, so a small
// output still spreads over several cores; packing repeats A's tile per column tile and B's per row tile, at most
// 1/32 + 1/64 of the arithmetic in copies.
int64_t tile_side(int64_t n, int64_t parts, int64_t lo, int64_t hi) {
  if (n <= lo) return n;
  return std::clamp(((n + parts - 1) / parts + 15) & ~int64_t{15}, lo, hi);
}

void run_onednn(const void* A, const void* B, void* C, int64_t M, int64_t N, int64_t K, bool ta, bool tb, Key k,
                bool varying_rows, int in_dt, int out_dt) {
  if (onednn_threads_keep_bits(varying_rows) || omp_in_parallel())
    return run_onednn_call(A, B, C, M, N, K, ta, tb, k, varying_rows, in_dt, out_dt);
  const int64_t mt = tile_side(M, 8, 32, 128), nt = tile_side(N, 4, 64, 256);
  const int64_t tn = (N + nt - 1) / nt, tiles = (M + mt - 1) / mt * tn;
  const int64_t ein = in_dt == 0 ? sizeof(float) : sizeof(bf16), eout = out_dt == 0 ? sizeof(float) : sizeof(bf16);
  auto tile = [&](int64_t t) {
    const int64_t i0 = t / tn * mt, j0 = t % tn * nt, mi = std::min(mt, M - i0), nj = std::min(nt, N - j0);
    const char* At = static_cast<const char*>(A) + (ta ? i0 : i0 * k.lda) * ein;
    const char* Bt = static_cast<const char*>(B) + (tb ? j0 * k.ldb : j0) * ein;
    char* Ct = static_cast<char*>(C) + (i0 * k.ldc + j0) * eout;
    run_onednn_call(At, Bt, Ct, mi, nj, K, ta, tb, k, varying_rows, in_dt, out_dt, true);
  };
  if (tiles == 1) {  // one tile: on this thread alone (oneDNN takes omp_get_max_threads()), restored if it throws
    struct OneThread {
      int threads = omp_get_max_threads();
      OneThread() { omp_set_num_threads(1); }
      ~OneThread() { omp_set_num_threads(threads); }
    } one;
    tile(0);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < tiles; ++t) tile(t);
}


// ---- bf16 products where oneDNN has none --------------------------------------------------------------------
// Below AVX-512-BF16 (kernels/matmul.cpp's onednn_runs_bf16) a bf16 product widens its operands to fp32, exactly (a
// bf16 is the top half of a float), and runs oneDNN's fp32 product on them, a block at a time: blocks of the rows
// of op(A), the columns of op(B) and the summed dimension K, each operand's block of at most kWidenedBlockBytes of
// fp32, so the scratch stays under 3 x that whatever the operands' size (the LM head's B is vocabulary x hidden, and
// its weight gradient sums over the batch). A K block after the first adds into C (fp32: C itself; bf16 C: an fp32
// copy of the block, rounded once at the end). The sums are fp32 as on every path; only their order is oneDNN's fp32 kernel's. The
// scratch is per calling thread, reused from call to call, and lives outside the memory accountant, as oneDNN's own
// scratchpad does (tests/memory_rss_test.cpp bounds what the accountant does not see).
constexpr int64_t kWidenedBlockBytes = int64_t{1} << 20;

struct WidenScratch {
  std::vector<float> a, b, c;
};
WidenScratch& widen_scratch() {
  thread_local WidenScratch s;
  return s;
}

// dst[r, 0 .. cols) = src[r * lds ...] widened, for rows r < rows (dst dense, row length cols).
void widen_rows(const bf16* src, int64_t lds, int64_t rows, int64_t cols, float* dst) {
#pragma omp parallel for schedule(static) if (rows * cols > kParallelMinWork)
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* s = src + r * lds;
    float* d = dst + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) d[c] = to_f32(s[c]);
  }
}

// How many of `total` rows (or columns) of `width` floats fit a block: a multiple of 64 (or all of them).
int64_t block_count(int64_t total, int64_t width) {
  return std::min(total, std::max<int64_t>(64, kWidenedBlockBytes / 4 / std::max<int64_t>(1, width) / 64 * 64));
}

void run_widened(const void* Av, const void* Bv, void* Cv, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                 bool acc, const Key& k, bool varying_rows, int out_dt) {
  const bf16* A = static_cast<const bf16*>(Av);
  const bf16* B = static_cast<const bf16*>(Bv);
  WidenScratch& w = widen_scratch();
  // Blocks of K, then of N, then of M, each sized so that the A block (mb x kb), the B block (kb x nb) and the C
  // block (mb x nb) all stay within kWidenedBlockBytes: mb <= cap / max(kb, nb) and nb <= cap / kb.
  const int64_t kb = block_count(K, 256);
  const int64_t nb_max = block_count(N, kb);
  const int64_t mb = block_count(M, std::max(kb, nb_max));
  w.a.resize(static_cast<size_t>(mb * kb));
  w.b.resize(static_cast<size_t>(nb_max * kb));
  if (out_dt == 1) w.c.resize(static_cast<size_t>(mb * nb_max));
  for (int64_t i0 = 0; i0 < M; i0 += mb) {
    const int64_t mi = std::min(mb, M - i0);
    for (int64_t j0 = 0; j0 < N; j0 += nb_max) {
      const int64_t nb = std::min(nb_max, N - j0);
      bf16* Cb = out_dt == 1 ? static_cast<bf16*>(Cv) + i0 * k.ldc + j0 : nullptr;
      float* Cf = out_dt == 0 ? static_cast<float*>(Cv) + i0 * k.ldc + j0 : w.c.data();
      const int64_t ldc = out_dt == 0 ? k.ldc : nb;
      if (out_dt == 1 && acc) widen_rows(Cb, k.ldc, mi, nb, w.c.data());
      for (int64_t p0 = 0; p0 < K; p0 += kb) {
        const int64_t kp = std::min(kb, K - p0);
        // A's block as stored: rows i0.. of [M, K], or rows p0.. (columns i0..) of [K, M] (ta).
        if (ta) widen_rows(A + p0 * k.lda + i0, k.lda, kp, mi, w.a.data());
        else widen_rows(A + i0 * k.lda + p0, k.lda, mi, kp, w.a.data());
        // B's block: rows j0.. of a transposed B ([N, K]), else columns j0.. of its rows p0...
        if (tb) widen_rows(B + j0 * k.ldb + p0, k.ldb, nb, kp, w.b.data());
        else widen_rows(B + p0 * k.ldb + j0, k.ldb, kp, nb, w.b.data());
        const bool add = acc || p0 > 0;
        Key fk{mi, nb, kp, ta ? mi : kp, tb ? kp : nb, ldc, ta, tb, add, 0, 0};
        run_onednn(w.a.data(), w.b.data(), Cf, mi, nb, kp, ta, tb, fk, varying_rows, 0, 0);
      }
      if (out_dt == 1) {
#pragma omp parallel for schedule(static) if (mi * nb > kParallelMinWork)
        for (int64_t i = 0; i < mi; ++i) convert(w.c.data() + i * nb, Cb + i * k.ldc, static_cast<size_t>(nb));
      }
    }
  }
}

// Runs the product here when it is skinny in a layout these loops cover; false leaves it to oneDNN.
template <typename TA, typename TC>
bool run_skinny(const void* Av, const void* Bv, void* Cv, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                bool acc, int64_t lda, int64_t ldb, int64_t ldc) {
  const TA* A = static_cast<const TA*>(Av);
  const TA* B = static_cast<const TA*>(Bv);
  TC* C = static_cast<TC*>(Cv);
  if (N <= kSkinny && !ta && tb) skinny_n(A, lda, B, ldb, C, ldc, M, N, K, acc);
  else if (K <= kSkinny && !ta && !tb) skinny_k(A, lda, B, ldb, C, ldc, M, N, K, acc);
  else if (M <= kSkinny && ta && !tb) skinny_m(A, lda, B, ldb, C, ldc, M, N, K, acc);
  else return false;
  return true;
}

void run(const void* A, const void* B, void* C, int64_t M, int64_t N, int64_t K, bool ta, bool tb, bool acc,
         MatmulLayout ld, int in_dt, int out_dt) {
  profile::MatmulScope profile_scope({M, N, K, ta, tb, acc, ld.varying_rows, in_dt, out_dt});
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!acc) throw std::invalid_argument("matmul with K = 0 and no accumulation");
    return;
  }
  Key k{M, N, K, ld.lda ? ld.lda : (ta ? M : K), ld.ldb ? ld.ldb : (tb ? K : N), ld.ldc ? ld.ldc : N,
        ta, tb, acc, in_dt, out_dt};
  if (t_small_rows && !ta && tb && !acc && M <= kGemvMaxRows && k.ldb == K) {
    if (in_dt == 0) gemv(static_cast<const float*>(A), static_cast<const float*>(B), static_cast<float*>(C), M, N, K,
                         k.lda, k.ldc);
    else if (out_dt == 0) gemv(static_cast<const bf16*>(A), static_cast<const bf16*>(B), static_cast<float*>(C), M, N,
                               K, k.lda, k.ldc);
    else gemv(static_cast<const bf16*>(A), static_cast<const bf16*>(B), static_cast<bf16*>(C), M, N, K, k.lda, k.ldc);
    return;
  }
  if (std::min({M, N, K}) <= kSkinny && std::max({M, N, K}) > kSkinny) {
    const bool done = in_dt == 0   ? run_skinny<float, float>(A, B, C, M, N, K, ta, tb, acc, k.lda, k.ldb, k.ldc)
                      : out_dt == 0 ? run_skinny<bf16, float>(A, B, C, M, N, K, ta, tb, acc, k.lda, k.ldb, k.ldc)
                                    : run_skinny<bf16, bf16>(A, B, C, M, N, K, ta, tb, acc, k.lda, k.ldb, k.ldc);
    if (done) return;
  }
  if (in_dt == 1 && !onednn_runs_bf16()) return run_widened(A, B, C, M, N, K, ta, tb, acc, k, ld.varying_rows, out_dt);
  run_onednn(A, B, C, M, N, K, ta, tb, k, ld.varying_rows, in_dt, out_dt);
}

}  // namespace

cpu::Level skinny_level() {
#if defined(__x86_64__)
  if (cpu::allows(cpu::Level::Avx512)) return cpu::Level::Avx512;
  if (cpu::allows(cpu::Level::Avx2)) return cpu::Level::Avx2;
#endif
  return cpu::Level::Scalar;
}

void matmul(const float* A, const float* B, float* C, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
            bool acc, MatmulLayout ld) {
  run(A, B, C, M, N, K, ta, tb, acc, ld, 0, 0);
}
void matmul(const bf16* A, const bf16* B, float* C, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
            bool acc, MatmulLayout ld) {
  run(A, B, C, M, N, K, ta, tb, acc, ld, 1, 0);
}
void matmul(const bf16* A, const bf16* B, bf16* C, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
            bool acc, MatmulLayout ld) {
  run(A, B, C, M, N, K, ta, tb, acc, ld, 1, 1);
}

size_t packed_weight_bytes(DType dt, int64_t out, int64_t in, WeightUse use) {
  if (out <= 0 || in <= 0) return 0;
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mu);
  const auto layout = packed_layout_locked(rt, packed_key(dt, out, in, use));
  return layout ? layout->get_size() : 0;
}

PackedWeight::PackedWeight(const void* W, DType dt, int64_t out, int64_t in, WeightUse use, MemoryAccountant& mem,
                           MemCategory cat, std::string_view tag)
    : W_(W), dt_(dt), out_(out), in_(in), use_(use) {
  const size_t bytes = packed_weight_bytes(dt, out, in, use);
  if (bytes) buf_ = mem.allocate(bytes, cat, tag);
}

PackedWeight& PackedWeight::operator=(PackedWeight&& o) noexcept {
  if (this != &o) {
    release();
    W_ = o.W_;
    dt_ = o.dt_;
    out_ = o.out_;
    in_ = o.in_;
    use_ = o.use_;
    buf_ = std::move(o.buf_);
    registered_ = o.registered_;
    o.registered_ = false;
  }
  return *this;
}

void PackedWeight::pack() {
  if (buf_.empty() || !buf_.data() || registered_) return;  // nothing to pack, planning, or packed already
  if (!W_) throw std::invalid_argument("PackedWeight: no weight to pack");
  Runtime& rt = runtime();
  const PackedKey pk = packed_key(dt_, out_, in_, use_);
  memory::desc layout;
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    layout = *packed_layout_locked(rt, pk);  // present: the buffer was sized from it
  }
  memory src(plain_b(pk.dt, pk.K, pk.N, pk.tb, pk.tb ? pk.K : pk.N), rt.engine, const_cast<void*>(W_));
  memory dst(layout, rt.engine, buf_.data());
  dnnl::reorder(src, dst).execute(thread_stream(), src, dst);
  thread_stream().wait();
  std::lock_guard<std::mutex> lock(rt.mu);
  rt.packed.emplace(W_, PackedEntry{pk, buf_.data(), layout});
  rt.n_packed.fetch_add(1, std::memory_order_release);
  registered_ = true;
}

void PackedWeight::release() {
  if (registered_) {
    Runtime& rt = runtime();
    std::lock_guard<std::mutex> lock(rt.mu);
    for (auto [i, end] = rt.packed.equal_range(W_); i != end; ++i)
      if (i->second.data == buf_.data()) {
        rt.packed.erase(i);
        rt.n_packed.fetch_sub(1, std::memory_order_release);
        break;
      }
    registered_ = false;
  }
  buf_.reset();
}

int64_t matmul_packed_products() { return runtime().packed_products.load(); }
int64_t matmul_onednn_calls() { return runtime().onednn_calls.load(); }

SmallRowProducts::SmallRowProducts() : previous_(t_small_rows) { t_small_rows = true; }
SmallRowProducts::~SmallRowProducts() { t_small_rows = previous_; }

bool matmul_bf16_on_onednn() { return onednn_runs_bf16(); }

int64_t matmul_primitives_created() {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mu);
  return rt.created;
}

}  // namespace hs::kernels
