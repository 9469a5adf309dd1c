// Decode products on quantized weights (kernels/quant_gemv.h) against ggml's own CPU kernels on the same weights in
// the same run: ggml's mul_mat on its CPU backend as llama.cpp runs it, with the weights in a plain CPU buffer
// ("ggml") and in the CPU backend's repacking buffer ("ggml_repack", llama.cpp's default where it applies), through
// bench/quant_ggml_peer.cpp built against a llama.cpp by bench/quant_gemv_bench.sh. Shapes: real widths
// (bench/real_widths.json: hidden 2048) at 1 and 8 rows, Q8_0, Q4_K, Q5_K and Q6_K (Q4_K_M files mix the last three). Each side cycles through copies of the
// weights totalling >= 128 MiB (4x this L3), so every call streams its weights from DRAM as a decode step does. Counter: weight
// GB/s. Not a test: on a shared machine only the ratios mean anything; run with repetitions interleaved.
//   build/bench/quant_gemv_bench [--ggml-peer=LIB.so] [--threads=2] [--benchmark_repetitions=5
//       --benchmark_enable_random_interleaving=true]
#include <benchmark/benchmark.h>
#include <dlfcn.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/quant.h"
#include "kernels/quant_gemv.h"

namespace {

using hs::kernels::GgmlType;
namespace k = hs::kernels;

struct Shape {
  const char* name;
  int64_t N, K;
};
const Shape kShapes[] = {
    {"in_proj_qkv 8192x2048", 8192, 2048},
    {"out_proj 2048x4096", 2048, 4096},
    {"expert_gate_up 1024x2048", 1024, 2048},
    {"expert_down 2048x512", 2048, 512},
};
constexpr int64_t kRows[] = {1, 8};
constexpr GgmlType kTypes[] = {GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K};
constexpr int64_t kStreamBytes = int64_t{128} << 20;

int g_threads = 2;

// The peer library's C interface (bench/quant_ggml_peer.cpp).
struct Peer {
  void* (*make)(int, int64_t, int64_t, int64_t, int, int, const void*, const float*) = nullptr;
  int (*run)(void*) = nullptr;
  const float* (*output)(void*) = nullptr;
  const char* (*buffer_name)(void*) = nullptr;
  void (*release)(void*) = nullptr;
  bool load(const std::string& path) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      std::fprintf(stderr, "quant_gemv_bench: %s\n", dlerror());
      return false;
    }
    make = reinterpret_cast<decltype(make)>(dlsym(h, "qpeer_new"));
    run = reinterpret_cast<decltype(run)>(dlsym(h, "qpeer_run"));
    output = reinterpret_cast<decltype(output)>(dlsym(h, "qpeer_output"));
    buffer_name = reinterpret_cast<decltype(buffer_name)>(dlsym(h, "qpeer_buffer_name"));
    release = reinterpret_cast<decltype(release)>(dlsym(h, "qpeer_free"));
    return make && run && output && buffer_name && release;
  }
} g_peer;
bool g_have_peer = false;

// Weights (ggml's quantization of Gaussian rows) and activations of one case.
struct Operands {
  std::vector<uint8_t> W;
  std::vector<float> x;
  int64_t copies = 1;
  Operands(GgmlType t, const Shape& s, int64_t M) : x(static_cast<size_t>(M * s.K)) {
    static std::map<std::string, std::vector<uint8_t>> quantized;  // per type and shape: quantizing takes seconds
    std::vector<uint8_t>& q = quantized[std::string(k::ggml_type_info(t).name) + s.name];
    std::mt19937 rng(1);
    if (q.empty()) {
      std::normal_distribution<float> nd(0.f, 0.02f);
      const int64_t rb = k::ggml_row_bytes(t, s.K);
      q.resize(static_cast<size_t>(s.N * rb));
      std::vector<float> row(static_cast<size_t>(s.K));
      for (int64_t n = 0; n < s.N; ++n) {
        for (auto& v : row) v = nd(rng);
        k::quantize_row(t, row.data(), q.data() + n * rb, s.K);
      }
    }
    W = q;
    std::normal_distribution<float> xd;
    for (auto& v : x) v = xd(rng);
    copies = std::max<int64_t>(1, kStreamBytes / static_cast<int64_t>(W.size()));
  }
};

std::string case_name(const char* who, GgmlType t, const Shape& s, int64_t M) {
  return std::string(who) + "/" + k::ggml_type_info(t).name + "/" + s.name + "/m" + std::to_string(M);
}

