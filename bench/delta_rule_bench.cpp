// Forward + backward throughput of the chunked gated delta rule at the shapes of our models:
// `small` (Hk 2, Hv 4, dk = dv = 64) and the released Qwen3-Next / Qwen3.5 GDN layers (Hk 16, Hv 32, 128).
// Prints tokens/s (B*T per forward+backward, and per forward alone); bench/delta_rule_compare.sh sets the
// forward+backward ratio against PyTorch.
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/delta_rule.h"

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

template <typename T>
void BM_DeltaRuleForwardBackward(benchmark::State& state) {
  BenchData<T> d(shape_of(state));
  MemoryAccountant mem;
  for (auto _ : state) {
    DeltaRuleSaved saved;
    delta_rule_forward(d.s, d.q.data(), d.k.data(), d.v.data(), d.beta.data(), d.g.data(), d.o.data(), &saved, mem);
    delta_rule_backward(d.s, d.q.data(), d.k.data(), d.v.data(), d.beta.data(), d.g.data(), saved, d.d_o.data(),
                        d.dq.data(), d.dk.data(), d.dv.data(), d.dbeta.data(), d.dg.data(), mem);
    benchmark::DoNotOptimize(d.dg.data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(double(d.s.batch * d.s.seq), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_MiB"] = double(mem.peak_total()) / (1 << 20);
}

// Inference / prefill: the forward alone, keeping nothing.
template <typename T>
void BM_DeltaRuleForward(benchmark::State& state) {
  BenchData<T> d(shape_of(state));
  MemoryAccountant mem;
  for (auto _ : state) {
    delta_rule_forward<T>(d.s, d.q.data(), d.k.data(), d.v.data(), d.beta.data(), d.g.data(), d.o.data(), nullptr,
                          mem);
    benchmark::DoNotOptimize(d.o.data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(double(d.s.batch * d.s.seq), benchmark::Counter::kIsIterationInvariantRate);
}

// Args: batch, seq, k_heads, v_heads, head dim (dk = dv). {8, 512, 2, 4, 64} is the `small` training step.
void model_shapes(benchmark::internal::Benchmark* b) {
  b->Args({1, 2048, 2, 4, 64})->Args({8, 512, 2, 4, 64})->Args({1, 1024, 16, 32, 128})->Unit(benchmark::kMillisecond)->UseRealTime();
}
BENCHMARK(BM_DeltaRuleForwardBackward<float>)->Apply(model_shapes);
BENCHMARK(BM_DeltaRuleForwardBackward<bf16>)->Apply(model_shapes);
BENCHMARK(BM_DeltaRuleForward<float>)->Apply(model_shapes);
BENCHMARK(BM_DeltaRuleForward<bf16>)->Apply(model_shapes);

}  // namespace

BENCHMARK_MAIN();
