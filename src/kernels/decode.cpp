#include "kernels/decode.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "core/compute.h"
#include "kernels/conv.h"
#include "kernels/cpu.h"
#include "kernels/simd.h"
#include "kernels/vec_math.h"

namespace hs::kernels {

template <typename T>
void causal_conv_silu_cached(const T* x, const float* w, const ColumnBlocks<T>& y, T* window, const int32_t* slots,
                             int64_t batch, int64_t seq, int64_t channels, int64_t width) {
  if (width < 1 || width > kMaxConvWidth)
    throw std::invalid_argument("causal_conv_silu_cached: width " + std::to_string(width) + " is outside [1, " +
                                std::to_string(kMaxConvWidth) + "]");
  if (y.channels() != channels) throw std::invalid_argument("causal_conv_silu_cached: column blocks do not match");
  const int64_t hist = width - 1;
  // Per (row, block of kCols channels), the tokens in order; per (token, channel) the taps in order j = 0..width-1,
  // as the full-sequence kernel sums them, so a sequence fed in pieces gives its values (a window zero at sequence
  // start adds +0 where that kernel skips the tap). The channels are the fast index of x, the window and y, so each
  // tap is a contiguous run of kCols inputs.
  constexpr int64_t kCols = 64;
  const int64_t nblk = (channels + kCols - 1) / kCols;
#pragma omp parallel for collapse(2) schedule(static) if (batch * seq * channels * width >= kParallelMinWork)
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const int64_t c0 = blk * kCols, nc = std::min(kCols, channels - c0);
      T* win = window + int64_t{slots[b]} * hist * channels + c0;  // row i: the inputs at time i - hist
      const T* xb = x + b * seq * channels + c0;
      auto input_row = [&](int64_t u) -> const T* { return u >= 0 ? xb + u * channels : win + (hist + u) * channels; };
      float taps[kMaxConvWidth][kCols];
      for (int64_t j = 0; j < width; ++j)
        for (int64_t c = 0; c < nc; ++c) taps[j][c] = w[(c0 + c) * width + j];
      for (int64_t t = 0; t < seq; ++t) {
        float pre[kCols] = {};
        for (int64_t j = 0; j < width; ++j) {
          const T* in = input_row(t - hist + j);
#pragma omp simd
          for (int64_t c = 0; c < nc; ++c) pre[c] += taps[j][c] * to_f32(in[c]);
        }
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) pre[c] = silu_vec(pre[c]);
        y.for_each_run(b * seq + t, c0, nc, [&](T* d, int64_t off, int64_t n) {
          for (int64_t c = 0; c < n; ++c) d[c] = from_f32<T>(pre[off + c]);
        });
      }
      // The new window: the last `hist` inputs of (window ++ x), oldest first; ascending i reads only rows that are
      // still to be overwritten later (source row >= i).
      for (int64_t i = 0; i < hist; ++i) {
        const T* src = input_row(seq - hist + i);
        if (src != win + i * channels) std::copy_n(src, nc, win + i * channels);
      }
    }
}

namespace {
// One (batch row, value head) of delta_rule_step.
template <typename T>
inline void delta_head(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta, const float* g,
                       T* o, float* state, const int32_t* slots, int64_t b, int64_t h) {
  const int64_t dk = s.dk, dv = s.dv, r = s.ratio();
  float* S = state + (int64_t{slots[b]} * s.v_heads + h) * dk * dv;
  const T* qt = q + (b * s.k_heads + h / r) * dk;
  const T* kt = k + (b * s.k_heads + h / r) * dk;
  const T* vt = v + (b * s.v_heads + h) * dv;
  const float decay = std::exp(std::min(g[b * s.v_heads + h], 0.0f)), bt = beta[b * s.v_heads + h];
  float kv[512], delta[512], out[512];  // dv <= 512 (checked by the callers)
  std::fill_n(kv, dv, 0.0f);
  // S <- exp(g) S and kv = S^T k in one pass over the rows of S.
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    const float ki = to_f32(kt[i]);
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= decay;
      kv[j] += row[j] * ki;
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < dv; ++j) {
    delta[j] = bt * (to_f32(vt[j]) - kv[j]);
    out[j] = 0.0f;
  }
  // S <- S + k delta^T and o = S^T q in a second pass.
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    const float ki = to_f32(kt[i]), qi = to_f32(qt[i]);
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * delta[j];
      out[j] += row[j] * qi;
    }
  }
  T* ot = o + (b * s.v_heads + h) * dv;
  for (int64_t j = 0; j < dv; ++j) ot[j] = from_f32<T>(out[j]);
}

void check_step(const DeltaRuleShape& s) {
  if (s.seq != 1) throw std::invalid_argument("delta_rule_step: one token per row (seq must be 1)");
  if (s.k_heads <= 0 || s.v_heads % s.k_heads != 0) throw std::invalid_argument("delta_rule_step: bad head counts");
  if (s.dv > 512) throw std::invalid_argument("delta_rule_step: value head dim above 512");
}
}  // namespace

