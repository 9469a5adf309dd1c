// Decode-step products (a few rows times a bf16 weight [out, in]): hybridscan's streaming kernel (kernels/gemv.h) on
// each instruction-set path this CPU runs, against oneDNN's matmul on the same product in the same run. Counter:
// weight GB/s (the bytes of W over the time; the products are bound by them). The gemv / oneDNN ratios are printed
// at the end. Not a test: on a shared machine only the ratios mean anything.
//   build/bench/gemv_bench [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/gemv.h"
#include "kernels/matmul.h"

namespace {

using hs::bf16;
namespace cpu = hs::kernels::cpu;
using hs::kernels::cpu::Level;

struct Shape {
  const char* name;
  int64_t M, N, K;
};
const Shape kShapes[] = {
    {"small.in_proj_qkv b1 (1x512x256)", 1, 512, 256},
    {"small.expert_gate_up b8 (8x512x256)", 8, 512, 256},
    {"35b.in_proj_qkv b1 (1x8192x2048)", 1, 8192, 2048},
    {"35b.in_proj_qkv b8 (8x8192x2048)", 8, 8192, 2048},
    {"35b.expert_down b1 (1x2048x512)", 1, 2048, 512},
    {"35b.lm_head/8 b1 (1x31040x2048)", 1, 31040, 2048},
};

struct Operands {
  std::vector<bf16> x, W;
  std::vector<float> y;
  explicit Operands(const Shape& s) : x(size_t(s.M * s.K)), W(size_t(s.N * s.K)), y(size_t(s.M * s.N)) {
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    for (auto& v : x) v = bf16(nd(rng));
    for (auto& v : W) v = bf16(nd(rng));
  }
};

void rate(benchmark::State& st, const Shape& s) {
  st.counters["GB/s"] = benchmark::Counter(double(s.N * s.K * 2) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Gemv(benchmark::State& st, Shape s, Level isa) {
  Operands o(s);
  for (auto _ : st) {
    hs::kernels::gemv(o.x.data(), o.W.data(), o.y.data(), s.M, s.N, s.K, 0, 0, isa);
    benchmark::DoNotOptimize(o.y.data());
  }
  rate(st, s);
}

void BM_OneDnn(benchmark::State& st, Shape s) {
  Operands o(s);
  hs::kernels::matmul(o.x.data(), o.W.data(), o.y.data(), s.M, s.N, s.K, false, true);  // primitive creation
  for (auto _ : st) {
    hs::kernels::matmul(o.x.data(), o.W.data(), o.y.data(), s.M, s.N, s.K, false, true);
    benchmark::DoNotOptimize(o.y.data());
  }
  rate(st, s);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  std::vector<Level> paths;
  for (Level i : {Level::Avx512Bf16, Level::Avx512, Level::Avx2, Level::Scalar})
    if (cpu::allows(i)) paths.push_back(i);
  for (const Shape& s : kShapes) {
    benchmark::RegisterBenchmark((std::string("onednn/") + s.name).c_str(), BM_OneDnn, s)->UseRealTime()->MinTime(0.3);
    for (Level i : paths)
      benchmark::RegisterBenchmark((std::string("gemv_") + hs::kernels::cpu::level_name(i) + "/" + s.name).c_str(),
                                   BM_Gemv, s, i)
          ->UseRealTime()
          ->MinTime(0.3);
  }
  struct Collect : benchmark::ConsoleReporter {
    std::map<std::string, double> rate;
    void ReportRuns(const std::vector<Run>& runs) override {
      for (const auto& r : runs) rate[r.benchmark_name()] = r.counters.at("GB/s");
      ConsoleReporter::ReportRuns(runs);
    }
  } reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  std::printf("\ngemv / oneDNN weight-bandwidth ratio (same shapes, same run):\n");
  const std::string suffix = "/min_time:0.300/real_time";
  for (const Shape& s : kShapes) {
    auto d = reporter.rate.find(std::string("onednn/") + s.name + suffix);
    if (d == reporter.rate.end()) continue;
    std::printf("  %-40s oneDNN %6.1f GB/s", s.name, d->second);
    for (Level i : paths) {
      auto g = reporter.rate.find(std::string("gemv_") + hs::kernels::cpu::level_name(i) + "/" + s.name + suffix);
      if (g != reporter.rate.end()) std::printf("  %s %.2fx", hs::kernels::cpu::level_name(i), g->second / d->second);
    }
    std::printf("\n");
  }
  benchmark::Shutdown();
  return 0;
}
