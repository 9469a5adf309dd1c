// Where decode's big products lose bandwidth: one LM-head-sized bf16 product (x[1|8, K] W^T, W [N, K]) read from
// memory of each kind the decoder could hold its weights in, against a plain read of the same memory:
//   file        the checkpoint's way: a read-only private mapping of the file (page cache, 4 KiB pages)
//   file+pop    the same with MAP_POPULATE (page tables filled at map time)
//   file+seq    the same with MADV_SEQUENTIAL;  file+huge: MADV_HUGEPAGE (file THP, where the kernel has it)
//   anon4k      an anonymous copy with MADV_NOHUGEPAGE (4 KiB pages, no page cache)
//   anonhuge    an anonymous 2 MiB-aligned copy with MADV_HUGEPAGE (core/memory.cpp's buffers; the AnonHugePages
//               the kernel actually gave are printed)
// For each: read GB/s (a 64-bit sum, contiguous halves per thread) and the gemv's weight GB/s (kernels::gemv_rows
// at M = 1 and 8 with software-prefetch distances 0, 1, 2, 4, the threads splitting W as the fused decode step splits
// an LM head: chunks of 1 MiB taken as they come free). Every variant runs once per round, rounds interleaved, best
// pass kept; GB/s by wall time and by the threads' mean CPU time (a descheduled thread's wait is in the wall time
// only). Not a test; on a shared machine only same-run ratios mean anything.
//   build/bench/weight_pages_bench [--file PATH] [--n 248320] [--k 2048] [--reps 5] [--memory anonhuge]
// (the weight file, N x K bf16, is written once at PATH, default /tmp/hs_weight_pages.bin)
#include <fcntl.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/gemv.h"

namespace {

using hs::bf16;
using Clock = std::chrono::steady_clock;

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

uint64_t anon_huge_kib() {
  std::ifstream f("/proc/self/smaps_rollup");
  std::string k;
  uint64_t v = 0;
  while (f >> k)
    if (k == "AnonHugePages:") {
      f >> v;
      return v;
    }
  return 0;
}

volatile uint64_t sink;

// One timed pass of f(thread, threads) in a parallel region: wall seconds, and the threads' mean CPU seconds (the
// time they ran: on a loaded machine a descheduled thread's wait is in the wall time only).
struct Pass {
  double wall, cpu;
};
template <typename F> Pass timed(F&& f) {
  double cpu_sum = 0;
  const auto t0 = Clock::now();
#pragma omp parallel reduction(+ : cpu_sum)
  {
    const double c0 = thread_cpu_seconds();
    f();
    cpu_sum += thread_cpu_seconds() - c0;
  }
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  return {wall, cpu_sum / omp_get_max_threads()};
}

Pass read_pass(const std::byte* p, size_t bytes) {
  const size_t n = bytes / 8;
  const auto* w = reinterpret_cast<const uint64_t*>(p);
  return timed([&] {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const size_t a = n * t / nt, b = n * (t + 1) / nt;
    uint64_t acc[8] = {};
    size_t i = a;
    for (; i + 8 <= b; i += 8)
      for (int j = 0; j < 8; ++j) acc[j] += w[i + j];
    for (; i < b; ++i) acc[0] += w[i];
    uint64_t total = 0;
    for (int j = 0; j < 8; ++j) total += acc[j];
    sink = sink + total;
  });
}

// The fused step's split of a big product: chunks of 1 MiB of rows, taken dynamically.
Pass gemv_pass(const bf16* W, int64_t M, int64_t N, int64_t K, const bf16* x, float* y) {
  const hs::kernels::cpu::Level isa = hs::kernels::gemv_level();
  const int64_t align = hs::kernels::gemv_row_align(M, isa);
  const int64_t rows = std::max<int64_t>(align, (int64_t{1} << 20) / (K * 2) / align * align);
  const int64_t chunks = (N + rows - 1) / rows;
  return timed([&] {
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t c = 0; c < chunks; ++c)
      hs::kernels::gemv_rows(x, W, y, M, N, K, 0, 0, c * rows, std::min(N, (c + 1) * rows), isa);
  });
}

}  // namespace

