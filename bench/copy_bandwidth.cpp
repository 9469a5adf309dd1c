// This machine's memory bandwidth, the denominator of bench/generate_bench.sh's decode ceiling (bytes a decode step
// reads / bandwidth).
//   copy_bandwidth [THREADS=2] [MIB=512] [REPS=10]
// Two buffers of MIB MiB each (far beyond any last-level cache), split into one contiguous piece per OpenMP thread.
// copy: memcpy src -> dst, counted as STREAM counts it (bytes read + bytes written per second); read: a sum of the
// source as 64-bit integers (vectorised, no stores), bytes read per second. The best of REPS of each (the first pass
// faults the pages in and is not timed). Prints one JSON line.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const size_t mib = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 512;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 10;
  if (threads < 1 || mib < 1 || reps < 1) {
    std::fprintf(stderr, "usage: %s [THREADS>=1] [MIB>=1] [REPS>=1]\n", argv[0]);
    return 2;
  }
  omp_set_num_threads(threads);
  const size_t n = mib << 17;  // uint64 words
  std::vector<uint64_t> src(n), dst(n);
  const size_t per = (n + threads - 1) / threads;
  auto piece = [&](int t) { return std::pair<size_t, size_t>{std::min(n, t * per), std::min(n, (t + 1) * per)}; };
#pragma omp parallel for schedule(static, 1)
  for (int t = 0; t < threads; ++t) {
    auto [b, e] = piece(t);
    for (size_t i = b; i < e; ++i) src[i] = i * 0x9E3779B97F4A7C15ull, dst[i] = 0;
  }
  using clock = std::chrono::steady_clock;
  double best_copy = 1e30, best_read = 1e30;
  uint64_t sink = 0;
  for (int r = 0; r <= reps; ++r) {
    auto t0 = clock::now();
#pragma omp parallel for schedule(static, 1)
    for (int t = 0; t < threads; ++t) {
      auto [b, e] = piece(t);
      std::memcpy(dst.data() + b, src.data() + b, (e - b) * sizeof(uint64_t));
    }
    auto t1 = clock::now();
    uint64_t total = 0;
#pragma omp parallel for schedule(static, 1) reduction(+ : total)
    for (int t = 0; t < threads; ++t) {
      auto [b, e] = piece(t);
      uint64_t s = 0;
      for (size_t i = b; i < e; ++i) s += src[i];
      total += s;
    }
    auto t2 = clock::now();
    sink += total + dst[r % n];
    if (r == 0) continue;
    best_copy = std::min(best_copy, std::chrono::duration<double>(t1 - t0).count());
    best_read = std::min(best_read, std::chrono::duration<double>(t2 - t1).count());
  }
  const double bytes = double(n) * sizeof(uint64_t);
  std::printf("{\"threads\": %d, \"buffer_bytes\": %.0f, \"reps\": %d, \"copy_bytes_per_s\": %.6e, "
              "\"read_bytes_per_s\": %.6e, \"checksum\": %llu}\n",
              threads, bytes, reps, 2 * bytes / best_copy, bytes / best_read, (unsigned long long)(sink & 0xffff));
  return 0;
}
