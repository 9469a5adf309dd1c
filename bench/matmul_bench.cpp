// Matrix-product throughput through oneDNN at the model's shapes, fp32 and bf16 (AMX where the CPU has it), with
// the bf16/fp32 ratio measured in the same run. Counters: GFLOP/s; the ratio is printed at the end.
//   build/bench/matmul_bench [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <cstdio>
#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/matmul.h"

namespace {

struct Shape {
  const char* name;
  int64_t M, N, K;
};
// y = x W^T for a linear layer: M tokens, N outputs, K inputs.
const Shape kShapes[] = {
    {"small.in_proj_qkv (4096x384x256)", 4096, 384, 256},
    {"small.expert_gate_up (1024x512x256)", 1024, 512, 256},
    {"35b.q_proj (2048x8192x2048)", 2048, 8192, 2048},
    {"35b.in_proj_qkv (2048x8192x2048)", 2048, 8192, 2048},
    {"35b.expert_gate_up (256x1024x2048)", 256, 1024, 2048},
    {"35b.out_proj (2048x2048x4096)", 2048, 2048, 4096},
};

template <typename T>
void BM_Matmul(benchmark::State& st, Shape s) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<T> A(size_t(s.M * s.K)), B(size_t(s.N * s.K));
  for (auto& x : A) x = T(nd(rng));
  for (auto& x : B) x = T(nd(rng));
  std::vector<float> C(size_t(s.M * s.N));
  hs::kernels::matmul(A.data(), B.data(), C.data(), s.M, s.N, s.K, false, true);  // primitive creation
  for (auto _ : st) {
    hs::kernels::matmul(A.data(), B.data(), C.data(), s.M, s.N, s.K, false, true);
    benchmark::DoNotOptimize(C.data());
  }
  const double flops = 2.0 * double(s.M) * double(s.N) * double(s.K);
  st.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  for (const Shape& s : kShapes) {
    benchmark::RegisterBenchmark((std::string("fp32/") + s.name).c_str(), BM_Matmul<float>, s)->UseRealTime()->MinTime(0.5);
    benchmark::RegisterBenchmark((std::string("bf16/") + s.name).c_str(), BM_Matmul<hs::bf16>, s)->UseRealTime()->MinTime(0.5);
  }
  struct Collect : benchmark::ConsoleReporter {
    std::map<std::string, double> rate;
    void ReportRuns(const std::vector<Run>& runs) override {
      for (const auto& r : runs) rate[r.benchmark_name()] = r.counters.at("GFLOP/s");
      ConsoleReporter::ReportRuns(runs);
    }
  } reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  std::printf("\nbf16 / fp32 throughput ratio (same shapes, same run):\n");
  for (const Shape& s : kShapes) {
    auto f = reporter.rate.find(std::string("fp32/") + s.name + "/min_time:0.500/real_time");
    auto b = reporter.rate.find(std::string("bf16/") + s.name + "/min_time:0.500/real_time");
    if (f != reporter.rate.end() && b != reporter.rate.end())
      std::printf("  %-40s fp32 %7.1f GFLOP/s  bf16 %7.1f GFLOP/s  ratio %.2fx\n", s.name, f->second, b->second,
                  b->second / f->second);
  }
  benchmark::Shutdown();
  return 0;
}