template <typename T>
void delta_rule_step(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta, const float* g,
                     T* o, float* state, const int32_t* slots) {
  check_step(s);
#pragma omp parallel for collapse(2) schedule(static) if (s.batch * s.v_heads * s.dk * s.dv >= 4 * kParallelMinWork)
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.v_heads; ++h) delta_head(s, q, k, v, beta, g, o, state, slots, b, h);
}

template <typename T>
void delta_rule_step_range(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta,
                           const float* g, T* o, float* state, const int32_t* slots, int64_t u0, int64_t u1) {
  check_step(s);
  for (int64_t u = u0; u < u1; ++u) delta_head(s, q, k, v, beta, g, o, state, slots, u / s.v_heads, u % s.v_heads);
}

template <typename T>
void kv_cache_write(const KvCacheShape& c, const T* k, const T* v, T* kcache, T* vcache, const int32_t* slots,
                    const int32_t* positions, int64_t batch, int64_t seq) {
  const int64_t hd = c.head_dim;
  for (int64_t n = 0; n < batch * seq; ++n)
    if (positions[n] < 0 || positions[n] >= c.capacity)
      throw std::out_of_range("kv cache: position " + std::to_string(positions[n]) + " is outside the capacity " +
                              std::to_string(c.capacity));
#pragma omp parallel for schedule(static) if (batch * seq * c.kv_heads * hd >= kParallelMinWork)
  for (int64_t n = 0; n < batch * seq; ++n) {
    const int64_t base = int64_t{slots[n / seq]} * c.slot_stride() + int64_t{positions[n]} * hd;
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      std::copy_n(k + (n * c.kv_heads + h) * hd, hd, kcache + base + h * c.capacity * hd);
      std::copy_n(v + (n * c.kv_heads + h) * hd, hd, vcache + base + h * c.capacity * hd);
    }
  }
}

namespace {
#define HS_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
using simd::load16;

// The scores, their weights e^(s - max) (their sum in `sum`, position order) and the weighted sum of V of one head on
// AVX-512 (hd % 64 == 0): each score one 16-lane dot, reduced as a tree (the portable loop's `omp simd` reduction
// ended in 16 dependent scalar adds from the stack, a position at a time), and the weighted sum of V 64 columns at a
// time in registers (each column summed in position order, as the portable loop does).
template <typename T>
HS_AVX512_TARGET void scores_and_values_avx512(const float* qf, const T* K, const T* V, int64_t len, int64_t hd,
                                               float scale, float* sc, float* acc, float& mx, float& sum) {
  for (int64_t p = 0; p < len; ++p) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), load16(K + p * hd + d), a);
    sc[p] = _mm512_reduce_add_ps(a) * scale;
    mx = std::max(mx, sc[p]);
  }
#pragma omp simd
  for (int64_t p = 0; p < len; ++p) sc[p] = exp_vec(sc[p] - mx);
  for (int64_t p = 0; p < len; ++p) sum += sc[p];
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t p = 0; p < len; ++p) {
      const __m512 e = _mm512_set1_ps(sc[p]);
      const T* v = V + p * hd + d0;
      a0 = _mm512_fmadd_ps(e, load16(v), a0);
      a1 = _mm512_fmadd_ps(e, load16(v + 16), a1);
      a2 = _mm512_fmadd_ps(e, load16(v + 32), a2);
      a3 = _mm512_fmadd_ps(e, load16(v + 48), a3);
    }
    _mm512_storeu_ps(acc + d0, a0);
    _mm512_storeu_ps(acc + d0 + 16, a1);
    _mm512_storeu_ps(acc + d0 + 32, a2);
    _mm512_storeu_ps(acc + d0 + 48, a3);
  }
}
#undef HS_AVX512_TARGET

// One (row, query head) of attention_cached_forward; sc: `capacity` floats of scratch.
template <typename T>
inline void attention_head(const KvCacheShape& c, int64_t q_heads, const T* q, const T* gate, const T* kcache,
                           const T* vcache, T* out, const int32_t* slots, const int32_t* positions, int64_t seq,
                           int64_t n, int64_t h, float* sc) {
  const int64_t hd = c.head_dim, group = q_heads / c.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t len = int64_t{positions[n]} + 1;
  const int64_t base = int64_t{slots[n / seq]} * c.slot_stride() + (h / group) * c.capacity * hd;
  const T* K = kcache + base;
  const T* V = vcache + base;
  float qf[1024], acc[1024];
  for (int64_t d = 0; d < hd; ++d) qf[d] = to_f32(q[(n * q_heads + h) * hd + d]);
  float mx = -INFINITY, sum = 0.0f;
  if (cpu::allows(cpu::Level::Avx512) && hd % 64 == 0) {
    scores_and_values_avx512(qf, K, V, len, hd, scale, sc, acc, mx, sum);
  } else
  {
    for (int64_t p = 0; p < len; ++p) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < hd; ++d) dot += qf[d] * to_f32(K[p * hd + d]);
      sc[p] = dot * scale;
      mx = std::max(mx, sc[p]);
    }
    // The weights e^(s - max) in one vectorisable pass (exp_vec: 0.9 ulp; a libm call per position was ~10 ns),
    // summed in position order. (The vectorised body and its remainder may contract exp_vec's arithmetic
    // differently, so a weight's last bit can depend on its position modulo the vector width: deterministic.)
