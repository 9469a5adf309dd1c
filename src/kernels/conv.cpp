#include "kernels/conv.h"

#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/profile.h"
#include "kernels/vec_math.h"

namespace hs::kernels {
namespace {

// Channels per task: an equal share per thread in whole cache lines, at least 64 and at most
// kMaxChanBlock. Wide blocks read long contiguous runs of each row (much faster than 64 channels at a
// row pitch of 16 KB); the cap keeps the per-task weights, gradient window and dw sums on the stack.
// Every channel's arithmetic is the same whatever the block, so results do not depend on it.
constexpr int64_t kMaxChanBlock = 512;
int64_t channel_block(int64_t channels) {
  const int64_t share = (channels + omp_get_max_threads() - 1) / omp_get_max_threads();
  return std::clamp<int64_t>((share + 15) / 16 * 16, 64, kMaxChanBlock);
}
// Time steps per forward task (forward outputs are independent, so time is split too).
constexpr int64_t kTimeBlock = 256;

// Consecutive time steps of a channel block are a row pitch apart, too far for the hardware
// prefetchers, so the rows kPrefetchAhead steps ahead are requested by hand.
constexpr int64_t kPrefetchAhead = 8;
inline void prefetch_span(const void* p, int64_t bytes, bool for_write) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) {
    if (for_write)
      __builtin_prefetch(c + o, 1);
    else
      __builtin_prefetch(c + o, 0);
  }
}

void check_width(int64_t width) {
  if (width < 1 || width > kMaxConvWidth)
    throw std::invalid_argument("causal_conv_silu: width " + std::to_string(width) + " is outside [1, " +
                                std::to_string(kMaxConvWidth) + "]");
}

// wt[j][c] = w[c0 + c, j]: tap-major so the channel loops read contiguous weights.
void transpose_weights(const float* w, int64_t c0, int64_t nc, int64_t width, float (*wt)[kMaxChanBlock]) {
  for (int64_t j = 0; j < width; ++j)
    for (int64_t c = 0; c < nc; ++c) wt[j][c] = w[(c0 + c) * width + j];
}

// The per-time-step bodies, one pass over a run of channels each, W (the width) a compile-time constant so that the
// taps unroll and every channel's values stay in registers: the forward computes the pre-activation and the SiLU in
// one loop; the backward recomputes the pre-activation, takes the SiLU backward, completes dx from the ring of later
// gradients and adds the dw terms, reading each of the W input rows once (not once for the pre-activation and again
// for dw). `first` is the first tap at or after t = 0 (0 except for the first W-1 steps of a sequence); taps before
// it are skipped, not multiplied by zero. The arithmetic is, tap for tap, the sums of the plain loops: pre = sum_j
// wt[j] x_j from 0 in j order, dx = sum_j wt[j] ring_j from 0 in j order, so the bits do not depend on W's
// dispatch.
// The first W-1 steps of a sequence: pre[c] = sum over the taps from `first` on, tap by tap over the run (the loops
// of the plain kernel, so the same bits there too).
template <int W, typename T>
void edge_pre(const T* const* xs, int first, const float (*wt)[kMaxChanBlock], int64_t off, int64_t n, float* pre) {
  std::fill(pre, pre + n, 0.0f);
  for (int j = first; j < W; ++j) {
    const T* xj = xs[j];
    const float* wj = wt[j] + off;
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) pre[c] += wj[c] * to_f32(xj[c]);
  }
}

