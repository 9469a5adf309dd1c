#include "kernels/matmul.h"

#include "core/profile.h"
#include "kernels/gemv.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <tuple>
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
  auto tie() const { return std::tie(M, N, K, lda, ldb, ldc, ta, tb, acc, in_dt, out_dt); }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

struct Prim {
  dnnl::matmul prim;
  memory::desc a, b, c;
};

struct Runtime {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mu;
  std::map<Key, std::shared_ptr<Prim>> cache;
  int64_t created = 0;
};

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

memory::data_type dnnl_type(int t) { return t == 0 ? memory::data_type::f32 : memory::data_type::bf16; }

std::shared_ptr<Prim> get_prim(const Key& k) {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mu);
  auto it = rt.cache.find(k);
  if (it != rt.cache.end()) return it->second;
  // Row-major [rows, cols] with a leading dimension; a transposed operand is the same memory viewed
  // with swapped strides.
  memory::desc a = k.ta ? memory::desc({k.M, k.K}, dnnl_type(k.in_dt), {1, k.lda})
                        : memory::desc({k.M, k.K}, dnnl_type(k.in_dt), {k.lda, 1});
  memory::desc b = k.tb ? memory::desc({k.K, k.N}, dnnl_type(k.in_dt), {1, k.ldb})
                        : memory::desc({k.K, k.N}, dnnl_type(k.in_dt), {k.ldb, 1});
  memory::desc c({k.M, k.N}, dnnl_type(k.out_dt), {k.ldc, 1});
  dnnl::primitive_attr attr;
  if (k.acc) {
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  dnnl::matmul::desc d(a, b, c);
  dnnl::matmul::primitive_desc pd(d, attr, rt.engine);
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
// like oneDNN.
constexpr int64_t kSkinny = 16;

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

// Small N, A [M, K] rows and B stored [N, K] (trans_b): C[i, j] = dot(A_i, B_j), both contiguous in K.
template <typename TA, typename TC>
void skinny_n(const TA* A, int64_t lda, const TA* B, int64_t ldb, TC* C, int64_t ldc, int64_t M, int64_t N,
              int64_t K, bool acc) {
  const std::vector<float> b = dense_f32(B, N, K, ldb);  // row j is B_j
  const float* bp = b.data();
#pragma omp parallel if (M * K > (1 << 15))
  {
    std::vector<float> a(static_cast<size_t>(K));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
      const TA* ar = A + i * lda;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) a[static_cast<size_t>(k)] = to_f32(ar[k]);
      for (int64_t j = 0; j < N; ++j) {
        const float* br = bp + j * K;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < K; ++k) s += a[static_cast<size_t>(k)] * br[k];
        store(C + i * ldc + j, s, acc);
      }
    }
  }
}

// Small K, A [M, K] and B [K, N] (no transposes): C_i = sum_k A[i, k] B_k, streaming rows of C.
template <typename TA, typename TC>
void skinny_k(const TA* A, int64_t lda, const TA* B, int64_t ldb, TC* C, int64_t ldc, int64_t M, int64_t N,
              int64_t K, bool acc) {
  const std::vector<float> b = dense_f32(B, K, N, ldb);  // row k is B_k
  const float* bp = b.data();
#pragma omp parallel if (M * N > (1 << 15))
  {
    std::vector<float> row(static_cast<size_t>(N));
    float* r = row.data();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
      const TA* ar = A + i * lda;
      std::fill(row.begin(), row.end(), 0.f);
      for (int64_t k = 0; k < K; ++k) {
        const float a = to_f32(ar[k]);
        const float* br = bp + k * N;
#pragma omp simd
        for (int64_t j = 0; j < N; ++j) r[j] += a * br[j];
      }
      TC* cr = C + i * ldc;
      for (int64_t j = 0; j < N; ++j) store(cr + j, r[j], acc);
    }
  }
}

// Small M, A stored [K, M] (trans_a) and B [K, N]: C_m = sum_p A[p, m] B_p, a reduction over the K rows of B.
// Threads split the columns of C, so each sum runs over p in order.
template <typename TA, typename TC>
void skinny_m(const TA* A, int64_t lda, const TA* B, int64_t ldb, TC* C, int64_t ldc, int64_t M, int64_t N,
              int64_t K, bool acc) {
  constexpr int64_t kCols = 64;
  const int64_t nblocks = (N + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) if (K * N > (1 << 15))
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
  // A row count that varies from call to call (ld.varying_rows) is taken at execution: M when A is not
  // transposed, K (the summed rows) for a weight gradient dW += A^T B. oneDNN then runs its jit gemm instead of
  // the AMX brgemm primitive of the exact shape: 0.7-0.8x as fast for row-wise products at the MoE's shapes, but
  // 1.2-2.1x as fast for its weight gradients (K = 1000 rows: 256x256 100 vs 211 us, 512x256 203 vs 255 us), and
  // no primitive is created per count, so the caller needs neither fixed pieces nor a padded tail. (A transposed
  // A with a transposed B ignores the flag.)
  const bool runtime_k = ld.varying_rows && ta && !tb;
  const bool runtime_m = ld.varying_rows && !ta;
  const int64_t K_exec = K;
  if (runtime_k) k.K = kRuntime;
  if (runtime_m) k.M = kRuntime;
  auto p = get_prim(k);
  Runtime& rt = runtime();
  thread_local dnnl::stream s(rt.engine);  // one per calling thread, made once
  memory ma(runtime_k   ? memory::desc({M, K_exec}, dnnl_type(in_dt), {1, k.lda})
            : runtime_m ? memory::desc({M, K}, dnnl_type(in_dt), {k.lda, 1})
                        : p->a,
            rt.engine, const_cast<void*>(A));
  memory mb(runtime_k ? memory::desc({K_exec, N}, dnnl_type(in_dt), {k.ldb, 1}) : p->b, rt.engine,
            const_cast<void*>(B));
  memory mc(runtime_m ? memory::desc({M, N}, dnnl_type(out_dt), {k.ldc, 1}) : p->c, rt.engine, C);
  p->prim.execute(s, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  s.wait();
}

}  // namespace

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

template <typename TA, typename TC>
void matmul_reference(const TA* A, const TA* B, TC* C, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                      bool acc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = acc ? static_cast<double>(to_f32(C[i * N + j])) : 0.0;
      for (int64_t p = 0; p < K; ++p) {
        double a = to_f32(ta ? A[p * M + i] : A[i * K + p]);
        double b = to_f32(tb ? B[j * K + p] : B[p * N + j]);
        s += a * b;
      }
      C[i * N + j] = from_f32<TC>(static_cast<float>(s));
    }
}
template void matmul_reference<float, float>(const float*, const float*, float*, int64_t, int64_t, int64_t,
                                             bool, bool, bool);
template void matmul_reference<bf16, float>(const bf16*, const bf16*, float*, int64_t, int64_t, int64_t,
                                            bool, bool, bool);

SmallRowProducts::SmallRowProducts() : previous_(t_small_rows) { t_small_rows = true; }
SmallRowProducts::~SmallRowProducts() { t_small_rows = previous_; }

int64_t matmul_primitives_created() {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mu);
  return rt.created;
}

}  // namespace hs::kernels
