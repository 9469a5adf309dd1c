// The small kernels at model-sized shapes. Each is memory-bound, so each reports `vs_copy`: its time
// over the time of a memcpy moving the same number of bytes (read + write), measured in the same run.
// ~1 is the bandwidth roofline; larger means compute (exp, conversions) or access pattern dominates.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/conv.h"
#include "kernels/embedding.h"
#include "kernels/gdn_gates.h"
#include "kernels/norms.h"

namespace hs::kernels {
namespace {

template <typename T> std::vector<T> random_vec(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<T> v(n);
  for (auto& x : v) x = from_f32<T>(nd(rng));
  return v;
}

double seconds_of(auto f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A copy moving `bytes` in total (half read, half written), split over the OpenMP threads like the
// kernels.
struct Copy {
  explicit Copy(size_t bytes) : src(bytes / 2, 1), dst(bytes / 2) {}
  void operator()() {
    const int64_t half = static_cast<int64_t>(src.size()), chunk = 1 << 20, nchunks = (half + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c)
      std::memcpy(dst.data() + c * chunk, src.data() + c * chunk, std::min(chunk, half - c * chunk));
  }
  std::vector<char> src, dst;
};

// Reports the kernel's time per iteration; `vs_copy` compares the fastest kernel run with the fastest
// copy run, interleaved with it, which the load of a shared machine disturbs least.
template <typename F> void run(benchmark::State& state, size_t bytes, F f) {
  Copy copy(bytes);
  double best = 1e30, best_copy = 1e30;
  for (auto _ : state) {
    const double t = seconds_of(f);
    state.SetIterationTime(t);
    best = std::min(best, t);
    best_copy = std::min(best_copy, seconds_of(copy));
  }
  state.counters["vs_copy"] = best / best_copy;
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
}

constexpr int64_t kTokens = 4096, kHidden = 2048, kHeads = 32, kDv = 128, kConvDim = 8192, kWidth = 4;

void BM_RmsNormForwardBf16(benchmark::State& state) {
  const auto x = random_vec<bf16>(kTokens * kHidden, 1);
  const auto w = random_vec<float>(kHidden, 2);
  std::vector<bf16> y(x.size());
  std::vector<float> rstd(kTokens);
  run(state, x.size() * 4,
      [&] { rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), kTokens, kHidden, 1e-6f); });
}

void BM_RmsNormBackwardBf16(benchmark::State& state) {
  const auto x = random_vec<bf16>(kTokens * kHidden, 1);
  const auto w = random_vec<float>(kHidden, 2), dy = random_vec<float>(x.size(), 3);
  std::vector<float> rstd(kTokens, 1.0f), dx(x.size()), dw(kHidden);
  // Pass 1 reads x, dy and updates dx; pass 2 reads x and dy again.
  run(state, x.size() * (2 + 4 + 8 + 2 + 4),
      [&] { rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), kTokens, kHidden); });
}

void BM_GatedRmsNormForwardBf16(benchmark::State& state) {
  const int64_t rows = kTokens * kHeads;
  const auto x = random_vec<bf16>(rows * kDv, 1), z = random_vec<bf16>(rows * kDv, 2);
  const auto w = random_vec<float>(kDv, 3);
  std::vector<bf16> y(x.size());
  std::vector<float> rstd(rows);
  run(state, x.size() * 6,
      [&] { gated_rmsnorm_forward(x.data(), z.data(), w.data(), y.data(), rstd.data(), rows, kDv, 1e-6f); });
}

void BM_GatedRmsNormBackwardBf16(benchmark::State& state) {
  const int64_t rows = kTokens * kHeads;
  const auto x = random_vec<bf16>(rows * kDv, 1), z = random_vec<bf16>(rows * kDv, 2);
  const auto w = random_vec<float>(kDv, 3), dy = random_vec<float>(x.size(), 4);
  std::vector<float> rstd(rows, 1.0f), dx(x.size()), dz(x.size()), dw(kDv);
  run(state, x.size() * (2 + 2 + 4 + 8 + 8 + 2 + 2 + 4), [&] {
    gated_rmsnorm_backward(x.data(), z.data(), w.data(), rstd.data(), dy.data(), dx.data(), dz.data(), dw.data(), rows,
                           kDv);
  });
}

void BM_CausalConvForwardBf16(benchmark::State& state) {
  const auto x = random_vec<bf16>(kTokens * kConvDim, 1);
  const auto w = random_vec<float>(kConvDim * kWidth, 2);
  std::vector<bf16> y(x.size());
  run(state, x.size() * 4,
      [&] { causal_conv_silu_forward(x.data(), w.data(), y.data(), 1, kTokens, kConvDim, kWidth); });
}

void BM_CausalConvBackwardBf16(benchmark::State& state) {
  const auto x = random_vec<bf16>(kTokens * kConvDim, 1);
  const auto w = random_vec<float>(kConvDim * kWidth, 2), dy = random_vec<float>(x.size(), 3);
  std::vector<float> dx(x.size()), dw(kConvDim * kWidth);
  run(state, x.size() * (2 + 4 + 8), [&] {
    causal_conv_silu_backward(x.data(), w.data(), dy.data(), dx.data(), dw.data(), 1, kTokens, kConvDim, kWidth);
  });
}

