// Forward + backward throughput of the chunked gated delta rule at the shapes of our models:
// `small` (Hk 2, Hv 4, dk = dv = 64) and the released Qwen3-Next / Qwen3.5 GDN layers (Hk 16, Hv 32, 128).
// Prints tokens/s (B*T per forward+backward, and per forward alone) and GFLOP/s by the throughput report's analytic
// count (bench/throughput_report.py: per token and value head 2 C (3 dk + 2 dv) + 6 dk dv forward, 3x that forward +
// backward); bench/delta_rule_compare.sh sets the forward+backward ratio against PyTorch. The *Bf16Products variants
// run the same bf16-storage kernels with DeltaRuleProducts::Bf16 (skipped without AVX-512-BF16).
// The machine's own ceilings for these products, on every thread at once (OpenMP), operands in L1:
//   BM_PeakFma / BM_PeakDpbf16: register-resident chains of vfmadd231ps / vdpbf16ps (zmm), 16 independent accumulators;
//   BM_Product/<fp32|bf16>/M/N/K: the kernels' own register-blocked product (detail::delta_rule_product, bf16 packing
//   included) at the chunk's shapes.
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <vector>

#include <omp.h>

#include "kernels/cpu.h"
#include "kernels/delta_rule.h"
#include "kernels/simd.h"

namespace {

using namespace hs;
using namespace hs::kernels;

// Inputs shaped like the layer's: q, k unit rows (q scaled by dk^-0.5), beta in (0, 1), g = logsigmoid.
template <typename T>
struct BenchData {
  DeltaRuleShape s;
  std::vector<T> q, k, v, o;
  std::vector<float> beta, g, d_o, dq, dk, dv, dbeta, dg;

