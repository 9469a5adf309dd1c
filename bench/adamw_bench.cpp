// The optimizer step alone (kernels::sum_squares_all for the clip norm + kernels::adamw_update_clear_all) against a
// memcpy of the same bytes, in one run: is AdamW at the copy bandwidth?
//   adamw_bench [THREADS=2] [MPARAMS=32] [REPS=7]
// MPARAMS million parameters in one tensor set cut like a model's (tensors of 1M..16M elements and a ragged tail),
// far beyond any last-level cache. Per configuration (fp32 or bf16 moments, fp32 weights) and per instruction-set
// path the CPU has: the step's time (best and median of REPS, after one untimed step that faults the pages in),
// its bytes (36 B a parameter with fp32 moments: the norm's read of g, then w, g, m, v read and w, m, v, g written;
// 28 B with bf16 moments) and bytes / time. The copy: memcpy of a buffer of the step's read bytes (one contiguous
// piece per thread), counted as bytes read + written (as STREAM and bench/copy_bandwidth do), best of REPS, each copy
// run just before a step (alternated, so that a shared machine's load slows both alike).
// vs_copy = the step's bytes per second / the copy's. Prints one JSON line per configuration and path.
// `previous_loop` is the kernel before its vector paths (kernels/reference/adamw_reference.cpp, the same bits), each thread on
// its share of every tensor.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/adamw.h"

namespace {

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One memcpy of `bytes` bytes, split into one contiguous piece per thread; its time.
double copy_seconds(const char* src, char* dst, size_t bytes) {
  const int nt = omp_get_max_threads();
  const auto t0 = clock_type::now();
#pragma omp parallel for schedule(static, 1)
  for (int t = 0; t < nt; ++t) {
    const size_t b = bytes * static_cast<size_t>(t) / static_cast<size_t>(nt),
                 e = bytes * static_cast<size_t>(t + 1) / static_cast<size_t>(nt);
    std::memcpy(dst + b, src + b, e - b);
  }
  return seconds_since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace hs;
  using namespace hs::kernels;
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int64_t mparams = argc > 2 ? std::atoll(argv[2]) : 32;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 7;
  if (threads < 1 || mparams < 1 || reps < 1) {
    std::fprintf(stderr, "usage: %s [THREADS>=1] [MPARAMS>=1] [REPS>=1]\n", argv[0]);
    return 2;
  }
  omp_set_num_threads(threads);
  // Tensor sizes: 16M, 4M, 1M, ... repeated until MPARAMS million, the last one ragged.
  std::vector<int64_t> sizes;
  const int64_t total = mparams << 20;
  const int64_t pattern[] = {16 << 20, 4 << 20, 1 << 20, 4 << 20, 2 << 20};
  for (int64_t left = total, j = 0; left > 0; ++j) {
    const int64_t n = std::min(left, pattern[j % 5] + (j % 3) * 17);
    sizes.push_back(n);
    left -= n;
  }
  for (const bool bf16_moments : {false, true}) {
    const auto n = static_cast<size_t>(total);
    std::vector<float> w(n, 0.5f), g(n), m(bf16_moments ? 0 : n, 0.0f), v(bf16_moments ? 0 : n, 0.0f);
    std::vector<bf16> mb(bf16_moments ? n : 0), vb(bf16_moments ? n : 0);
    std::vector<AdamWTensor> tensors;
    std::vector<std::pair<const float*, int64_t>> grads;
    int64_t off = 0;
    for (const int64_t s : sizes) {
      AdamWTensor t;
      const auto o = static_cast<size_t>(off);
      t.w = w.data() + o, t.grad = g.data() + o, t.n = s, t.weight_decay = 0.1f;
      if (bf16_moments) t.m_bf16 = mb.data() + o, t.v_bf16 = vb.data() + o;
      else t.m = m.data() + o, t.v = v.data() + o;
      tensors.push_back(t);
      grads.emplace_back(g.data() + o, s);
      off += s;
    }
    const double bytes_per_param = bf16_moments ? 28.0 : 36.0;
    const double bytes = bytes_per_param * static_cast<double>(total);
    // The copy moves the step's read bytes (norm read excluded: 16 or 12 B a parameter) and writes as many.
    const double copy_bytes = (bytes_per_param - 4.0) / 2.0 * static_cast<double>(total);
    std::vector<char> src(static_cast<size_t>(copy_bytes), 1), dst(static_cast<size_t>(copy_bytes), 0);  // faulted in
    // The previous kernel: its loop (reference::adamw_update_clear_all_loop), each thread on its share of each
    // tensor, as it ran (-1 below).
    std::vector<std::vector<AdamWTensor>> shares(static_cast<size_t>(threads));
    for (const AdamWTensor& t : tensors)
      for (int j = 0; j < threads; ++j) {
        const int64_t i0 = t.n * j / threads, i1 = t.n * (j + 1) / threads;
        AdamWTensor u = t;
        u.n = i1 - i0;
        u.w += i0, u.grad += i0;
        if (u.m) u.m += i0, u.v += i0;
        else u.m_bf16 += i0, u.v_bf16 += i0;
        shares[static_cast<size_t>(j)].push_back(u);
      }
    for (int isa_i = -1; isa_i <= 2; ++isa_i) {
      const auto isa = static_cast<cpu::Level>(std::max(isa_i, 0));
      if (!cpu::allows(isa)) continue;
      cpu::ScopedLevel forced(isa);
      std::vector<double> times, copies;
      AdamWParams p;
      p.lr = 1e-3f;
      for (int r = 0; r <= reps; ++r) {
        const double cs = copy_seconds(src.data(), dst.data(), src.size());
        if (r > 0) copies.push_back(cs);
        for (size_t i = 0; i < n; i += 977) g[i] = 1e-3f * static_cast<float>(i % 13);  // a sparse refill, untimed
        const auto t0 = clock_type::now();
        const double sq = sum_squares_all(grads);
        p.grad_scale = sq > 1.0 ? static_cast<float>(1.0 / std::sqrt(sq)) : 1.0f;
        if (isa_i < 0) {
#pragma omp parallel for schedule(static, 1)
          for (int j = 0; j < threads; ++j) reference::adamw_update_clear_all_loop(shares[static_cast<size_t>(j)], p, r + 1);
        } else {
          adamw_update_clear_all(tensors, p, r + 1);
        }
        const double s = seconds_since(t0);
        if (r > 0) times.push_back(s);
      }
      const double best = *std::min_element(times.begin(), times.end());
      const double copy_rate = 2.0 * copy_bytes / *std::min_element(copies.begin(), copies.end());
      std::printf(
          "{\"isa\": \"%s\", \"moments\": \"%s\", \"threads\": %d, \"params\": %lld, \"tensors\": %zu, "
          "\"bytes_per_param\": %.0f, \"step_best_ms\": %.2f, \"step_median_ms\": %.2f, \"gb_per_s\": %.2f, "
          "\"copy_gb_per_s\": %.2f, \"vs_copy\": %.3f}\n",
          isa_i < 0 ? "previous_loop" : cpu::level_name(isa), bf16_moments ? "bf16" : "fp32", threads, static_cast<long long>(total), tensors.size(),
          bytes_per_param, 1e3 * best, 1e3 * median(times), bytes / best / 1e9, copy_rate / 1e9,
          bytes / best / copy_rate);
      std::fflush(stdout);
    }
  }
  return 0;
}
