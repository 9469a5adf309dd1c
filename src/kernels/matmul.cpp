#include "kernels/matmul.h"

#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <tuple>

namespace hs::kernels {
namespace {

using dnnl::memory;

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

void run(const void* A, const void* B, void* C, int64_t M, int64_t N, int64_t K, bool ta, bool tb, bool acc,
         MatmulLayout ld, int in_dt, int out_dt) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!acc) throw std::invalid_argument("matmul with K = 0 and no accumulation");
    return;
  }
  Key k{M, N, K, ld.lda ? ld.lda : (ta ? M : K), ld.ldb ? ld.ldb : (tb ? K : N), ld.ldc ? ld.ldc : N,
        ta, tb, acc, in_dt, out_dt};
  auto p = get_prim(k);
  Runtime& rt = runtime();
  dnnl::stream s(rt.engine);
  memory ma(p->a, rt.engine, const_cast<void*>(A));
  memory mb(p->b, rt.engine, const_cast<void*>(B));
  memory mc(p->c, rt.engine, C);
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

int64_t matmul_primitives_created() {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mu);
  return rt.created;
}

}  // namespace hs::kernels