#pragma omp simd
    for (int64_t p = 0; p < len; ++p) sc[p] = exp_vec(sc[p] - mx);
    std::fill_n(acc, hd, 0.0f);
    for (int64_t p = 0; p < len; ++p) {
      const float e = sc[p];
      sum += e;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) acc[d] = std::fma(e, to_f32(V[p * hd + d]), acc[d]);
    }
  }
  const float inv = 1.0f / sum;
  const T* gt = gate + (n * q_heads + h) * hd;
  T* ot = out + (n * q_heads + h) * hd;
#pragma omp simd
  for (int64_t d = 0; d < hd; ++d) ot[d] = from_f32<T>(acc[d] * inv * sigmoid_vec(to_f32(gt[d])));  // as the full forward
}

void check_attention(const KvCacheShape& c, int64_t q_heads) {
  if (c.kv_heads <= 0 || q_heads % c.kv_heads != 0) throw std::invalid_argument("attention_cached: bad head counts");
  if (c.head_dim > 1024) throw std::invalid_argument("attention_cached: head_dim above 1024");
}
}  // namespace

template <typename T>
void attention_cached_forward(const KvCacheShape& c, int64_t q_heads, const T* q, const T* gate, const T* kcache,
                              const T* vcache, T* out, const int32_t* slots, const int32_t* positions, int64_t batch,
                              int64_t seq, MemoryAccountant& mem) {
  const int64_t hd = c.head_dim, rows = batch * seq;
  check_attention(c, q_heads);
  const int threads = omp_get_max_threads();
  Buffer ws = mem.allocate_n<float>(static_cast<size_t>(threads * c.capacity), MemCategory::Workspace,
                                    "attention_cached.scores");
  if (rows == 0) return;
  compute(mem, [&] {
    int64_t cached = 0;  // positions read, over all rows
    for (int64_t n = 0; n < rows; ++n) cached += int64_t{positions[n]} + 1;
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(threads) if (cached * q_heads * hd >= kParallelMinWork)
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t h = 0; h < q_heads; ++h)
        attention_head(c, q_heads, q, gate, kcache, vcache, out, slots, positions, seq, n, h,
                       ws.as<float>() + omp_get_thread_num() * c.capacity);
  });
}

template <typename T>
void attention_cached_range(const KvCacheShape& c, int64_t q_heads, const T* q, const T* gate, const T* kcache,
                            const T* vcache, T* out, const int32_t* slots, const int32_t* positions, int64_t seq,
                            int64_t u0, int64_t u1, float* scores) {
  check_attention(c, q_heads);
  for (int64_t u = u0; u < u1; ++u)
    attention_head(c, q_heads, q, gate, kcache, vcache, out, slots, positions, seq, u / q_heads, u % q_heads, scores);
}

#define HS_INSTANTIATE(T)                                                                                         \
  template void causal_conv_silu_cached<T>(const T*, const float*, const ColumnBlocks<T>&, T*, const int32_t*,   \
                                           int64_t, int64_t, int64_t, int64_t);                                  \
  template void delta_rule_step<T>(const DeltaRuleShape&, const T*, const T*, const T*, const float*,             \
                                   const float*, T*, float*, const int32_t*);                                    \
  template void delta_rule_step_range<T>(const DeltaRuleShape&, const T*, const T*, const T*, const float*,       \
                                         const float*, T*, float*, const int32_t*, int64_t, int64_t);             \
  template void attention_cached_range<T>(const KvCacheShape&, int64_t, const T*, const T*, const T*, const T*,   \
                                          T*, const int32_t*, const int32_t*, int64_t, int64_t, int64_t, float*); \
  template void kv_cache_write<T>(const KvCacheShape&, const T*, const T*, T*, T*, const int32_t*, const int32_t*, \
                                  int64_t, int64_t);                                                             \
  template void attention_cached_forward<T>(const KvCacheShape&, int64_t, const T*, const T*, const T*, const T*, \
                                            T*, const int32_t*, const int32_t*, int64_t, int64_t, MemoryAccountant&);
HS_INSTANTIATE(float)
HS_INSTANTIATE(bf16)
#undef HS_INSTANTIATE

}  // namespace hs::kernels
