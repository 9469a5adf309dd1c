#include "kernels/adamw.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>
#include <stdexcept>
#include <string>

#include <omp.h>

#include "core/profile.h"
#include "kernels/cpu.h"
#include "kernels/simd.h"

namespace hs::kernels {
namespace {

// sum_squares cuts x into at most kMaxBlocks blocks of at least kMinBlock elements: enough blocks to
// spread over the threads, few enough that their sums fit on the stack.
constexpr int64_t kMaxBlocks = 1024;
constexpr int64_t kMinBlock = 1 << 15;


// The element formula, in PyTorch's order with the roundings the previous loop had (GCC contracted it, with FMA
// available, to exactly these fused operations; kernels/reference/adamw_reference.cpp keeps it):
//   g = grad * s;  m' = fma(1 - b1, g - m, m);  v' = fma(b2, v, ((1 - b2) * g) * g);
//   w' = fma(decay, w, -(step_size * (m' / (sqrt(v') / sqrt(bc2) + eps))))   (decay * w - t, rounded once)
// Every path (scalar, AVX2, AVX-512) computes it with the same correctly rounded operations, so they agree to the bit.
struct Consts {
  float scale, beta2, eps, step_size, bc2_sqrt, one_minus_b1, one_minus_b2, decay;
};

inline float bf16_round(float x) { return bf16::to_float(bf16::from_float(x)); }

// Elements [i0, i1) on the calling thread, one at a time. Moments in bf16 (TM) are read as fp32, the step runs in
// fp32 as for fp32 moments, and the new moments are stored rounded to nearest even.
template <bool kClear, typename TW, typename TM>
inline void range_scalar(TW* w, float* grad, TM* m, TM* v, int64_t i0, int64_t i1, const Consts& c) {
  for (int64_t i = i0; i < i1; ++i) {
    const float g = grad[i] * c.scale;
    const float m0 = to_f32(m[i]), v0 = to_f32(v[i]);
    const float mi = std::fma(c.one_minus_b1, g - m0, m0);  // lerp, as torch's exp_avg.lerp_
    const float vi = std::fma(c.beta2, v0, (c.one_minus_b2 * g) * g);
    const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    w[i] = from_f32<TW>(std::fma(c.decay, to_f32(w[i]), -(c.step_size * (mi / denom))));
    m[i] = from_f32<TM>(mi);
    v[i] = from_f32<TM>(vi);
    if constexpr (kClear) grad[i] = 0.0f;
  }
}

#if defined(__x86_64__)
#define HS_AVX2 __attribute__((target("avx2,fma")))
#define HS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// bf16 <-> fp32 in 8 and 16 lanes, rounded as bf16::from_float rounds (kernels/simd.h).
using simd::load16;
using simd::load8;
using simd::store16;
using simd::store8;

template <bool kClear, typename TW, typename TM>
HS_AVX2 void range_avx2(TW* w, float* grad, TM* m, TM* v, int64_t i0, int64_t i1, const Consts& c) {
  const __m256 scale = _mm256_set1_ps(c.scale), beta2 = _mm256_set1_ps(c.beta2), eps = _mm256_set1_ps(c.eps),
               step_size = _mm256_set1_ps(c.step_size), bc2 = _mm256_set1_ps(c.bc2_sqrt),
               c1 = _mm256_set1_ps(c.one_minus_b1), c2 = _mm256_set1_ps(c.one_minus_b2), decay = _mm256_set1_ps(c.decay);
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad + i), scale);
    const __m256 m0 = load8(m + i), v0 = load8(v + i);
    const __m256 mi = _mm256_fmadd_ps(c1, _mm256_sub_ps(g, m0), m0);
    const __m256 vi = _mm256_fmadd_ps(beta2, v0, _mm256_mul_ps(_mm256_mul_ps(c2, g), g));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2), eps);
    const __m256 t = _mm256_mul_ps(step_size, _mm256_div_ps(mi, denom));
    store8(w + i, _mm256_fmsub_ps(decay, load8(w + i), t));
    store8(m + i, mi);
    store8(v + i, vi);
    if constexpr (kClear) _mm256_storeu_ps(grad + i, _mm256_setzero_ps());
  }
  range_scalar<kClear>(w, grad, m, v, i, i1, c);
}