template <int W, typename T, typename D>
struct ConvBody {
  // y[c] = silu(sum_j wt[j][off + c] * xs[j][c]) for c < n; xs[j] is row t - W + 1 + j at this run's first channel.
  static void forward(const T* const* xs, int first, const float (*wt)[kMaxChanBlock], int64_t off, int64_t n,
                      D* y) {
    if (first == 0) {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) {
        float pre = 0.0f;
        for (int j = 0; j < W; ++j) pre += wt[j][off + c] * to_f32(xs[j][c]);
        y[c] = from_f32<D>(silu_vec(pre));
      }
    } else {
      float pre[kMaxChanBlock];
      edge_pre<W>(xs, first, wt, off, n, pre);
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) y[c] = from_f32<D>(silu_vec(pre[c]));
    }
  }
  // The SiLU backward, dx and (dw_terms) the dw terms of all W taps for channel c from its pre-activation. Always
  // inlined: a call left in the channel loop keeps it from vectorising, and the vectorised and scalar exp_vec may
  // differ in the last bit (different FMA contractions), which would break bit-identity with the plain loops.
  [[gnu::always_inline]] static inline void rest(int64_t c, float pre, bool dw_terms, const T* const* xs,
                                                 const float (*wt)[kMaxChanBlock], const float* const* ring,
                                                 float* dpre, float (*dwacc)[kMaxChanBlock], const float* dy,
                                                 int64_t off, D* dx, bool accumulate_dx) {
    const float s = sigmoid_vec(pre);
    const float d = dy[c] * (s * (1.0f + pre * (1.0f - s)));
    dpre[off + c] = d;
    float gx = 0.0f;
    for (int j = 0; j < W - 1; ++j) gx += wt[j][off + c] * ring[j][off + c];
    gx += wt[W - 1][off + c] * d;
    if constexpr (std::is_same_v<D, float>) {
      dx[c] = accumulate_dx ? dx[c] + gx : gx;
    } else {
      dx[c] = from_f32<D>(gx);
    }
    if (dw_terms)
      for (int j = 0; j < W; ++j) dwacc[j][off + c] += d * to_f32(xs[j][c]);
  }
  // ring[j] (j < W-1) is the SiLU-backward gradient of step t + W-1-j, dpre receives step t's (ring slot t mod W).
  static void backward(const T* const* xs, int first, const float (*wt)[kMaxChanBlock], const float* const* ring,
                       float* dpre, float (*dwacc)[kMaxChanBlock], const float* dy, int64_t off, int64_t n, D* dx,
                       bool accumulate_dx) {
    if (first == 0) {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) {
        float pre = 0.0f;
        for (int j = 0; j < W; ++j) pre += wt[j][off + c] * to_f32(xs[j][c]);
        rest(c, pre, true, xs, wt, ring, dpre, dwacc, dy, off, dx, accumulate_dx);
      }
    } else {
      float pre[kMaxChanBlock];
      edge_pre<W>(xs, first, wt, off, n, pre);
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) rest(c, pre[c], false, xs, wt, ring, dpre, dwacc, dy, off, dx, accumulate_dx);
      for (int j = first; j < W; ++j) {
        const T* xj = xs[j];
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) dwacc[j][off + c] += dpre[off + c] * to_f32(xj[c]);
      }
    }
  }
};

// f(std::integral_constant<int, W>) for the run-time width (1..kMaxConvWidth, checked before).
template <typename F> void with_width(int64_t width, F&& f) {
  switch (width) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    case 4: return f(std::integral_constant<int, 4>());
    case 5: return f(std::integral_constant<int, 5>());
    case 6: return f(std::integral_constant<int, 6>());
    case 7: return f(std::integral_constant<int, 7>());
    default: return f(std::integral_constant<int, 8>());
  }
}
static_assert(kMaxConvWidth == 8, "with_width dispatches widths 1..8");

void check_channels(int64_t blocks, int64_t channels) {
  if (blocks != channels)
    throw std::invalid_argument("causal_conv_silu: column blocks hold " + std::to_string(blocks) + " channels, expected " +
                                std::to_string(channels));
}

}  // namespace

template <typename T>
void causal_conv_silu_forward(const T* x, const float* w, const ColumnBlocks<T>& y, int64_t batch, int64_t seq,
                              int64_t channels, int64_t width) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "causal_conv_silu_forward");
  check_width(width);
  check_channels(y.channels(), channels);
  const int64_t block = channel_block(channels), ncb = (channels + block - 1) / block;
  const int64_t ntb = (seq + kTimeBlock - 1) / kTimeBlock;
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t cb = 0; cb < ncb; ++cb)
      for (int64_t tb = 0; tb < ntb; ++tb) {
        const int64_t c0 = cb * block, nc = std::min(block, channels - c0);
        const int64_t t0 = tb * kTimeBlock, t1 = std::min(seq, t0 + kTimeBlock);
        float wt[kMaxConvWidth][kMaxChanBlock];
        transpose_weights(w, c0, nc, width, wt);
        const T* xb = x + b * seq * channels;
        with_width(width, [&](auto wc) {
          constexpr int W = decltype(wc)::value;
          for (int64_t t = t0; t < t1; ++t) {
            if (t + kPrefetchAhead < seq) {
              prefetch_span(xb + (t + kPrefetchAhead) * channels + c0, nc * int64_t{sizeof(T)}, false);
              y.for_each_run(b * seq + t + kPrefetchAhead, c0, nc, [](T* d, int64_t, int64_t n) {
                prefetch_span(d, n * int64_t{sizeof(T)}, true);
              });
            }
            const int first = static_cast<int>(std::max<int64_t>(0, W - 1 - t));
            y.for_each_run(b * seq + t, c0, nc, [&](T* yt, int64_t off, int64_t n) {
              const T* xs[W];
              for (int j = 0; j < W; ++j) xs[j] = j < first ? nullptr : xb + (t - W + 1 + j) * channels + c0 + off;
              ConvBody<W, T, T>::forward(xs, first, wt, off, n, yt);
            });
          }
        });
      }
}

template <typename T>
void causal_conv_silu_forward(const T* x, const float* w, T* y, int64_t batch, int64_t seq, int64_t channels,
                              int64_t width) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "causal_conv_silu_forward");
  causal_conv_silu_forward(x, w, ColumnBlocks<T>(y, channels), batch, seq, channels, width);
}

