#include <gtest/gtest.h>

#include "core/compute.h"
#include "core/memory.h"
#include "core/tensor.h"

namespace hs {

TEST(MemoryAccountant, TracksLiveAndPeakPerCategory) {
  MemoryAccountant mem;
  {
    Buffer p = mem.allocate(1000, MemCategory::Parameters, "w");
    Buffer a = mem.allocate(300, MemCategory::Activations, "x");
    EXPECT_EQ(mem.live(MemCategory::Parameters), 1000u);
    EXPECT_EQ(mem.live_total(), 1300u);
    {
      Buffer t = mem.allocate(500, MemCategory::Workspace, "tmp");
      EXPECT_EQ(mem.peak_total(), 1800u);
    }
    EXPECT_EQ(mem.live_total(), 1300u);
    EXPECT_EQ(mem.peak_total(), 1800u);
    auto snap = mem.at_peak();
    EXPECT_EQ(snap.argument(), 1000u);
    EXPECT_EQ(snap.temp(), 800u);
    ASSERT_FALSE(snap.largest.empty());
    EXPECT_EQ(snap.largest[0].tag, "w");
  }
  EXPECT_EQ(mem.live_total(), 0u);
}

TEST(MemoryAccountant, PlanningModeCountsTheSameWithoutMemory) {
  MemoryAccountant real(false), plan(true);
  for (MemoryAccountant* m : {&real, &plan}) {
    Buffer a = m->allocate(size_t(1) << 20, MemCategory::Gradients, "g");
    Tensor t = Tensor::empty(*m, MemCategory::Activations, DType::BF16, {128, 64}, "act");
    Buffer b = m->allocate(12345, MemCategory::Workspace, "ws");
  }
  EXPECT_EQ(real.peak_total(), plan.peak_total());
  EXPECT_EQ(real.peak(MemCategory::Activations), 128u * 64u * 2u);
  // A planned allocation of far more than this machine has touches nothing.
  Buffer huge = plan.allocate(size_t(1) << 50, MemCategory::Parameters, "huge");
  EXPECT_EQ(huge.data(), nullptr);
  EXPECT_EQ(plan.live(MemCategory::Parameters), size_t(1) << 50);
}

TEST(MemoryAccountant, ComputeRunsOnlyOverRealBuffers) {
  MemoryAccountant real(false), plan(true);
  int calls = 0;
  EXPECT_EQ(compute(real, [&] { return ++calls; }), 1);
  EXPECT_EQ(compute(plan, [&] { return ++calls; }), 0);  // skipped: a value-initialised result
  compute(real, [&] { ++calls; });
  compute(plan, [&] { ++calls; });
  EXPECT_EQ(calls, 2);
}

TEST(MemoryAccountant, MovedBufferReleasesOnce) {
  MemoryAccountant mem;
  Buffer a = mem.allocate(64, MemCategory::Workspace, "a");
  Buffer b = std::move(a);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(mem.live_total(), 64u);
  b.reset();
  EXPECT_EQ(mem.live_total(), 0u);
}

TEST(ParseBytes, UnitsAndErrors) {
  EXPECT_EQ(parse_bytes("95GiB"), size_t(95) << 30);
  EXPECT_EQ(parse_bytes("80GB"), size_t(80000000000));
  EXPECT_EQ(parse_bytes("1024"), 1024u);
  EXPECT_THROW(parse_bytes("12 parsecs"), std::invalid_argument);
  EXPECT_THROW(parse_bytes("lots"), std::invalid_argument);
}

}  // namespace hs
