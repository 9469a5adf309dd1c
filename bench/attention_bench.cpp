// Gated attention forward (+ backward) throughput at batch 1. Besides tokens/s each run reports its
// useful FLOP rate (causal: forward 2 products, backward 5, each T^2/2 * hd multiply-adds per head) and
// vs_peer, the ratio of that rate to a oneDNN fp32 matmul of the score shape [T, hd] x [hd, T] run
// alternately with it (the same arithmetic at its best; alternating keeps the ratio meaningful on a
// shared, noisy machine).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "kernels/attention.h"
#include "kernels/matmul.h"

namespace hs::kernels {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

template <typename T>
std::vector<T> random_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<T> x(n);
  for (auto& e : x) e = from_f32<T>(nd(rng));
  return x;
}

// Args: seq, q_heads, kv_heads, head_dim, batch.
template <typename T, bool kBackward>
void BM_GatedAttention(benchmark::State& state) {
  const AttentionShape s{state.range(4), state.range(0), state.range(1), state.range(2), state.range(3)};
  const size_t nq = static_cast<size_t>(s.batch * s.seq * s.q_heads * s.head_dim);
  const size_t nkv = static_cast<size_t>(s.batch * s.seq * s.kv_heads * s.head_dim);
  const std::vector<T> q = random_values<T>(nq, 1), k = random_values<T>(nkv, 2), v = random_values<T>(nkv, 3),
                       gate = random_values<T>(nq, 4);
  const std::vector<float> dout = random_values<float>(nq, 5);
  std::vector<T> out(nq);
  std::vector<float> dq(nq), dk(nkv), dv(nkv), dgate(nq);
  std::vector<float> peer_a(static_cast<size_t>(s.seq * s.head_dim), 0.5f), peer_b(peer_a),
      peer_c(static_cast<size_t>(s.seq * s.seq));
  MemoryAccountant mem;
  double attention_seconds = 0, peer_seconds = 0;
  for (auto _ : state) {
    Clock::time_point t0 = Clock::now();
    {
      AttentionSaved saved;
      gated_attention_forward(s, q.data(), k.data(), v.data(), gate.data(), out.data(),
                              kBackward ? &saved : nullptr, mem);
      if (kBackward)
        gated_attention_backward(s, q.data(), k.data(), v.data(), gate.data(), saved, dout.data(), dq.data(),
                                 dk.data(), dv.data(), dgate.data(), mem);
    }
    benchmark::ClobberMemory();
    const double t = seconds_since(t0);
    state.SetIterationTime(t);
    attention_seconds += t;
    t0 = Clock::now();
    matmul(peer_a.data(), peer_b.data(), peer_c.data(), s.seq, s.seq, s.head_dim, false, true);
    benchmark::ClobberMemory();
    peer_seconds += seconds_since(t0);
  }
  const double products = kBackward ? 7.0 : 2.0;
  const double flops = products * static_cast<double>(s.seq * s.seq) *
                       static_cast<double>(s.batch * s.head_dim * s.q_heads);
  const double peer_flops = 2.0 * static_cast<double>(s.seq * s.seq * s.head_dim);
  const double iters = static_cast<double>(state.iterations());
  state.counters["tokens/s"] =
      benchmark::Counter(iters * static_cast<double>(s.batch * s.seq), benchmark::Counter::kIsRate);
  state.counters["GFLOP/s"] = benchmark::Counter(iters * flops * 1e-9, benchmark::Counter::kIsRate);
  state.counters["peer_GFLOP/s"] = iters * peer_flops / peer_seconds * 1e-9;
  state.counters["vs_peer"] = (flops / attention_seconds) / (peer_flops / peer_seconds);
}

// The last shape is one full-attention layer of the `small` training preset (batch 8 x seq 512).
void shapes(benchmark::internal::Benchmark* b) {
  b->Args({2048, 4, 1, 64, 1})->Args({1024, 16, 2, 256, 1})->Args({512, 4, 1, 64, 8});
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_GatedAttention<float, true>)->Name("fwd_bwd/f32")->Apply(shapes);
BENCHMARK(BM_GatedAttention<bf16, true>)->Name("fwd_bwd/bf16")->Apply(shapes);
BENCHMARK(BM_GatedAttention<float, false>)->Name("fwd/f32")->Apply(shapes);
BENCHMARK(BM_GatedAttention<bf16, false>)->Name("fwd/bf16")->Apply(shapes);

}  // namespace
}  // namespace hs::kernels

BENCHMARK_MAIN();
