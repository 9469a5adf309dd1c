// The MPI collectives against what they must compute, run by ctest under mpirun (2 and 3 ranks: with 3, no tensor
// size below divides evenly). Every rank runs every test; a failure on any rank fails the job.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "core/memory.h"
#include "model/params.h"
#include "mpi/mpi_collectives.h"
#include "train/schedule.h"

namespace hs::mpi {
namespace {

Runtime* g_rt = nullptr;
MpiCollectives* g_world = nullptr;

// A value that depends on (rank, element) and whose sums are inexact in fp32, so the summation order shows. Made
// once in double and rounded, so that every use sees the same float (an inlined float expression may be contracted
// into an FMA at one call site and not at another).
float contribution(int64_t rank, int64_t i) {
  return static_cast<float>(1.0 / double(3 + 7 * rank + i % 11) + double(i) * 1e-3);
}

TEST(MpiCollectives, AllGatherOfPaddedShardsConvertsToTheComputeDtype) {
  Collectives& c = *g_world;
  for (int64_t n : {1, 5, 7, 64, 1001}) {
    const int64_t s = Collectives::shard_elems(n, c.size());
    std::vector<float> shard(static_cast<size_t>(s), 0.0f);
    for (int64_t i = 0; i < s; ++i)
      if (c.rank() * s + i < n) shard[static_cast<size_t>(i)] = float(c.rank() * s + i) * 0.25f;
    std::vector<float> full(static_cast<size_t>(c.padded_elems(n)), -1.0f);
    c.all_gather(TensorView(shard.data(), DType::F32, {s}), full.data(), DType::F32, n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(full[static_cast<size_t>(i)], float(i) * 0.25f) << "n " << n << " i " << i;
    std::vector<bf16> full16(static_cast<size_t>(c.padded_elems(n)));
    Collectives::Request r = c.start_all_gather(TensorView(shard.data(), DType::F32, {s}), full16.data(), DType::BF16, n);
    r.wait();
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(to_f32(full16[static_cast<size_t>(i)]), to_f32(from_f32<bf16>(float(i) * 0.25f)));
  }
}

TEST(MpiCollectives, ReduceScatterAddsInRankOrder) {
  Collectives& c = *g_world;
  for (int64_t n : {1, 7, 100, 4099}) {
    const int64_t s = Collectives::shard_elems(n, c.size());
    std::vector<float> full(static_cast<size_t>(c.padded_elems(n)), 0.0f);
    for (int64_t i = 0; i < n; ++i) full[static_cast<size_t>(i)] = contribution(c.rank(), i);
    std::vector<float> shard(static_cast<size_t>(s), 0.5f);
    c.reduce_scatter(full.data(), n, shard.data());
    for (int64_t i = 0; i < s; ++i) {
      const int64_t e = c.rank() * s + i;
      float want = 0.5f;
      for (int64_t r = 0; r < c.size(); ++r) want += e < n ? contribution(r, e) : 0.0f;
      ASSERT_EQ(shard[static_cast<size_t>(i)], want) << "n " << n << " element " << e;  // the bits of rank order
    }
  }
}

// Ranges of a flat sharded tensor whose bounds fall anywhere: inside one shard, across shard bounds, covering
// everything, empty, shorter than the number of ranks (rounds of one element a rank), and on a rank that holds none
// of it. The gather gives the elements (converted to bf16 too); the reduce-scatter adds in rank order (the bits of
// shard + rank 0 + rank 1 + ...), over as many rounds as the receive buffer needs.
TEST(MpiCollectives, RangesGatherAndReduceScatterAcrossShardBounds) {
  Collectives& c = *g_world;
  for (int64_t n : {7, 100, 1001}) {
    const int64_t s = Collectives::shard_elems(n, c.size());
    std::vector<float> shard(static_cast<size_t>(s), 0.0f);
    for (int64_t i = 0; i < s; ++i)
      if (c.rank() * s + i < n) shard[static_cast<size_t>(i)] = float(c.rank() * s + i) * 0.25f;
    std::vector<std::pair<int64_t, int64_t>> ranges = {{0, n}, {0, 1}, {n - 1, n}, {n / 3, n / 3}, {1, n - 2},
                                                       {s - 1, s + 1}, {s / 2, std::min(n, 2 * s + 3)}};
    for (auto [b, e] : ranges) {
      if (b > e || e > n) continue;
      const std::string what = "n " + std::to_string(n) + " [" + std::to_string(b) + ", " + std::to_string(e) + ")";
      std::vector<float> out(static_cast<size_t>(e - b) + 1, -1.0f);
      c.start_all_gather_range(TensorView(shard.data(), DType::F32, {s}), n, b, e, out.data(), DType::F32).wait();
      for (int64_t i = b; i < e; ++i) ASSERT_EQ(out[static_cast<size_t>(i - b)], float(i) * 0.25f) << what;
      ASSERT_EQ(out.back(), -1.0f) << what << ": written past the range";
      std::vector<bf16> out16(static_cast<size_t>(e - b) + 1);
      c.start_all_gather_range(TensorView(shard.data(), DType::F32, {s}), n, b, e, out16.data(), DType::BF16).wait();
      for (int64_t i = b; i < e; ++i)
        ASSERT_EQ(to_f32(out16[static_cast<size_t>(i - b)]), to_f32(from_f32<bf16>(float(i) * 0.25f))) << what;

      std::vector<float> full(static_cast<size_t>(e - b));
      for (int64_t i = b; i < e; ++i) full[static_cast<size_t>(i - b)] = contribution(c.rank(), i);
      const std::vector<float> sent = full;
      std::vector<float> acc(static_cast<size_t>(s), 0.5f);
      std::vector<float> scratch(static_cast<size_t>(c.range_scratch_elems(e - b)));
      c.start_reduce_scatter_range(full.data(), n, b, e, acc.data(), scratch.data()).wait();
      ASSERT_EQ(full, sent) << what << ": the contribution was changed";
      for (int64_t i = 0; i < s; ++i) {
        const int64_t el = c.rank() * s + i;
        float want = 0.5f;
        if (el >= b && el < e)
          for (int64_t r = 0; r < c.size(); ++r) want += contribution(r, el);
        ASSERT_EQ(acc[static_cast<size_t>(i)], want) << what << " element " << el;
      }
    }
  }
  // Two ranges in flight at once, waited for in the opposite order.
  const int64_t n = 301, s = Collectives::shard_elems(n, c.size());
  std::vector<float> f1(100), f2(150), acc(static_cast<size_t>(s), 0.0f);
  for (int64_t i = 0; i < 100; ++i) f1[static_cast<size_t>(i)] = contribution(c.rank(), 50 + i);
  for (int64_t i = 0; i < 150; ++i) f2[static_cast<size_t>(i)] = contribution(c.rank(), 150 + i);
  std::vector<float> s1(static_cast<size_t>(c.range_scratch_elems(100)));
  std::vector<float> s2(static_cast<size_t>(c.range_scratch_elems(150)));
  Collectives::Request a = c.start_reduce_scatter_range(f1.data(), n, 50, 150, acc.data(), s1.data());
  Collectives::Request b = c.start_reduce_scatter_range(f2.data(), n, 150, 300, acc.data(), s2.data());
  b.wait();
  a.wait();
  for (int64_t i = 0; i < s; ++i) {
    const int64_t el = c.rank() * s + i;
    float want = 0.0f;
    if (el >= 50 && el < 300)
      for (int64_t r = 0; r < c.size(); ++r) want += contribution(r, el);
    ASSERT_EQ(acc[static_cast<size_t>(i)], want) << "element " << el;
  }
}

// Rank p sends (p + 1) * (q + 1) elements to rank q, taken from a send buffer at per-destination displacements that
// are not in rank order; every element says where it came from.
TEST(MpiCollectives, AllToAllVMovesEachBlockToItsRank) {
  Collectives& c = *g_world;
  const int64_t P = c.size(), me = c.rank();
  for (size_t elem : {size_t{2}, size_t{4}, size_t{8}}) {
    std::vector<int64_t> sc, sd, rc, rd;
    int64_t at = 0;
    for (int64_t q = P; q-- > 0;) {  // blocks laid out for the last rank first
      sc.insert(sc.begin(), (me + 1) * (q + 1));
      sd.insert(sd.begin(), at);
      at += (me + 1) * (q + 1) + 3;  // and a gap between them
    }
    std::vector<int64_t> send(static_cast<size_t>(at), -1);
    for (int64_t q = 0; q < P; ++q)
      for (int64_t i = 0; i < sc[size_t(q)]; ++i) send[size_t(sd[size_t(q)] + i)] = (me * 100 + q) * 1000 + i;
    int64_t r_at = 0;
    for (int64_t p = 0; p < P; ++p) {
      rc.push_back((p + 1) * (me + 1));
      rd.push_back(r_at);
      r_at += rc.back();
    }
    // Elements of `elem` bytes: the payload narrowed to that many bytes each.
    std::vector<char> sbuf(send.size() * elem), rbuf(static_cast<size_t>(r_at) * elem, 0);
    for (size_t i = 0; i < send.size(); ++i) std::memcpy(sbuf.data() + i * elem, &send[i], elem);
    c.all_to_all_v(sbuf.data(), sc, sd, rbuf.data(), rc, rd, elem);
    for (int64_t p = 0; p < P; ++p)
      for (int64_t i = 0; i < rc[size_t(p)]; ++i) {
        const int64_t want = (p * 100 + me) * 1000 + i;
        int64_t got = 0, masked = 0;  // the low `elem` bytes (little-endian)
        std::memcpy(&got, rbuf.data() + size_t(rd[size_t(p)] + i) * elem, elem);
        std::memcpy(&masked, &want, elem);
        ASSERT_EQ(got, masked) << "from rank " << p << " element " << i << " (" << elem << "-byte elements)";
      }
  }
}

// Each rank's blocks go to destinations of the receiver's choosing; ranks aimed at the same destination are added in
// rank order (expert parallelism's gradient scatter: the owners of one expert sum into its shard).
TEST(MpiCollectives, ReduceScatterToAddsIntoChosenDestinationsInRankOrder) {
  Collectives& c = *g_world;
  const int64_t P = c.size();
  for (int64_t n : {1, 7, 100, 4099}) {
    const int64_t s = Collectives::shard_elems(n, P);
    std::vector<float> full(static_cast<size_t>(c.padded_elems(n)), 0.0f);
    for (int64_t i = 0; i < n; ++i) full[static_cast<size_t>(i)] = contribution(c.rank(), i);
    // Two destinations: even senders into a, odd senders into b.
    std::vector<float> a(static_cast<size_t>(s), 0.5f), b(static_cast<size_t>(s), 0.25f);
    std::vector<float*> dest;
    for (int64_t p = 0; p < P; ++p) dest.push_back(p % 2 ? b.data() : a.data());
    c.start_reduce_scatter_to(full.data(), n, dest).wait();
    for (int64_t i = 0; i < s; ++i) {
      const int64_t e = c.rank() * s + i;
      float wa = 0.5f, wb = 0.25f;
      for (int64_t p = 0; p < P; ++p) (p % 2 ? wb : wa) += e < n ? contribution(p, e) : 0.0f;
      ASSERT_EQ(a[size_t(i)], wa) << "n " << n << " element " << e;
      ASSERT_EQ(b[size_t(i)], wb) << "n " << n << " element " << e;
    }
  }
}

TEST(MpiCollectives, OverlappingRequestsCompleteInAnyWaitOrder) {
  Collectives& c = *g_world;
  const int64_t n = 513, s = Collectives::shard_elems(n, c.size());
  std::vector<float> shard(static_cast<size_t>(s), float(c.rank() + 1));
  std::vector<float> a(static_cast<size_t>(c.padded_elems(n))), b(a.size());
  std::vector<float> grad(a.size(), 1.0f), gshard(static_cast<size_t>(s), 0.0f);
  Collectives::Request ra = c.start_all_gather(TensorView(shard.data(), DType::F32, {s}), a.data(), DType::F32, n);
  Collectives::Request rs = c.start_reduce_scatter(grad.data(), n, gshard.data());
  Collectives::Request rb = c.start_all_gather(TensorView(shard.data(), DType::F32, {s}), b.data(), DType::F32, n);
  rb.wait();
  rs.wait();
  ra.wait();
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(a[static_cast<size_t>(i)], float(i / s + 1));
    ASSERT_EQ(b[static_cast<size_t>(i)], float(i / s + 1));
  }
  for (int64_t i = 0; i < s; ++i) ASSERT_EQ(gshard[static_cast<size_t>(i)], float(c.size()));
}

TEST(MpiCollectives, SumsAndBroadcast) {
  Collectives& c = *g_world;
  double x[3] = {1.0, double(c.rank()), 0.1};
  c.all_reduce_sum(x, 3);
  EXPECT_EQ(x[0], double(c.size()));
  EXPECT_EQ(x[1], double(c.size() * (c.size() - 1) / 2));
  double want = 0;
  for (int64_t r = 0; r < c.size(); ++r) want += 0.1;
  EXPECT_EQ(x[2], want);
  std::vector<float> v(37);
  for (size_t i = 0; i < v.size(); ++i) v[i] = contribution(c.rank(), int64_t(i));
  c.all_reduce_sum(v.data(), int64_t(v.size()));
  for (size_t i = 0; i < v.size(); ++i) {
    float w = 0;
    for (int64_t r = 0; r < c.size(); ++r) w += contribution(r, int64_t(i));
    ASSERT_EQ(v[i], w);
  }
  uint64_t token = c.rank() == 0 ? 0x1234abcdull : 0;
  c.broadcast(&token, sizeof token, 0);
  EXPECT_EQ(token, 0x1234abcdull);
  EXPECT_GE(c.exposed_seconds(), 0.0);
}

TEST(MpiCollectives, ShardsOfAParamSetGatherBackToTheFullSet) {
  Collectives& c = *g_world;
  const model::ModelConfig cfg = model::preset("tiny");
  MemoryAccountant mem;
  model::ParamSet full(cfg, DType::BF16, mem, MemCategory::Parameters, false);
  model::init_params(full, 7);
  model::ParamSet shard(cfg, DType::BF16, mem, MemCategory::Parameters, false, c.size());
  model::copy_shard(full, shard, c.rank());
  model::ParamSet back(cfg, DType::BF16, mem, MemCategory::Parameters, true);
  model::gather_full(shard, back, c);
  for (size_t t = 0; t < full.all().size(); ++t)
    ASSERT_EQ(std::memcmp(full.all()[t].tensor.data(), back.all()[t].tensor.data(), full.all()[t].tensor.nbytes()), 0)
        << full.all()[t].name;
}

// The replicas' gradient all-reduce (--fsdp G < world) goes through an accounted scratch: its measured peak over the
// gradients is the planned one (a planning accountant and a virtual group of the same size), and every gradient
// becomes the rank-order sum.
TEST(MpiCollectives, ReplicaSumIsAccountedAsPlanned) {
  Collectives& c = *g_world;
  const model::ModelConfig cfg = model::preset("tiny");
  MemoryAccountant mem;
  model::ParamSet grads(cfg, DType::F32, mem, MemCategory::Gradients, false);
  for (auto& g : grads.all())
    for (int64_t i = 0; i < g.tensor.numel(); ++i) g.tensor.as<float>()[i] = contribution(c.rank(), i);
  mem.reset_peak();
  train::sum_over_replicas(grads, c, mem);
  const size_t measured = mem.peak_total() - mem.live_total();
  MemoryAccountant plan_mem(/*planning=*/true);
  model::ParamSet planned_grads(cfg, DType::F32, plan_mem, MemCategory::Gradients, false);
  plan_mem.reset_peak();
  VirtualCollectives replicas(c.size());
  train::sum_over_replicas(planned_grads, replicas, plan_mem);
  EXPECT_EQ(measured, plan_mem.peak_total() - plan_mem.live_total());
  EXPECT_GT(measured, 0u);
  for (auto& g : grads.all())
    for (int64_t i = 0; i < g.tensor.numel(); ++i) {
      float want = 0;
      for (int64_t r = 0; r < c.size(); ++r) want += contribution(r, i);
      ASSERT_EQ(g.tensor.as<float>()[i], want) << g.name << " " << i;
    }
}

TEST(MpiCollectives, GroupsSplitTheWorld) {
  if (g_rt->world_size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  Groups g = make_groups(*g_rt, 2);
  EXPECT_EQ(g.fsdp->size(), 2);
  EXPECT_EQ(g.fsdp->rank(), g_rt->world_rank() % 2);
  EXPECT_EQ(g.replicas->size(), g_rt->world_size() / 2);
  EXPECT_EQ(g.replicas->rank(), g_rt->world_rank() / 2);
  EXPECT_THROW(make_groups(*g_rt, 3), std::invalid_argument);
  // Expert parallelism: E consecutive ranks exchange tokens; E must divide the FSDP group.
  Groups e = make_groups(*g_rt, 2, 2);
  ASSERT_TRUE(e.experts);
  EXPECT_EQ(e.experts->size(), 2);
  EXPECT_EQ(e.experts->rank(), g_rt->world_rank() % 2);
  EXPECT_EQ(make_groups(*g_rt, 2).experts->size(), 1);
  EXPECT_THROW(make_groups(*g_rt, 2, 4), std::invalid_argument);
}

}  // namespace
}  // namespace hs::mpi

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  hs::mpi::Runtime rt(&argc, &argv);
  hs::mpi::g_rt = &rt;
  int rc = 0;
  {
    std::unique_ptr<hs::mpi::MpiCollectives> world = hs::mpi::MpiCollectives::split(rt, 0, "world");
    hs::mpi::g_world = world.get();
    // Only rank 0 prints the test report; every rank's result counts.
    if (rt.world_rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
    }
    rc = RUN_ALL_TESTS();
    double failed = rc != 0 ? 1.0 : 0.0;
    world->all_reduce_sum(&failed, 1);
    rc = failed > 0 ? 1 : 0;
  }
  return rc;
}