void BM_GdnGatesBackwardBf16(benchmark::State& state) {
  const int64_t n = kTokens * kHeads;
  const auto b = random_vec<bf16>(n, 1), a = random_vec<bf16>(n, 2);
  const auto A_log = random_vec<float>(kHeads, 3), dt_bias = random_vec<float>(kHeads, 4);
  const auto dbeta = random_vec<float>(n, 5), dg = random_vec<float>(n, 6);
  std::vector<float> db(n), da(n), dA(kHeads), ddt(kHeads);
  run(state, n * (2 + 2 + 4 + 4 + 8 + 8 + 2 + 4), [&] {
    gdn_gates_backward(b.data(), a.data(), A_log.data(), dt_bias.data(), dbeta.data(), dg.data(), db.data(), da.data(),
                       dA.data(), ddt.data(), kTokens, kHeads);
  });
}

void BM_EmbeddingBackward(benchmark::State& state) {
  const int64_t vocab = 32768;
  std::mt19937 rng(1);
  std::vector<int32_t> ids(kTokens);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
  const auto dout = random_vec<float>(kTokens * kHidden, 2);
  std::vector<float> dtable(vocab * kHidden);
  run(state, dout.size() * (4 + 8),
      [&] { embedding_backward(ids.data(), kTokens, dout.data(), vocab, kHidden, dtable.data()); });
}

// The cast of one MoE layer's routed experts of the `small` preset (8 x 3 x 256 x 256 fp32 -> bf16), as
// PiecedExperts casts them before the forward and again before the backward.
void BM_ConvertF32ToBf16(benchmark::State& state) {
  const int64_t n = 8 * 3 * 256 * 256;
  const auto x = random_vec<float>(n, 1);
  std::vector<bf16> y(n);
  run(state, n * (4 + 2), [&] { convert(x.data(), y.data(), static_cast<size_t>(n)); });
}

// The `small` preset's row norms: q/k norms at head_dim 64 (batch 8 x 512 tokens x 4 heads) and the hidden 256 norm.
void BM_RmsNormForwardSmallBf16(benchmark::State& state) {
  const int64_t dim = state.range(0), rows = kTokens * 1024 / dim;
  const auto x = random_vec<bf16>(rows * dim, 1);
  const auto w = random_vec<float>(dim, 2);
  std::vector<bf16> y(x.size());
  std::vector<float> rstd(rows);
  run(state, x.size() * 4, [&] { rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), rows, dim, 1e-6f); });
}
void BM_RmsNormBackwardSmallBf16(benchmark::State& state) {
  const int64_t dim = state.range(0), rows = kTokens * 1024 / dim;
  const auto x = random_vec<bf16>(rows * dim, 1);
  const auto w = random_vec<float>(dim, 2), dy = random_vec<float>(x.size(), 3);
  std::vector<float> rstd(rows, 1.0f), dx(x.size()), dw(dim);
  run(state, x.size() * (2 + 4 + 4),
      [&] { rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), rows, dim, false); });
}
void BM_L2NormBackwardSmallBf16(benchmark::State& state) {
  const int64_t dim = 64, rows = kTokens * 16;
  const auto x = random_vec<bf16>(rows * dim, 1);
  const auto dy = random_vec<float>(x.size(), 3);
  std::vector<float> rstd(rows, 1.0f), dx(x.size());
  run(state, x.size() * (2 + 4 + 4),
      [&] { l2norm_backward(x.data(), rstd.data(), dy.data(), dx.data(), rows, dim, 0.125f, false); });
}

void BM_AdamWUpdateF32(benchmark::State& state) {
  const int64_t n = 1 << 24;
  auto w = random_vec<float>(n, 1);
  const auto g = random_vec<float>(n, 2);
  std::vector<float> m(n), v(n);
  int64_t step = 0;
  run(state, n * (4 + 4 + 8 + 8),
      [&] { adamw_update(w.data(), g.data(), m.data(), v.data(), n, AdamWParams{}, ++step); });
}

BENCHMARK(BM_RmsNormForwardBf16)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_RmsNormBackwardBf16)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_GatedRmsNormForwardBf16)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_GatedRmsNormBackwardBf16)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_CausalConvForwardBf16)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_CausalConvBackwardBf16)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_GdnGatesBackwardBf16)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_EmbeddingBackward)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_ConvertF32ToBf16)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_RmsNormForwardSmallBf16)->Arg(64)->Arg(256)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_RmsNormBackwardSmallBf16)->Arg(64)->Arg(256)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_L2NormBackwardSmallBf16)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_AdamWUpdateF32)->Unit(benchmark::kMillisecond)->UseManualTime();

}  // namespace
}  // namespace hs::kernels

BENCHMARK_MAIN();