int main(int argc, char** argv) {
  std::string path = "/tmp/hs_weight_pages.bin";
  int64_t N = 248320, K = 2048;
  int reps = 5;
  std::string only;  // --memory NAME: that kind alone
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--file") path = argv[i + 1];
    else if (a == "--n") N = std::atoll(argv[i + 1]);
    else if (a == "--k") K = std::atoll(argv[i + 1]);
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else if (a == "--memory") only = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: %s [--file PATH] [--n N] [--k K] [--reps R] [--memory NAME]\n", argv[0]);
      return 2;
    }
  }
  const size_t bytes = size_t(N * K) * 2;
  struct stat st{};
  if (stat(path.c_str(), &st) != 0 || size_t(st.st_size) != bytes) {
    std::vector<bf16> row(static_cast<size_t>(K));
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) {
      std::perror(path.c_str());
      return 1;
    }
    uint64_t s = 88172645463325252ull;
    for (int64_t n = 0; n < N; ++n) {
      for (auto& v : row) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        v = bf16(float(int64_t(s % 2001) - 1000) * 1e-3f);
      }
      std::fwrite(row.data(), 2, row.size(), f);
    }
    std::fclose(f);
  }
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) {
    std::perror(path.c_str());
    return 1;
  }
  std::printf("W %lld x %lld bf16 (%.0f MiB), %d threads, gemv path %s, %d interleaved rounds; best pass of each\n"
              "GB/s: wall = bytes / wall time; cpu = bytes / the threads' mean CPU time (immune to descheduling)\n",
              (long long)N, (long long)K, bytes / 1048576.0, omp_get_max_threads(),
              hs::kernels::cpu::level_name(hs::kernels::gemv_level()), reps);
  struct Memory {
    std::string name;
    const std::byte* p;
  };
  std::vector<Memory> mems;
  struct FileMode {
    const char* name;
    int flags, advice;
  };
  for (const FileMode& m : {FileMode{"file", 0, -1}, FileMode{"file+pop", MAP_POPULATE, -1},
                            FileMode{"file+seq", 0, MADV_SEQUENTIAL}, FileMode{"file+huge", 0, MADV_HUGEPAGE}}) {
    void* p = mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE | m.flags, fd, 0);
    if (p == MAP_FAILED) {
      std::perror("mmap file");
      return 1;
    }
    if (m.advice >= 0) madvise(p, bytes, m.advice);
    mems.push_back({m.name, static_cast<const std::byte*>(p)});
  }
  void* anon4 = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  constexpr size_t kHuge = size_t{2} << 20;
  void* raw = mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (anon4 == MAP_FAILED || raw == MAP_FAILED) {
    std::perror("mmap");
    return 1;
  }
  auto* huge = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(raw) + kHuge - 1) / kHuge * kHuge);
  madvise(anon4, bytes, MADV_NOHUGEPAGE);
  madvise(huge, bytes, MADV_HUGEPAGE);
  const uint64_t before = anon_huge_kib();
  std::memcpy(anon4, mems[0].p, bytes);
  std::memcpy(huge, mems[0].p, bytes);
  std::printf("(AnonHugePages: %.0f MiB of the %.0f MiB anonhuge copy)\n", (anon_huge_kib() - before) / 1024.0,
              bytes / 1048576.0);
  mems.push_back({"anon4k", static_cast<const std::byte*>(anon4)});
  mems.push_back({"anonhuge", huge});
  if (!only.empty()) {
    std::erase_if(mems, [&](const Memory& m) { return m.name != only; });
    if (mems.empty()) {
      std::fprintf(stderr, "--memory: file, file+pop, file+seq, file+huge, anon4k or anonhuge\n");
      return 2;
    }
  }

  std::vector<int> prefetch = {0, 1, 2, 4};
  std::vector<int64_t> batch = {1, 8};
  std::vector<bf16> x(static_cast<size_t>(8 * K), bf16(0.5f));
  std::vector<float> y(static_cast<size_t>(8 * N));
  // [mem][variant] best wall and cpu seconds; variant 0 = read, then (prefetch, batch) pairs.
  const size_t nv = 1 + prefetch.size() * batch.size();
  std::vector<std::vector<Pass>> best(mems.size(), std::vector<Pass>(nv, Pass{1e30, 1e30}));
  for (int round = -1; round < reps; ++round)  // round -1 warms (faults, page tables)
    for (size_t mi = 0; mi < mems.size(); ++mi)
      for (size_t v = 0; v < nv; ++v) {
        Pass ps;
        if (v == 0) ps = read_pass(mems[mi].p, bytes);
        else {
          const size_t j = v - 1;
          hs::kernels::set_gemv_prefetch_blocks(prefetch[j / batch.size()]);
          ps = gemv_pass(reinterpret_cast<const bf16*>(mems[mi].p), batch[j % batch.size()], N, K, x.data(), y.data());
        }
        if (round < 0) continue;
        best[mi][v].wall = std::min(best[mi][v].wall, ps.wall);
        best[mi][v].cpu = std::min(best[mi][v].cpu, ps.cpu);
      }
  std::printf("%-10s %13s", "memory", "read");
  for (int pf : prefetch)
    for (int64_t b : batch) std::printf("   b%lld pf%d      ", (long long)b, pf);
  std::printf("\n%-10s %13s", "", "wall/cpu");
  for (size_t j = 0; j < prefetch.size() * batch.size(); ++j) std::printf(" %15s", "wall/cpu");
  std::printf("\n");
  for (size_t mi = 0; mi < mems.size(); ++mi) {
    std::printf("%-10s", mems[mi].name.c_str());
    for (size_t v = 0; v < nv; ++v)
      std::printf(" %7.1f/%-7.1f", bytes / best[mi][v].wall * 1e-9, bytes / best[mi][v].cpu * 1e-9);
    std::printf("\n");
  }
  close(fd);
  return 0;
}