// The same in 16 lanes.
template <bool kClear, typename TW, typename TM>
HS_AVX512 void range_avx512(TW* w, float* grad, TM* m, TM* v, int64_t i0, int64_t i1, const Consts& c) {
  const __m512 scale = _mm512_set1_ps(c.scale), beta2 = _mm512_set1_ps(c.beta2), eps = _mm512_set1_ps(c.eps),
               step_size = _mm512_set1_ps(c.step_size), bc2 = _mm512_set1_ps(c.bc2_sqrt),
               c1 = _mm512_set1_ps(c.one_minus_b1), c2 = _mm512_set1_ps(c.one_minus_b2), decay = _mm512_set1_ps(c.decay);
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(grad + i), scale);
    const __m512 m0 = load16(m + i), v0 = load16(v + i);
    const __m512 mi = _mm512_fmadd_ps(c1, _mm512_sub_ps(g, m0), m0);
    const __m512 vi = _mm512_fmadd_ps(beta2, v0, _mm512_mul_ps(_mm512_mul_ps(c2, g), g));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
    const __m512 t = _mm512_mul_ps(step_size, _mm512_div_ps(mi, denom));
    store16(w + i, _mm512_fmsub_ps(decay, load16(w + i), t));
    store16(m + i, mi);
    store16(v + i, vi);
    if constexpr (kClear) _mm512_storeu_ps(grad + i, _mm512_setzero_ps());
  }
  range_scalar<kClear>(w, grad, m, v, i, i1, c);
}
#undef HS_AVX2
#undef HS_AVX512
#endif

template <bool kClear, typename TW, typename TM>
void update_range(cpu::Level isa, TW* w, float* grad, TM* m, TM* v, int64_t i0, int64_t i1, const Consts& c) {
#if defined(__x86_64__)
  switch (isa) {
    case cpu::Level::Avx512: return range_avx512<kClear>(w, grad, m, v, i0, i1, c);
    case cpu::Level::Avx2: return range_avx2<kClear>(w, grad, m, v, i0, i1, c);
    default: break;  // Scalar
  }
#else
  (void)isa;
#endif
  range_scalar<kClear>(w, grad, m, v, i0, i1, c);
}

Consts consts(const AdamWParams& p, const AdamWScalars& k, float weight_decay) {
  return {p.grad_scale, p.beta2, p.eps, k.step_size, k.bc2_sqrt, k.one_minus_b1, k.one_minus_b2,
          std::fma(-p.lr, weight_decay, 1.0f)};  // 1 - lr * wd, rounded once (as the previous loop had it)
}

template <typename TW>
void update(TW* w, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p, int64_t step) {
  const Consts c = consts(p, adamw_scalars(p, step), p.weight_decay);
  const cpu::Level isa = adamw_level();
  constexpr int64_t kPiece = 4096;
  const int64_t pieces = (n + kPiece - 1) / kPiece;
  // The gradient is only read (kClear = false): the cast drops a const the kernel does not use.
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < pieces; ++c0)
    update_range<false>(isa, w, const_cast<float*>(grad), m, v, c0 * kPiece, std::min(n, (c0 + 1) * kPiece), c);
}

// sum_squares's blocks of an n-element array.
int64_t block_size(int64_t n) { return std::max(kMinBlock, (n + kMaxBlocks - 1) / kMaxBlocks); }

// One block's sum, a single function so that sum_squares and sum_squares_all add in the same order.
[[gnu::noinline]] double block_sum(const float* x, int64_t i0, int64_t i1) {
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = i0; i < i1; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return s;
}

}  // namespace

AdamWScalars adamw_scalars(const AdamWParams& p, int64_t step) {
  if (step < 1) throw std::invalid_argument("adamw_update: step is 1-based, got " + std::to_string(step));
  const double bc1 = 1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(step));
  return {static_cast<float>(static_cast<double>(p.lr) / bc1), static_cast<float>(std::sqrt(bc2)), 1.0f - p.beta1,
          1.0f - p.beta2};
}

cpu::Level adamw_level() {
#if defined(__x86_64__)
  if (cpu::allows(cpu::Level::Avx512)) return cpu::Level::Avx512;
  if (cpu::allows(cpu::Level::Avx2)) return cpu::Level::Avx2;
#endif
  return cpu::Level::Scalar;
}

template <typename TW>
void adamw_update(TW* w, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p, int64_t step) {
  profile::Scope profile_scope(profile::Phase::Optimizer, "adamw_update");
  update(w, grad, m, v, n, p, step);
}