void rate(benchmark::State& st, const Operands& o) {
  st.counters["GB/s"] = benchmark::Counter(double(o.W.size()) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Ours(benchmark::State& st, GgmlType t, Shape s, int64_t M) {
  Operands o(t, s, M);
  std::vector<std::vector<uint8_t>> copies(static_cast<size_t>(o.copies), o.W);
  std::vector<float> y(static_cast<size_t>(M * s.N));
  omp_set_num_threads(g_threads);
  size_t i = 0;
  for (auto _ : st) {
    k::quant_gemv(t, o.x.data(), copies[i].data(), y.data(), M, s.N, s.K);
    benchmark::DoNotOptimize(y.data());
    i = (i + 1) % copies.size();
  }
  rate(st, o);
}

void BM_Ggml(benchmark::State& st, GgmlType t, Shape s, int64_t M, bool repack) {
  Operands o(t, s, M);
  std::vector<void*> peers;
  for (int64_t c = 0; c < o.copies; ++c) {
    void* p = g_peer.make(static_cast<int>(t), s.N, s.K, M, g_threads, repack ? 1 : 0, o.W.data(), o.x.data());
    if (!p) {
      for (void* q : peers) g_peer.release(q);
      st.SkipWithError("the peer does not take this product");
      return;
    }
    peers.push_back(p);
  }
  size_t i = 0;
  for (auto _ : st) {
    g_peer.run(peers[i]);
    i = (i + 1) % peers.size();
  }
  rate(st, o);
  for (void* p : peers) g_peer.release(p);
}

// Both engines compute the same product: the largest difference relative to the output's RMS (they differ by the
// activations' quantization: ggml rounds the Q8_0 activations' scale to fp16, and the sums' order).
void check_agreement() {
  for (GgmlType t : kTypes)
    for (int64_t M : kRows) {
      const Shape& s = kShapes[3];
      Operands o(t, s, M);
      std::vector<float> y(static_cast<size_t>(M * s.N));
      k::quant_gemv(t, o.x.data(), o.W.data(), y.data(), M, s.N, s.K);
      for (int repack : {0, 1}) {
        void* p = g_peer.make(static_cast<int>(t), s.N, s.K, M, g_threads, repack, o.W.data(), o.x.data());
        if (!p) continue;
        g_peer.run(p);
        const float* g = g_peer.output(p);
        double rms = 0, worst = 0;
        for (size_t i = 0; i < y.size(); ++i) rms += double(g[i]) * g[i];
        rms = std::sqrt(rms / double(y.size()));
        for (size_t i = 0; i < y.size(); ++i) worst = std::max(worst, std::fabs(double(y[i]) - g[i]) / rms);
        std::printf("agreement %s m%lld %s: max |ours - ggml| / rms(ggml) = %.2e\n", k::ggml_type_info(t).name,
                    static_cast<long long>(M), g_peer.buffer_name(p), worst);
        g_peer.release(p);
      }
    }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  std::string peer_path;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--ggml-peer=", 0) == 0) peer_path = a.substr(12);
    else if (a.rfind("--threads=", 0) == 0) g_threads = std::stoi(a.substr(10));
    else rest.push_back(argv[i]);
  }
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  if (!peer_path.empty()) g_have_peer = g_peer.load(peer_path);
  std::printf("threads %d; our path %s%s\n", g_threads, hs::kernels::cpu::level_name(k::quant_gemv_level()),
              k::quant_gemv_uses_vnni() ? " + VNNI" : "");
  if (g_have_peer) check_agreement();
  for (GgmlType t : kTypes)
    for (const Shape& s : kShapes)
      for (int64_t M : kRows) {
        benchmark::RegisterBenchmark(case_name("ours", t, s, M).c_str(), BM_Ours, t, s, M)->UseRealTime()->MinTime(0.2);
        if (!g_have_peer) continue;
        benchmark::RegisterBenchmark(case_name("ggml", t, s, M).c_str(), BM_Ggml, t, s, M, false)
            ->UseRealTime()
            ->MinTime(0.2);
        benchmark::RegisterBenchmark(case_name("ggml_repack", t, s, M).c_str(), BM_Ggml, t, s, M, true)
            ->UseRealTime()
            ->MinTime(0.2);
      }
  struct Collect : benchmark::ConsoleReporter {
    std::map<std::string, std::vector<double>> rates;  // every repetition's GB/s by case
    void ReportRuns(const std::vector<Run>& runs) override {
      for (const auto& r : runs)
        if (r.run_type == Run::RT_Iteration && !r.error_occurred) {
          std::string name = r.run_name.function_name;
          rates[name].push_back(r.counters.at("GB/s"));
        }
      ConsoleReporter::ReportRuns(runs);
    }
  } reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  std::printf("\nweight GB/s, median [min, max] over repetitions; ours / ggml of the medians:\n");
  for (GgmlType t : kTypes)
    for (const Shape& s : kShapes)
      for (int64_t M : kRows) {
        auto ours = reporter.rates.find(case_name("ours", t, s, M));
        if (ours == reporter.rates.end()) continue;
        const double o = median(ours->second);
        std::printf("  %-4s %-26s m%-2lld ours %6.1f [%5.1f, %5.1f]", k::ggml_type_info(t).name, s.name,
                    static_cast<long long>(M), o, *std::min_element(ours->second.begin(), ours->second.end()),
                    *std::max_element(ours->second.begin(), ours->second.end()));
        for (const char* who : {"ggml", "ggml_repack"}) {
          auto g = reporter.rates.find(case_name(who, t, s, M));
          if (g == reporter.rates.end() || g->second.empty()) continue;
          const double m = median(g->second);
          std::printf("  %s %6.1f [%5.1f, %5.1f] %.2fx", who, m, *std::min_element(g->second.begin(), g->second.end()),
                      *std::max_element(g->second.begin(), g->second.end()), o / m);
        }
        std::printf("\n");
      }
  benchmark::Shutdown();
  return 0;
}
