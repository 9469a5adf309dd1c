// Forward + backward throughput of the chunked gated delta rule at the shapes of our models:
// `small` (Hk 2, Hv 4, dk = dv = 64) and the released Qwen3-Next / Qwen3.5 GDN layers (Hk 16, Hv 32, 128).
// Prints tokens/s (B*T per forward+backward); bench/delta_rule_compare.sh sets the ratio against PyTorch.
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/delta_rule.h"

namespace {

using namespace hs;
using namespace hs::kernels;

template <typename T>
void BM_DeltaRuleForwardBackward(benchmark::State& state) {
  const DeltaRuleShape s{state.range(0), state.range(1), state.range(2), state.range(3), state.range(4),
                         state.range(4)};
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
  const auto q = unit_rows(nqk, s.dk, 1.0f / std::sqrt(float(s.dk))), k = unit_rows(nqk, s.dk, 1.0f);
  std::vector<T> v(nv * s.dv), o(nv * s.dv);
  std::vector<float> beta(nv), g(nv), d_o(nv * s.dv), dq(nqk * s.dk), dk(nqk * s.dk), dv(nv * s.dv), dbeta(nv),
      dg(nv);
  for (auto& x : v) x = from_f32<T>(nd(rng));
  for (auto& x : d_o) x = nd(rng);
  for (auto& x : beta) x = 1.0f / (1.0f + std::exp(-nd(rng)));
  for (auto& x : g) x = -std::log1p(std::exp(-nd(rng)));  // logsigmoid
  MemoryAccountant mem;
  for (auto _ : state) {
    DeltaRuleSaved saved;
    delta_rule_forward(s, q.data(), k.data(), v.data(), beta.data(), g.data(), o.data(), &saved, mem);
    delta_rule_backward(s, q.data(), k.data(), v.data(), beta.data(), g.data(), saved, d_o.data(), dq.data(),
                        dk.data(), dv.data(), dbeta.data(), dg.data(), mem);
    benchmark::DoNotOptimize(dg.data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(double(s.batch * s.seq), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_MiB"] = double(mem.peak_total()) / (1 << 20);
}

// Args: batch, seq, k_heads, v_heads, head dim (dk = dv).
#define HS_SHAPES ->Args({1, 2048, 2, 4, 64})->Args({1, 1024, 16, 32, 128})->Unit(benchmark::kMillisecond)->UseRealTime()
BENCHMARK(BM_DeltaRuleForwardBackward<float>) HS_SHAPES;
BENCHMARK(BM_DeltaRuleForwardBackward<bf16>) HS_SHAPES;
#undef HS_SHAPES

}  // namespace

BENCHMARK_MAIN();
