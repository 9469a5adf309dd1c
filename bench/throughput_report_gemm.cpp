// The matrix-product peak at a training step's own shapes, for bench/throughput_report.py: reads one product a line
// from stdin,
//   M N K trans_a trans_b accumulate varying_rows in_dtype out_dtype      (dtype: 0 fp32, 1 bf16)
// as `train --profile --json` lists them (profile.matmul_shapes), runs it through kernels::matmul (the engine's own
// entry point: oneDNN, or its loops for skinny shapes) on random operands, and prints one JSON line per product:
// the best and the median seconds per call over REPS timed batches of calls after a warm-up call (primitive
// creation), and the GFLOP/s of the best (a peak is a ceiling: on a shared machine the best batch is the least disturbed). Operands are fresh per shape, packed (leading dimensions = the row lengths), cache-warm as a
// step's operands mostly are not, so the figure is a ceiling for that shape.
//   build/bench/throughput_report_gemm [THREADS] [MIN_SECONDS_PER_BATCH] [REPS] < shapes.txt
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/matmul.h"

namespace {

using Clock = std::chrono::steady_clock;

template <typename TI, typename TO>
std::pair<double, double> seconds_per_call(int64_t M, int64_t N, int64_t K, bool ta, bool tb, bool acc, bool varying, double min_s,
                        int reps) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 0.5f);
  std::vector<TI> A(static_cast<size_t>(M * K)), B(static_cast<size_t>(K * N));
  std::vector<TO> C(static_cast<size_t>(M * N), TO(0.f));
  for (auto& x : A) x = TI(nd(rng));
  for (auto& x : B) x = TI(nd(rng));
  hs::kernels::MatmulLayout ld;
  ld.varying_rows = varying;
  auto call = [&] { hs::kernels::matmul(A.data(), B.data(), C.data(), M, N, K, ta, tb, acc, ld); };
  call();  // primitive creation
  // Calls per batch: enough for min_s.
  int64_t n = 1;
  for (;;) {
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i) call();
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (dt >= min_s || n >= (int64_t{1} << 20)) break;
    n = dt > 0 ? std::max<int64_t>(n * 2, static_cast<int64_t>(double(n) * min_s / dt * 1.2)) : n * 2;
  }
  std::vector<double> per;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i) call();
    per.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / double(n));
  }
  std::sort(per.begin(), per.end());
  return {per.front(), per[per.size() / 2]};
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const double min_s = argc > 2 ? std::atof(argv[2]) : 0.02;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  if (threads < 1 || !(min_s > 0) || reps < 1) {
    std::fprintf(stderr, "usage: %s [THREADS>=1] [MIN_SECONDS_PER_BATCH>0] [REPS>=1] < shapes\n", argv[0]);
    return 2;
  }
  omp_set_num_threads(threads);
  long long M, N, K;
  int ta, tb, acc, var, in, out;
  while (std::scanf("%lld %lld %lld %d %d %d %d %d %d", &M, &N, &K, &ta, &tb, &acc, &var, &in, &out) == 9) {
    if (M <= 0 || N <= 0 || K <= 0 || in < 0 || in > 1 || out < 0 || out > 1 || (in == 0 && out == 1)) {
      std::fprintf(stderr, "throughput_report_gemm: bad product %lld %lld %lld (dtypes %d -> %d)\n", M, N, K, in, out);
      return 2;
    }
    std::pair<double, double> s;
    if (in == 0) s = seconds_per_call<float, float>(M, N, K, ta, tb, acc, var, min_s, reps);
    else if (out == 0) s = seconds_per_call<hs::bf16, float>(M, N, K, ta, tb, acc, var, min_s, reps);
    else s = seconds_per_call<hs::bf16, hs::bf16>(M, N, K, ta, tb, acc, var, min_s, reps);
    const double flops = 2.0 * double(M) * double(N) * double(K);
    std::printf("{\"shape\": [%lld, %lld, %lld, %d, %d, %d, %d, %d, %d], \"seconds\": %.6e, \"median_seconds\": %.6e, "
                "\"gflops\": %.3f}\n",
                M, N, K, ta, tb, acc, var, in, out, s.first, s.second, flops / s.first * 1e-9);
    std::fflush(stdout);
  }
  return 0;
}
