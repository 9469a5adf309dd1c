#include "kernels/conv.h"

#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/profile.h"
#include "kernels/cpu.h"
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

}  // namespace

// The bodies for AVX2 (the build's baseline) and for AVX-512: the SiLU loops are compute bound, and 512-bit vectors
// (with masks) halve their instructions. The same arithmetic in the same order per channel either way.
namespace conv_avx2 {
#include "kernels/conv_paths.inc"
}  // namespace conv_avx2
HS_BEGIN_AVX512_PATHS
namespace conv_avx512 {
#include "kernels/conv_paths.inc"
}  // namespace conv_avx512
HS_END_ISA_PATHS

namespace {

// f(Paths{}) with the bodies of the widest set this CPU runs under HS_MAX_ISA.
template <typename F> void with_paths(F&& f) {
  if (cpu::allows(cpu::Level::Avx512)) f(conv_avx512::Paths{});
  else f(conv_avx2::Paths{});
}

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
                              int64_t channels, int64_t width, const int32_t* positions) {
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
        with_paths([&](auto paths) {
        with_width(width, [&](auto wc) {
          constexpr int W = decltype(wc)::value;
          using Body = typename decltype(paths)::template Body<W, T, T>;
          for (int64_t t = t0; t < t1; ++t) {
            if (t + kPrefetchAhead < seq) {
              prefetch_span(xb + (t + kPrefetchAhead) * channels + c0, nc * int64_t{sizeof(T)}, false);
              y.for_each_run(b * seq + t + kPrefetchAhead, c0, nc, [](T* d, int64_t, int64_t n) {
                prefetch_span(d, n * int64_t{sizeof(T)}, true);
              });
            }
            // Taps before the document's first token (or the sequence's) read zeros: they are skipped.
            const int64_t in_doc = t - document_start(positions, b * seq + t, t);
            const int first = static_cast<int>(std::max<int64_t>(0, W - 1 - in_doc));
            y.for_each_run(b * seq + t, c0, nc, [&](T* yt, int64_t off, int64_t n) {
              const T* xs[W];
              for (int j = 0; j < W; ++j) xs[j] = j < first ? nullptr : xb + (t - W + 1 + j) * channels + c0 + off;
              Body::forward(xs, first, wt, off, n, yt);
            });
          }
        });
        });
      }
}

template <typename T>
void causal_conv_silu_forward(const T* x, const float* w, T* y, int64_t batch, int64_t seq, int64_t channels,
                              int64_t width, const int32_t* positions) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "causal_conv_silu_forward");
  causal_conv_silu_forward(x, w, ColumnBlocks<T>(y, channels), batch, seq, channels, width, positions);
}

// Per channel block, time runs backwards so that dx[t] = sum_j w[j] * dpre[t + width-1 - j] is complete
// when t is reached: the last width-1 values of dpre wait in a ring indexed by t mod width (slots of
// steps past the end stay zero). The block owns its channels for all (b, t), so dw needs no reduction
// across threads.
template <typename T, typename D>
void causal_conv_silu_backward(const T* x, const float* w, const ColumnBlocks<const float>& dy, D* dx, float* dw,
                               int64_t batch, int64_t seq, int64_t channels, int64_t width, bool accumulate_dx,
                               const int32_t* positions) {
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
    with_paths([&](auto paths) {
    with_width(width, [&](auto wc) {
      constexpr int W = decltype(wc)::value;
      using Body = typename decltype(paths)::template Body<W, T, D>;
      for (int64_t b = 0; b < batch; ++b) {
        const T* xb = x + b * seq * channels;
        for (int j = 0; j < W; ++j) std::fill(ring[j], ring[j] + nc, 0.0f);
        for (int64_t t = seq - 1; t >= 0; --t) {
          if (const int64_t ta = t - kPrefetchAhead; ta >= 0) {
            if (ta - W + 1 >= 0) prefetch_span(xb + (ta - W + 1) * channels + c0, nc * int64_t{sizeof(T)}, false);
            dy.for_each_run(b * seq + ta, c0, nc, [](const float* d, int64_t, int64_t n) { prefetch_span(d, n * 4, false); });
            prefetch_span(dx + (b * seq + ta) * channels + c0, nc * int64_t{sizeof(D)}, true);
          }
          const int64_t in_doc = t - document_start(positions, b * seq + t, t);
          const int first = static_cast<int>(std::max<int64_t>(0, W - 1 - in_doc));
          const float* later[W];  // later[j]: the gradient of step t + W-1-j (j < W-1), slots past the end zero
          for (int j = 0; j < W - 1; ++j) later[j] = ring[(t + W - 1 - j) % W];
          float* dpre = ring[t % W];
          D* dxt = dx + (b * seq + t) * channels + c0;
          dy.for_each_run(b * seq + t, c0, nc, [&](const float* d, int64_t off, int64_t n) {
            const T* xs[W];
            for (int j = 0; j < W; ++j) xs[j] = j < first ? nullptr : xb + (t - W + 1 + j) * channels + c0 + off;
            Body::backward(xs, first, wt, later, dpre, dwacc, d, off, n, dxt + off, accumulate_dx);
          });
          // A document starts here: the steps from t on never reach the tokens before it.
          if (in_doc == 0 && positions)
            for (int j = 0; j < W; ++j) std::fill(ring[j], ring[j] + nc, 0.0f);
        }
      }
    });
    });
    for (int64_t c = 0; c < nc; ++c)
      for (int64_t j = 0; j < width; ++j) dw[(c0 + c) * width + j] += dwacc[j][c];
  }
}

template <typename T>
void causal_conv_silu_backward(const T* x, const float* w, const float* dy, float* dx, float* dw, int64_t batch,
                               int64_t seq, int64_t channels, int64_t width, bool accumulate_dx,
                               const int32_t* positions) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "causal_conv_silu_backward");
  causal_conv_silu_backward(x, w, ColumnBlocks<const float>(dy, channels), dx, dw, batch, seq, channels, width,
                            accumulate_dx, positions);
}

#define HS_CONV(T)                                                                                                   \
  template void causal_conv_silu_forward<T>(const T*, const float*, T*, int64_t, int64_t, int64_t, int64_t,          \
                                            const int32_t*);                                                         \
  template void causal_conv_silu_forward<T>(const T*, const float*, const ColumnBlocks<T>&, int64_t, int64_t,       \
                                            int64_t, int64_t, const int32_t*);                                       \
  template void causal_conv_silu_backward<T>(const T*, const float*, const float*, float*, float*, int64_t, int64_t, \
                                             int64_t, int64_t, bool, const int32_t*);                                \
  template void causal_conv_silu_backward<T, float>(const T*, const float*, const ColumnBlocks<const float>&,        \
                                                    float*, float*, int64_t, int64_t, int64_t, int64_t, bool,        \
                                                    const int32_t*);
HS_CONV(float)
HS_CONV(bf16)
#undef HS_CONV
template void causal_conv_silu_backward<bf16, bf16>(const bf16*, const float*, const ColumnBlocks<const float>&, bf16*,
                                                    float*, int64_t, int64_t, int64_t, int64_t, bool, const int32_t*);

}  // namespace hs::kernels
