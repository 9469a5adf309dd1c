// MoE forward + backward throughput (tokens/s) at the `small` shape: H = 256, E = 8, k = 2, I = 256,
// Is = 256, 4096 tokens, fp32 and bf16. The peer, measured in the same run, is a dense SwiGLU MLP of
// width k * I + Is = 768: the same matmul FLOPs per token, so the ratio is the cost of routing,
// grouping, the per-expert products and the scatter. Absolute times on shared machines are noise; read
// the ratio.
#include <benchmark/benchmark.h>

#include <malloc.h>

#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/mlp.h"
#include "kernels/moe.h"

namespace hs::kernels {
namespace {

constexpr int64_t kTokens = 4096, kHidden = 256, kExperts = 8, kTopK = 2, kInter = 256, kShared = 256;

template <typename T>
std::vector<T> random_vector(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<T> v(n);
  for (T& x : v) x = from_f32<T>(nd(rng));
  return v;
}

template <typename T>
void BM_MoeForwardBackward(benchmark::State& state) {
  const MoeShape s{kTokens, kHidden, kExperts, kTopK, kInter, kShared, true};
  const float sh = 1.0f / 16.0f;  // 1 / sqrt(H)
  const auto x = random_vector<T>(kTokens * kHidden, 1.0f, 1);
  const auto router = random_vector<T>(kExperts * kHidden, sh, 2);
  const auto gate_up = random_vector<T>(kExperts * 2 * kInter * kHidden, sh, 3);
  const auto down = random_vector<T>(kExperts * kHidden * kInter, sh, 4);
  const auto shared = random_vector<T>(kShared * kHidden, sh, 5);
  const auto seg = random_vector<float>(kHidden, sh, 6);
  const auto dy = random_vector<float>(kTokens * kHidden, 1.0f, 7);
  const MoeWeights<T> w{router.data(), gate_up.data(), down.data(), shared.data(),
                        shared.data(), shared.data(),  seg.data()};
  std::vector<T> y(kTokens * kHidden);
  std::vector<float> dx(kTokens * kHidden), g_router(router.size()), g_gate_up(gate_up.size()), g_down(down.size()),
      g_shared(3 * shared.size()), g_seg(kHidden), aux(kExperts, 1e-3f);
  const MoeGrads g{g_router.data(),
                   g_gate_up.data(),
                   g_down.data(),
                   g_shared.data(),
                   g_shared.data() + shared.size(),
                   g_shared.data() + 2 * shared.size(),
                   g_seg.data()};
  MemoryAccountant mem;
  for (auto _ : state) {
    MoeSaved saved;
    moe_forward<T>(s, x.data(), w, y.data(), &saved, mem);
    moe_backward<T>(s, x.data(), w, saved, dy.data(), aux.data(), dx.data(), g, mem);
    benchmark::DoNotOptimize(dx.data());
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
}

template <typename T>
void BM_DenseSwigluPeer(benchmark::State& state) {
  const int64_t I = kTopK * kInter + kShared;
  const auto x = random_vector<T>(kTokens * kHidden, 1.0f, 1);
  const auto w = random_vector<T>(I * kHidden, 1.0f / 16.0f, 2);
  const auto dy = random_vector<float>(kTokens * kHidden, 1.0f, 3);
  std::vector<T> y(kTokens * kHidden);
  std::vector<float> dx(kTokens * kHidden), dw(3 * I * kHidden);
  MemoryAccountant mem;
  for (auto _ : state) {
    SwigluSaved saved;
    swiglu_forward<T>(kTokens, kHidden, I, x.data(), w.data(), w.data(), w.data(), y.data(), &saved, mem);
    swiglu_backward<T>(kTokens, kHidden, I, x.data(), w.data(), w.data(), w.data(), saved, dy.data(), dx.data(),
                       dw.data(), dw.data() + I * kHidden, dw.data() + 2 * I * kHidden, mem);
    benchmark::DoNotOptimize(dx.data());
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
}

// The SwiGLU row kernels alone over the routed rows of one layer (N * k rows of width I): forward act, and
// backward's fused act + grad.
template <typename T>
void BM_SwigluActRows(benchmark::State& state) {
  const int64_t rows = kTokens * kTopK;
  const auto gu = random_vector<T>(rows * 2 * kInter, 1.0f, 1);
  std::vector<T> act(rows * kInter);
  for (auto _ : state) {
    pieces::swiglu_act_rows<T>(rows, kInter, gu.data(), nullptr, act.data());
    benchmark::DoNotOptimize(act.data());
  }
  state.SetItemsProcessed(state.iterations() * rows * kInter);
}
template <typename T>
void BM_SwigluActGradRows(benchmark::State& state) {
  const int64_t rows = kTokens * kTopK;
  const auto gu = random_vector<T>(rows * 2 * kInter, 1.0f, 1);
  const auto dact = random_vector<float>(rows * kInter, 1.0f, 2);
  const auto scale = random_vector<float>(rows, 1.0f, 3);
  std::vector<T> act(rows * kInter), dgu(rows * 2 * kInter);
  std::vector<float> dot(rows);
  for (auto _ : state) {
    pieces::swiglu_act_grad_rows<T>(rows, kInter, gu.data(), dact.data(), scale.data(), act.data(), dgu.data(),
                                    dot.data());
    benchmark::DoNotOptimize(dgu.data());
  }
  state.SetItemsProcessed(state.iterations() * rows * kInter);
}

BENCHMARK(BM_SwigluActRows<bf16>)->Name("swiglu_act_rows/bf16")->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_SwigluActGradRows<bf16>)
    ->Name("swiglu_act_grad_rows/bf16")
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_MoeForwardBackward<float>)->Name("moe_fwd_bwd/f32")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DenseSwigluPeer<float>)->Name("dense_peer_fwd_bwd/f32")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MoeForwardBackward<bf16>)->Name("moe_fwd_bwd/bf16")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DenseSwigluPeer<bf16>)->Name("dense_peer_fwd_bwd/bf16")->Unit(benchmark::kMillisecond)->UseRealTime();

// Console output plus, at the end, the MoE / dense-peer time ratio per dtype.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs)
      if (r.run_type == Run::RT_Iteration) seconds_[r.benchmark_name()] = r.GetAdjustedRealTime();
    ConsoleReporter::ReportRuns(runs);
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    for (const char* dt : {"f32", "bf16"}) {
      const auto moe = seconds_.find(std::string("moe_fwd_bwd/") + dt + "/real_time");
      const auto peer = seconds_.find(std::string("dense_peer_fwd_bwd/") + dt + "/real_time");
      if (moe != seconds_.end() && peer != seconds_.end())
        std::printf("%s: moe fwd+bwd takes %.2fx the time of the dense peer (same FLOPs)\n", dt,
                    moe->second / peer->second);
    }
  }

 private:
  std::map<std::string, double> seconds_;
};

}  // namespace
}  // namespace hs::kernels

int main(int argc, char** argv) {
  // As the trainer (src/cli/main.cpp): keep freed workspace in the heap, so each iteration does not pay for
  // fresh zeroed pages. (The trainer also runs libgomp with OMP_WAIT_POLICY=passive; set it to compare.)
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  benchmark::Initialize(&argc, argv);
  hs::kernels::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