  explicit BenchData(const DeltaRuleShape& shape) : s(shape) {
    std::mt19937 rng(0);
    std::normal_distribution<float> nd;
    auto unit_rows = [&](int64_t rows, int64_t d, float scale) {
      std::vector<T> x(rows * d);
      std::vector<float> row(d);
      for (int64_t r = 0; r < rows; ++r) {
        float ss = 0;
        for (auto& e : row) {
          e = nd(rng);
          ss += e * e;
        }
        for (int64_t j = 0; j < d; ++j) x[r * d + j] = from_f32<T>(row[j] * scale / std::sqrt(ss + 1e-6f));
      }
      return x;
    };
    const int64_t nqk = s.batch * s.seq * s.k_heads, nv = s.batch * s.seq * s.v_heads;
    q = unit_rows(nqk, s.dk, 1.0f / std::sqrt(float(s.dk)));
    k = unit_rows(nqk, s.dk, 1.0f);
    v.resize(nv * s.dv);
    o.resize(nv * s.dv);
    for (auto& x : v) x = from_f32<T>(nd(rng));
    d_o.resize(nv * s.dv);
    for (auto& x : d_o) x = nd(rng);
    beta.resize(nv);
    g.resize(nv);
    for (auto& x : beta) x = 1.0f / (1.0f + std::exp(-nd(rng)));
    for (auto& x : g) x = -std::log1p(std::exp(-nd(rng)));  // logsigmoid
    dq.resize(nqk * s.dk);
    dk.resize(nqk * s.dk);
    dv.resize(nv * s.dv);
    dbeta.resize(nv);
    dg.resize(nv);
  }
};

DeltaRuleShape shape_of(const benchmark::State& state) {
  return {state.range(0), state.range(1), state.range(2), state.range(3), state.range(4), state.range(4)};
}

// The analytic FLOPs of one forward (throughput_report.py's count).
double forward_flops(const DeltaRuleShape& s) {
  const double C = kDeltaRuleChunk;
  return double(s.batch * s.seq * s.v_heads) * (2 * C * (3 * s.dk + 2 * s.dv) + 6.0 * s.dk * s.dv);
}

template <typename T, DeltaRuleProducts P = DeltaRuleProducts::Fp32>
void BM_DeltaRuleForwardBackward(benchmark::State& state) {
  if (P == DeltaRuleProducts::Bf16 && !delta_rule_bf16_products_available()) {
    state.SkipWithError("no AVX-512-BF16");
    return;
  }
  BenchData<T> d(shape_of(state));
  const bool keep_states = state.range(5) != 0;  // remat none: the forward keeps W, V_new and the chunk states
  MemoryAccountant mem;
  for (auto _ : state) {
    DeltaRuleSaved saved;
    delta_rule_forward(d.s, d.q.data(), d.k.data(), d.v.data(), d.beta.data(), d.g.data(), d.o.data(), &saved, mem,
                       keep_states, P);
    delta_rule_backward(d.s, d.q.data(), d.k.data(), d.v.data(), d.beta.data(), d.g.data(), saved, d.d_o.data(),
                        d.dq.data(), d.dk.data(), d.dv.data(), d.dbeta.data(), d.dg.data(), mem, false, P);
    benchmark::DoNotOptimize(d.dg.data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(double(d.s.batch * d.s.seq), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] = benchmark::Counter(3 * forward_flops(d.s) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_MiB"] = double(mem.peak_total()) / (1 << 20);
}

// Inference / prefill: the forward alone, keeping nothing.
template <typename T, DeltaRuleProducts P = DeltaRuleProducts::Fp32>
void BM_DeltaRuleForward(benchmark::State& state) {
  if (P == DeltaRuleProducts::Bf16 && !delta_rule_bf16_products_available()) {
    state.SkipWithError("no AVX-512-BF16");
    return;
  }
  BenchData<T> d(shape_of(state));
  MemoryAccountant mem;
  for (auto _ : state) {
    delta_rule_forward<T>(d.s, d.q.data(), d.k.data(), d.v.data(), d.beta.data(), d.g.data(), d.o.data(), nullptr,
                          mem, false, P);
    benchmark::DoNotOptimize(d.o.data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(double(d.s.batch * d.s.seq), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] = benchmark::Counter(forward_flops(d.s) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// ---- The machine's ceilings at these products ----

constexpr int64_t kPeakIters = 1 << 22;

#if defined(__x86_64__)
__attribute__((target("avx512f"), noinline)) float peak_fma(int64_t iters) {
  __m512 acc[16];
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(float(i));
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
// The AVX2 peak: 8 lanes a vector, the same 16 chains.
__attribute__((target("avx2,fma"), noinline)) float peak_fma_avx2(int64_t iters) {
  __m256 acc[16];
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  for (int i = 0; i < 16; ++i) acc[i] = _mm256_set1_ps(float(i));
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float l[8];
  _mm256_store_ps(l, s);
  return l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
}
__attribute__((target("avx512f,avx512bw,avx512bf16"), noinline)) float peak_dpbf16(int64_t iters) {
  __m512 acc[16];
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3a83);  // 1, ~1e-3
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(float(i));
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
#endif

// Chains of FMAs (or vdpbf16ps) on 16 accumulators per thread, all threads at once; FLOPs: 2 per multiply-add.
template <bool Bf16>
void BM_Peak(benchmark::State& state) {
#if defined(__x86_64__)
  if (Bf16 && !delta_rule_bf16_products_available()) {
    state.SkipWithError("no AVX-512-BF16");
    return;
  }
  // The widest FMA this CPU runs under HS_MAX_ISA (kernels/cpu.h).
  const bool wide = hs::kernels::cpu::allows(hs::kernels::cpu::Level::Avx512);
  int threads = 1;
  for (auto _ : state) {
#pragma omp parallel
    {
#pragma omp single
      threads = omp_get_num_threads();
      float sink = Bf16 ? peak_dpbf16(kPeakIters) : wide ? peak_fma(kPeakIters) : peak_fma_avx2(kPeakIters);
      benchmark::DoNotOptimize(sink);
    }
  }
  const double lanes = Bf16 || wide ? 16 : 8;
  const double per_iter = 16.0 * lanes * 2 * (Bf16 ? 2 : 1) * kPeakIters * threads;  // 16 vectors x lanes
  state.counters["GFLOP/s"] = benchmark::Counter(per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
#else
  state.SkipWithError("x86 only");
#endif
}

// The kernels' own product at one shape on every thread (each with its own operands), bf16 packing included.
template <DeltaRuleProducts P>
void BM_Product(benchmark::State& state) {
  if (P == DeltaRuleProducts::Bf16 && !delta_rule_bf16_products_available()) {
    state.SkipWithError("no AVX-512-BF16");
    return;
  }
  const int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  constexpr int64_t kCalls = 2000;
  int threads = 1;
  for (auto _ : state) {
#pragma omp parallel
    {
#pragma omp single
      threads = omp_get_num_threads();
      std::vector<float> A(M * K, 0.01f), B(K * N, 0.02f), Cm(M * N);
      for (int64_t i = 0; i < kCalls; ++i) detail::delta_rule_product(M, N, K, A.data(), B.data(), Cm.data(), P);
      benchmark::DoNotOptimize(Cm.data());
    }
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * M * N * K * kCalls * threads * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// Args: batch, seq, k_heads, v_heads, head dim (dk = dv), keep chunk states (forward + backward only: 1 = remat none,
// what the `small` step runs). {8, 512, 2, 4, 64} is the `small` training step, {2, 512, 16, 32, 128} the real widths'.
void model_shapes(benchmark::internal::Benchmark* b) {
  b->Args({1, 2048, 2, 4, 64, 0})->Args({8, 512, 2, 4, 64, 0})->Args({8, 512, 2, 4, 64, 1})
      ->Args({1, 1024, 16, 32, 128, 0})->Args({2, 512, 16, 32, 128, 1})
      ->Unit(benchmark::kMillisecond)->UseRealTime();
}
void forward_shapes(benchmark::internal::Benchmark* b) {
  b->Args({1, 2048, 2, 4, 64, 0})->Args({8, 512, 2, 4, 64, 0})->Args({1, 1024, 16, 32, 128, 0})
      ->Unit(benchmark::kMillisecond)->UseRealTime();
}
BENCHMARK(BM_DeltaRuleForwardBackward<float>)->Apply(model_shapes);
BENCHMARK(BM_DeltaRuleForwardBackward<bf16>)->Apply(model_shapes);
BENCHMARK(BM_DeltaRuleForwardBackward<bf16, DeltaRuleProducts::Bf16>)->Name("BM_DeltaRuleForwardBackwardBf16Products")->Apply(model_shapes);
BENCHMARK(BM_DeltaRuleForward<float>)->Apply(forward_shapes);
BENCHMARK(BM_DeltaRuleForward<bf16>)->Apply(forward_shapes);
BENCHMARK(BM_DeltaRuleForward<bf16, DeltaRuleProducts::Bf16>)->Name("BM_DeltaRuleForwardBf16Products")->Apply(forward_shapes);
BENCHMARK(BM_Peak<false>)->Name("BM_PeakFma")->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Peak<true>)->Name("BM_PeakDpbf16")->UseRealTime()->Unit(benchmark::kMillisecond);
void product_shapes(benchmark::internal::Benchmark* b) {
  b->Args({64, 64, 64})->Args({64, 128, 64})->Args({64, 64, 128})->Args({128, 128, 64})->Args({64, 128, 128})
      ->UseRealTime()->Unit(benchmark::kMillisecond);
}
BENCHMARK(BM_Product<DeltaRuleProducts::Fp32>)->Name("BM_Product/fp32")->Apply(product_shapes);
BENCHMARK(BM_Product<DeltaRuleProducts::Bf16>)->Name("BM_Product/bf16")->Apply(product_shapes);

}  // namespace

BENCHMARK_MAIN();
