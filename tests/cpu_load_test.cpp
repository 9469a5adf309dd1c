// core/cpu_load.h: the machine-load reading main.cpp uses to choose how idle OpenMP threads wait (spin or sleep).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "core/cpu_load.h"

namespace hs {
namespace {

TEST(CpuLoad, SpinOnlyWhenEveryThreadHasAProcessorOfItsOwn) {
  EXPECT_TRUE(spin_while_waiting(0, 2, 2));
  EXPECT_TRUE(spin_while_waiting(1, 1, 2));
  EXPECT_TRUE(spin_while_waiting(3, 4, 8));
  EXPECT_FALSE(spin_while_waiting(1, 2, 2));  // one busy task beside two threads on two processors
  EXPECT_FALSE(spin_while_waiting(0, 3, 2));  // more threads than processors
  EXPECT_FALSE(spin_while_waiting(-1, 1, 64));  // the load is unknown
  EXPECT_FALSE(spin_while_waiting(0, 0, 2));
}

TEST(CpuLoad, UsableCpusIsPositive) { EXPECT_GE(usable_cpus(), 1); }

// Threads that stay runnable are counted (they are tasks the scheduler runs, whoever owns them); the reader is not.
TEST(CpuLoad, BusyThreadsAreCountedAsOtherRunnableTasks) {
  ASSERT_GE(other_runnable_tasks(), 0) << "/proc/stat unreadable";
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
