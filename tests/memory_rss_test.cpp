// The accountant sees what the process really holds: a training run's peak resident set, less the baseline of a
// process that trains `tiny` (libraries, oneDNN and OpenMP runtimes, code: what no step allocates), is within 5% of
// the accountant's step peak, for every remat policy. Before buffers of 64 KiB and more got their own mappings
// (src/core/memory.cpp), glibc's heap held 71-206 MiB above the peak at batch 8 x 512 of `small` (+17-32%); here,
// at batch 4 x 256 with fp32 weights, the mappings leave +1-3%.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/memory.h"
#include "test_util.h"

namespace hs {
namespace {

struct Measured {
  double rss_bytes = 0;   // the child's peak resident set (train --json: its own VmHWM)
  double peak_bytes = 0;  // the accountant's largest step peak (train --json)
};

// Runs `hybridscan train ARGS --json` as a child of its own, so that its rusage is its own.
Measured run_train(const std::vector<std::string>& args) {
  namespace fs = std::filesystem;
  const fs::path out = fs::temp_directory_path() / ("hs_rss_" + std::to_string(::getpid()) + ".json");
  std::vector<std::string> argv_s = {hs::test::binary(), "train"};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  argv_s.insert(argv_s.end(), {"--synthetic", "--quiet", "--json", "--threads", "2"});
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  // The child reports its own peak resident set (VmHWM, its program image's): wait4's ru_maxrss would also count the
  // image before the exec, which a forked child shares with this test process (47 MiB against 15.5 MiB for a tiny
  // run when other tests had run in this process first).
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  EXPECT_EQ(spawned, 0) << "cannot start " << argv[0];
  if (spawned != 0) return {};
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "hybridscan train exited with " << status;
  std::ifstream in(out);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty() && line[0] == '{') last = line;
  fs::remove(out);
  Measured m;
  if (last.empty()) {
    ADD_FAILURE() << "no JSON line from hybridscan train";
    return m;
  }
  const nlohmann::json j = nlohmann::json::parse(last);
  m.peak_bytes = j["peak_bytes"].get<double>();
  m.rss_bytes = j["peak_rss_bytes"].get<double>();
  return m;
}

TEST(ResidentSet, PeakRssLessBaselineWithinFivePercentOfTheAccountantForEveryPolicy) {
  if (hs::own_mapping_min_bytes() == SIZE_MAX)
    GTEST_SKIP() << "under AddressSanitizer buffers stay in the heap and its shadow memory is resident too";
  // Every level: below AVX-512 oneDNN's AVX2 gemm once kept partial sums of K cut among threads outside the
  // accountant (+12.6 / +16.6 / +14.2 MiB for none / block / sublayer on a Zen 5 under HS_MAX_ISA=avx2, and this test
  // skipped there); its products now run as single-threaded tiles (kernels/matmul.h), and under HS_MAX_ISA=avx2 on a
  // Xeon (AMX machine) the three policies measured +1.5 / +4.5 / +4.2 MiB (0.4-1.5%).
  // The baseline: a one-step tiny run holds ~17 MiB beyond its ~4 MiB accountant peak.
  const Measured tiny = run_train({"--preset", "tiny", "--steps", "1", "--batch", "1", "--seq", "16"});
  const double baseline = tiny.rss_bytes - tiny.peak_bytes;
  // small, fp32 weights (parameters and moments ~230 MiB: a peak of 260-500 MiB), bf16 compute, one step each.
  for (const char* remat : {"none", "block", "sublayer"}) {
    const Measured m = run_train({"--preset", "small", "--steps", "1", "--batch", "4", "--seq", "256", "--remat", remat,
                                  "--weight-dtype", "fp32", "--compute-dtype", "bf16"});
    const double unaccounted = m.rss_bytes - baseline - m.peak_bytes;
    std::printf("remat %-8s: peak RSS %.1f MiB, baseline %.1f MiB, accountant %.1f MiB: %+.1f MiB (%+.2f%%)\n", remat,
                m.rss_bytes / 1048576, baseline / 1048576, m.peak_bytes / 1048576, unaccounted / 1048576,
                100 * unaccounted / m.peak_bytes);
    EXPECT_LT(std::fabs(unaccounted), 0.05 * m.peak_bytes) << remat;
  }
}

}  // namespace
}  // namespace hs
