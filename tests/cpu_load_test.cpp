// core/cpu_load.h: the machine-load reading main.cpp uses to choose how idle OpenMP threads wait (spin or sleep).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <chrono>
#include <sstream>
#include <thread>
#include <vector>

#include "cli/threads.h"
#include "core/cpu_load.h"

namespace hs {
namespace {

TEST(CpuLoad, SpinOnlyWhenEveryThreadHasAProcessorOfItsOwn) {
  EXPECT_TRUE(spin_while_waiting(0, 2, 2, 2));
  EXPECT_TRUE(spin_while_waiting(1, 1, 2, 2));
  EXPECT_TRUE(spin_while_waiting(3, 4, 8, 8));
  EXPECT_TRUE(spin_while_waiting(10, 4, 4, 64));  // pinned to 4 free processors of a busy 64
  EXPECT_FALSE(spin_while_waiting(1, 2, 2, 2));   // one busy task beside two threads on two processors
  EXPECT_FALSE(spin_while_waiting(0, 3, 2, 2));   // more threads than processors
  EXPECT_FALSE(spin_while_waiting(0, 64, 2, 64));  // an idle 64-processor host, but a quota of 2
  EXPECT_FALSE(spin_while_waiting(-1, 1, 64, 64));  // the load is unknown
  EXPECT_FALSE(spin_while_waiting(0, 0, 2, 2));
}

TEST(CpuLoad, ProcessorCountsArePositiveAndNested) {
  EXPECT_GE(usable_cpus(), 1);
  EXPECT_LE(usable_cpus(), affinity_cpus());
  EXPECT_LE(affinity_cpus(), online_cpus());
}

TEST(CpuLoad, ProcsRunningIsReadFromAStatText) {
  std::istringstream stat("cpu  1 2 3 4\ncpu0 1 2 3 4\nintr 5 6 7\nctxt 9\nprocs_running 7\nprocs_blocked 0\n");
  EXPECT_EQ(parse_procs_running(stat), 7);
  std::istringstream none("cpu  1 2 3 4\nctxt 9\n");
  EXPECT_EQ(parse_procs_running(none), -1);
  std::istringstream bad("procs_running x\n");
  EXPECT_EQ(parse_procs_running(bad), -1);
}

TEST(CpuLoad, RequestedThreadsComeFromTheFlagThenOmpNumThreads) {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const std::string saved = omp ? omp : "";
  setenv("OMP_NUM_THREADS", "3,1", 1);
  auto threads = [](std::vector<const char*> args) {
    args.insert(args.begin(), "hybridscan");
    return cli::requested_threads(static_cast<int>(args.size()), args.data());
  };
  EXPECT_EQ(threads({"train", "--steps", "4"}), 3);  // OMP_NUM_THREADS' first value
  EXPECT_EQ(threads({"train", "--threads", "5"}), 5);
  EXPECT_EQ(threads({"train", "--threads=6"}), 6);
  EXPECT_EQ(threads({"train", "--threads", "2", "--threads=7"}), 7);  // the last one, as CLI11 takes it
  EXPECT_EQ(threads({"train", "--threads", "0"}), 3);                 // 0: OpenMP's default
  EXPECT_EQ(threads({"train", "--threads", "-2"}), 3);
  EXPECT_EQ(threads({"train", "--threads=abc"}), 3);
  EXPECT_EQ(threads({"train", "--threads"}), 3);  // no value: left to CLI11's error
  unsetenv("OMP_NUM_THREADS");
  EXPECT_EQ(threads({"train"}), affinity_cpus());
  if (omp) setenv("OMP_NUM_THREADS", saved.c_str(), 1);
  EXPECT_EQ(positive_count("4,2"), 4);
  EXPECT_EQ(positive_count("99999999999"), 0);
  EXPECT_EQ(positive_count(""), 0);
  EXPECT_EQ(positive_count(nullptr), 0);
}

TEST(CpuLoad, CpuMaxQuotasAreRoundedDown) {
  auto cpus = [](const char* text) {
    std::istringstream in(text);
    return parse_cpu_max(in);
  };
  EXPECT_EQ(cpus("max 100000\n"), 0);  // no quota
  EXPECT_EQ(cpus("200000 100000\n"), 2);
  EXPECT_EQ(cpus("150000 100000\n"), 1);  // 1.5 processors hold one spinning thread, not two
  EXPECT_EQ(cpus("50000 100000\n"), 1);
  EXPECT_EQ(cpus(""), 0);
  EXPECT_EQ(cpus("abc 100000\n"), 0);
}

// Threads that stay runnable are counted (they are tasks the scheduler runs, whoever owns them); the reader is not.
TEST(CpuLoad, BusyThreadsAreCountedAsOtherRunnableTasks) {
  if (other_runnable_tasks(1) < 0) GTEST_SKIP() << "/proc/stat is unreadable here";
  // Under a CPU quota a throttled cgroup's tasks leave the run queue for a while: the count is no test there.
  if (usable_cpus() < affinity_cpus()) GTEST_SKIP() << "a CPU quota applies here";
  std::atomic<bool> stop{false};
  std::vector<std::thread> busy;
  for (int i = 0; i < 2; ++i)
    busy.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const int seen = other_runnable_tasks(5);
  stop = true;
  for (auto& t : busy) t.join();
  EXPECT_GE(seen, 2);
}

}  // namespace
}  // namespace hs
