// Matrix-product throughput through oneDNN at the model's shapes, fp32 and bf16 (AMX where the CPU has it), with
// the bf16/fp32 ratio measured in the same run. Counters: GFLOP/s; the ratio is printed at the end.
//   build/bench/matmul_bench [--benchmark_filter=...]
// With --packed instead: plain row-major weights against weights packed once into oneDNN's layout
// (kernels::PackedWeight) at the `small` (8 x 512 tokens) and real (2 x 512 tokens) layer widths, for the forward
// x W^T and the backward data product dy W, bf16 and fp32, in alternating rounds (medians), with the pack's own cost
// (allocation + reorder) and the break-even count of products per pack. (The weight gradient dW = dy^T x reads no
// weight: packing does not apply to it.)
//   build/bench/matmul_bench --packed [--rounds R] [--only SUBSTRING]
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstring>
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

// ---- Plain against packed weights ------------------------------------------------------------------------
// A linear layer's weight W [out, in] at M tokens.
struct WeightShape {
  const char* name;
  int64_t M, out, in;
};
// small: H 256, GDN 2k/4v heads of 64 (conv_dim 512), attention 4q/1kv x 64, experts and shared expert of 256,
// 8 experts top-2 (1024 rows per expert on average); M = 8 x 512. real: H 2048, GDN 16k/32v x 128 (conv_dim 8192,
// value_dim 4096), attention 16q/2kv x 256, experts and shared expert of 512, 8 experts top-2 (256 rows per
// expert); M = 2 x 512. The routed experts take their row count at execution in training (no packing there); they
// are listed at their mean row count to show what a fixed-count product would gain.
const WeightShape kWeightShapes[] = {
    {"small.gdn.in_proj_qkv", 4096, 512, 256},   {"small.gdn.out_proj", 4096, 256, 256},
    {"small.attn.q_proj", 4096, 512, 256},       {"small.attn.k_proj", 4096, 64, 256},
    {"small.shared.gate", 4096, 256, 256},       {"small.expert.gate_up", 1024, 512, 256},
    {"small.expert.down", 1024, 256, 256},       {"real.gdn.in_proj_qkv", 1024, 8192, 2048},
    {"real.gdn.in_proj_z", 1024, 4096, 2048},    {"real.gdn.out_proj", 1024, 2048, 4096},
    {"real.attn.q_proj", 1024, 8192, 2048},      {"real.attn.k_proj", 1024, 512, 2048},
    {"real.attn.o_proj", 1024, 2048, 4096},      {"real.shared.gate", 1024, 512, 2048},
    {"real.shared.down", 1024, 2048, 512},
    {"real.expert.gate_up", 256, 1024, 2048},    {"real.expert.down", 256, 2048, 512},
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
// Seconds per call of f, over at least `budget` seconds.
template <typename F> double per_call(F&& f, double budget) {
  const auto t0 = std::chrono::steady_clock::now();
  int64_t n = 0;
  do {
    f();
    ++n;
  } while (seconds_since(t0) < budget);
  return seconds_since(t0) / static_cast<double>(n);
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename T> void packed_row(const WeightShape& s, int rounds) {
  using hs::kernels::WeightUse;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<T> x(size_t(s.M * s.in)), W(size_t(s.out * s.in)), dy(size_t(s.M * s.out));
  for (auto& v : x) v = T(nd(rng));
  for (auto& v : W) v = T(nd(rng));
  for (auto& v : dy) v = T(nd(rng));
  std::vector<float> y(size_t(s.M * s.out)), dx(size_t(s.M * s.in));
  const hs::DType dt = hs::dtype_of<T>();
  const char* dname = dt == hs::DType::F32 ? "fp32" : "bf16";
  const double flops = 2.0 * double(s.M) * double(s.out) * double(s.in);
  for (WeightUse use : {WeightUse::Forward, WeightUse::BackwardData}) {
    const bool fwd = use == WeightUse::Forward;
    auto product = [&] {
      if (fwd) hs::kernels::matmul(x.data(), W.data(), y.data(), s.M, s.out, s.in, false, true);
      else hs::kernels::matmul(dy.data(), W.data(), dx.data(), s.M, s.in, s.out, false, false);
    };
    hs::MemoryAccountant mem(false);
    const size_t bytes = hs::kernels::packed_weight_bytes(dt, s.out, s.in, use);
    std::printf("  %-22s %-4s %-8s M%-5lld %5lldx%-5lld", s.name, dname, fwd ? "x W^T" : "dy W",
                static_cast<long long>(s.M), static_cast<long long>(s.out), static_cast<long long>(s.in));
    if (bytes == 0) {
      product();
      std::printf("  plain %7.1f GFLOP/s  (packing does not apply)\n", flops * 1e-9 / per_call(product, 0.2));
      continue;
    }
    std::vector<double> plain, packed, pack;
    hs::kernels::PackedWeight pw(W.data(), dt, s.out, s.in, use, mem, hs::MemCategory::WeightCasts, "bench");
    pw.pack();
    product();  // the packed primitive made
    pw = hs::kernels::PackedWeight();
    product();  // the plain one
    for (int r = 0; r < rounds; ++r) {
      // Packed: a registered copy is read. Plain: none registered.
      pw = hs::kernels::PackedWeight(W.data(), dt, s.out, s.in, use, mem, hs::MemCategory::WeightCasts, "bench");
      pw.pack();
      packed.push_back(per_call(product, 0.15));
      pack.push_back(per_call(
          [&] {
            hs::kernels::PackedWeight fresh(W.data(), dt, s.out, s.in, use, mem, hs::MemCategory::WeightCasts, "bench");
            fresh.pack();
          },
          0.1));
      pw = hs::kernels::PackedWeight();
      plain.push_back(per_call(product, 0.15));
    }
    const double tp = median(plain), tk = median(packed), tr = median(pack);
    const double saved = tp - tk;
    std::printf("  plain %7.1f  packed %7.1f GFLOP/s  x%.2f  pack %8.1f us (%5.1f%% of a plain product)", flops * 1e-9 / tp,
                flops * 1e-9 / tk, tp / tk, tr * 1e6, 100.0 * tr / tp);
    if (saved > 0) std::printf("  break-even %.1f products\n", tr / saved);
    else std::printf("  never pays\n");
  }
}

int run_packed(int argc, char** argv) {
  int rounds = 5;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (std::strcmp(argv[i], "--packed")) {
      std::fprintf(stderr, "matmul_bench --packed: unknown argument '%s'\n", argv[i]);
      return 2;
    }
  }
  std::printf("plain vs packed weights, medians of %d alternating rounds (GFLOP/s; pack = allocation + reorder)\n",
              rounds);
  for (const WeightShape& s : kWeightShapes) {
    if (!only.empty() && std::string(s.name).find(only) == std::string::npos) continue;
    packed_row<hs::bf16>(s, rounds);
    packed_row<float>(s, rounds);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--packed")) return run_packed(argc, argv);
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