// Per channel block, time runs backwards so that dx[t] = sum_j w[j] * dpre[t + width-1 - j] is complete
// when t is reached: the last width-1 values of dpre wait in a ring indexed by t mod width (slots of
// steps past the end stay zero). The block owns its channels for all (b, t), so dw needs no reduction
// across threads.
template <typename T, typename D>
void causal_conv_silu_backward(const T* x, const float* w, const ColumnBlocks<const float>& dy, D* dx, float* dw,
                               int64_t batch, int64_t seq, int64_t channels, int64_t width, bool accumulate_dx) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "causal_conv_silu_backward");
  check_width(width);
  check_channels(dy.channels(), channels);
  if (!std::is_same_v<D, float> && accumulate_dx)
    throw std::invalid_argument("causal_conv_silu_backward: a dx in the storage type is written, not accumulated");
  const int64_t block = channel_block(channels), ncb = (channels + block - 1) / block;
#pragma omp parallel for schedule(static)
  for (int64_t cb = 0; cb < ncb; ++cb) {
    const int64_t c0 = cb * block, nc = std::min(block, channels - c0);
    float wt[kMaxConvWidth][kMaxChanBlock];
    float ring[kMaxConvWidth][kMaxChanBlock];
    float dwacc[kMaxConvWidth][kMaxChanBlock] = {};
    transpose_weights(w, c0, nc, width, wt);
    with_width(width, [&](auto wc) {
      constexpr int W = decltype(wc)::value;
      for (int64_t b = 0; b < batch; ++b) {
        const T* xb = x + b * seq * channels;
        for (int j = 0; j < W; ++j) std::fill(ring[j], ring[j] + nc, 0.0f);
        for (int64_t t = seq - 1; t >= 0; --t) {
          if (const int64_t ta = t - kPrefetchAhead; ta >= 0) {
            if (ta - W + 1 >= 0) prefetch_span(xb + (ta - W + 1) * channels + c0, nc * int64_t{sizeof(T)}, false);
            dy.for_each_run(b * seq + ta, c0, nc, [](const float* d, int64_t, int64_t n) { prefetch_span(d, n * 4, false); });
            prefetch_span(dx + (b * seq + ta) * channels + c0, nc * int64_t{sizeof(D)}, true);
          }
          const int first = static_cast<int>(std::max<int64_t>(0, W - 1 - t));
          const float* later[W];  // later[j]: the gradient of step t + W-1-j (j < W-1), slots past the end zero
          for (int j = 0; j < W - 1; ++j) later[j] = ring[(t + W - 1 - j) % W];
          float* dpre = ring[t % W];
          D* dxt = dx + (b * seq + t) * channels + c0;
          dy.for_each_run(b * seq + t, c0, nc, [&](const float* d, int64_t off, int64_t n) {
            const T* xs[W];
            for (int j = 0; j < W; ++j) xs[j] = j < first ? nullptr : xb + (t - W + 1 + j) * channels + c0 + off;
            ConvBody<W, T, D>::backward(xs, first, wt, later, dpre, dwacc, d, off, n, dxt + off, accumulate_dx);
          });
        }
      }
    });
    for (int64_t c = 0; c < nc; ++c)
      for (int64_t j = 0; j < width; ++j) dw[(c0 + c) * width + j] += dwacc[j][c];
  }
}

template <typename T>
void causal_conv_silu_backward(const T* x, const float* w, const float* dy, float* dx, float* dw, int64_t batch,
                               int64_t seq, int64_t channels, int64_t width, bool accumulate_dx) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "causal_conv_silu_backward");
  causal_conv_silu_backward(x, w, ColumnBlocks<const float>(dy, channels), dx, dw, batch, seq, channels, width,
                            accumulate_dx);
}

#define HS_CONV(T)                                                                                                   \
  template void causal_conv_silu_forward<T>(const T*, const float*, T*, int64_t, int64_t, int64_t, int64_t);         \
  template void causal_conv_silu_forward<T>(const T*, const float*, const ColumnBlocks<T>&, int64_t, int64_t,       \
                                            int64_t, int64_t);                                                       \
  template void causal_conv_silu_backward<T>(const T*, const float*, const float*, float*, float*, int64_t, int64_t, \
                                             int64_t, int64_t, bool);                                                \
  template void causal_conv_silu_backward<T, float>(const T*, const float*, const ColumnBlocks<const float>&,        \
                                                    float*, float*, int64_t, int64_t, int64_t, int64_t, bool);
HS_CONV(float)
HS_CONV(bf16)
#undef HS_CONV
template void causal_conv_silu_backward<bf16, bf16>(const bf16*, const float*, const ColumnBlocks<const float>&, bf16*,
                                                    float*, int64_t, int64_t, int64_t, int64_t, bool);

}  // namespace hs::kernels