double sum_squares(const float* x, int64_t n) {
  if (n <= 0) return 0.0;
  const int64_t block = block_size(n);
  const int64_t nblocks = (n + block - 1) / block;
  double partial[kMaxBlocks];
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t i0 = blk * block;
    partial[blk] = block_sum(x, i0, std::min(n, i0 + block));
  }
  double total = 0.0;
  for (int64_t blk = 0; blk < nblocks; ++blk) total += partial[blk];
  return total;
}

void adamw_update_clear_all(const std::vector<AdamWTensor>& tensors, const AdamWParams& p, int64_t step) {
  profile::Scope profile_scope(profile::Phase::Optimizer, "adamw_update_clear_all");
  const AdamWScalars k = adamw_scalars(p, step);
  for (const AdamWTensor& t : tensors) {
    if ((t.w == nullptr) == (t.w_bf16 == nullptr))
      throw std::invalid_argument("adamw_update_clear_all: each tensor needs exactly one of w, w_bf16");
    if ((t.m == nullptr) == (t.m_bf16 == nullptr) || (t.v == nullptr) == (t.v_bf16 == nullptr) ||
        (t.m == nullptr) != (t.v == nullptr))
      throw std::invalid_argument("adamw_update_clear_all: each tensor needs m, v or m_bf16, v_bf16");
  }
  // The tensors' elements as one sequence (first[t]: tensor t's first), cut into one contiguous range per thread at
  // multiples of 64 elements: each thread streams through its own part of the arrays, whatever the tensors' sizes.
  std::vector<int64_t> first(tensors.size() + 1, 0);
  for (size_t t = 0; t < tensors.size(); ++t) first[t + 1] = first[t] + tensors[t].n;
  const int64_t total = first.back();
  const cpu::Level isa = adamw_level();
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const auto cut = [&](int64_t j) { return j == nt ? total : std::min(total, (total * j / nt) & ~int64_t{63}); };
    const int64_t e0 = cut(id), e1 = cut(id + 1);
    size_t t = static_cast<size_t>(std::upper_bound(first.begin(), first.end(), e0) - first.begin()) - 1;
    for (; e0 < e1 && t < tensors.size() && first[t] < e1; ++t) {
      const AdamWTensor& a = tensors[t];
      const int64_t i0 = std::max<int64_t>(0, e0 - first[t]), i1 = std::min(a.n, e1 - first[t]);
      if (i0 >= i1) continue;
      const Consts c = consts(p, k, a.weight_decay);
      if (a.m) {
        if (a.w) update_range<true>(isa, a.w, a.grad, a.m, a.v, i0, i1, c);
        else update_range<true>(isa, a.w_bf16, a.grad, a.m, a.v, i0, i1, c);
      } else {
        if (a.w) update_range<true>(isa, a.w, a.grad, a.m_bf16, a.v_bf16, i0, i1, c);
        else update_range<true>(isa, a.w_bf16, a.grad, a.m_bf16, a.v_bf16, i0, i1, c);
      }
    }
  }
}

double sum_squares_all(const std::vector<std::pair<const float*, int64_t>>& arrays) {
  profile::Scope profile_scope(profile::Phase::Optimizer, "sum_squares_all");
  struct Block {
    const float* x;
    int64_t i0, i1;
  };
  std::vector<Block> blocks;
  std::vector<size_t> first;  // index of each array's first block
  for (const auto& [x, n] : arrays) {
    first.push_back(blocks.size());
    const int64_t b = block_size(n);
    for (int64_t i = 0; i < n; i += b) blocks.push_back({x, i, std::min(n, i + b)});
  }
  first.push_back(blocks.size());
  std::vector<double> partial(blocks.size());
  const auto nb = static_cast<int64_t>(blocks.size());
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < nb; ++j) {
    const Block& b = blocks[static_cast<size_t>(j)];
    partial[static_cast<size_t>(j)] = block_sum(b.x, b.i0, b.i1);
  }
  // Per array in block order (as sum_squares adds them), then the arrays in order.
  double total = 0.0;
  for (size_t a = 0; a + 1 < first.size(); ++a) {
    double t = 0.0;
    for (size_t j = first[a]; j < first[a + 1]; ++j) t += partial[j];
    total += t;
  }
  return total;
}

template void adamw_update<float>(float*, const float*, float*, float*, int64_t, const AdamWParams&, int64_t);
template void adamw_update<bf16>(bf16*, const float*, float*, float*, int64_t, const AdamWParams&, int64_t);

}  // namespace hs::kernels
