// One decode step of a checkpoint, its weights mapped (--weights-memory map) and copied (copy) in the same process,
// steps alternated between the two so that the machine's load drifts over both alike; and the LM head's product
// alone from each (the fused step's split: chunks of 1 MiB taken as threads come free), so the step's time splits
// into the LM head and the rest. Per step: wall ms, and CPU ms (the threads' mean CPU time: on a loaded machine a
// descheduled thread's wait shows in the wall time only). Best and median of --steps. Not a test.
//   build/bench/decode_step_bench --checkpoint DIR [--batch 1] [--steps 40] [--context 64]
// --prefill N instead profiles prefills of an N-token prompt (mapped weights; best of --steps prefills, their
// wall time split by the profiler's labels, core/profile.h; the split of the fastest one).
//   build/bench/decode_step_bench --checkpoint DIR --prefill 512 [--steps 5] [--cold]
// (--cold: the split of the first prefill instead, which makes the products' primitives and touches fresh pages).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/convert.h"
#include "core/profile.h"
#include "infer/decoder.h"
#include "infer/fused_step.h"
#include "infer/weights.h"
#include "kernels/gemv.h"

namespace {

using namespace hs;
using Clock = std::chrono::steady_clock;

double thread_cpu() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

struct Times {
  std::vector<double> wall, cpu;
  void add(double w, double c) { wall.push_back(w), cpu.push_back(c); }
  static double best(std::vector<double> v) { return *std::min_element(v.begin(), v.end()); }
  static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }
};

// The threads' mean CPU seconds over f() (f runs on the calling thread; its own parallel regions reuse the pool, so
// each pool thread's CPU time is read at the start and end of a region around it).
template <typename F> std::pair<double, double> timed(F&& f) {
  const int nt = omp_get_max_threads();
  std::vector<double> c0(static_cast<size_t>(nt)), c1(static_cast<size_t>(nt));
#pragma omp parallel
  c0[static_cast<size_t>(omp_get_thread_num())] = thread_cpu();
  const auto t0 = Clock::now();
  f();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
#pragma omp parallel
  c1[static_cast<size_t>(omp_get_thread_num())] = thread_cpu();
  double cpu = 0;
  for (int t = 0; t < nt; ++t) cpu += c1[static_cast<size_t>(t)] - c0[static_cast<size_t>(t)];
  return {wall, cpu / nt};
}

template <typename T> void lm_head(const model::ParamSet& ps, const T* x, float* y, int64_t M) {
  const TensorView& head = ps.global(model::g::kLmHead);
  const int64_t V = head.shape[0], H = head.shape[1];
  const kernels::cpu::Level isa = kernels::gemv_level();
  const int64_t align = kernels::gemv_row_align(M, isa);
  const int64_t rows = std::max<int64_t>(align, (int64_t{1} << 20) / (H * int64_t(sizeof(T))) / align * align);
  const int64_t chunks = (V + rows - 1) / rows;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; ++c)
    kernels::gemv_rows(x, static_cast<const T*>(head.data), y, M, V, H, 0, 0, c * rows, std::min(V, (c + 1) * rows),
                       isa);
}

}  // namespace

int main(int argc, char** argv) {
  std::string ck;
  int64_t batch = 1, steps = 40, context = 64, prefill = 0;
  bool cold = false;  // --cold: the split of the first prefill (primitives made, pages touched: what a user's prompt gets)
  std::vector<char*> args{argv[0]};
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--cold") cold = true;
    else args.push_back(argv[i]);
  argc = int(args.size());
  argv = args.data();
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--checkpoint") ck = argv[i + 1];
    else if (a == "--batch") batch = std::atoll(argv[i + 1]);
    else if (a == "--steps") steps = std::atoll(argv[i + 1]);
    else if (a == "--context") context = std::atoll(argv[i + 1]);
    else if (a == "--prefill") prefill = std::atoll(argv[i + 1]);
    else ck.clear(), i = argc;
  }
  if (ck.empty() || (cold && prefill <= 0) || batch < 1 || batch > kernels::kGemvMaxRows || steps < 1 || context < 1) {
    std::fprintf(stderr,
                 "usage: %s --checkpoint DIR [--batch 1..16] [--steps N] [--context N]\n"
                 "       %s --checkpoint DIR --prefill N [--steps N] [--cold]\n",
                 argv[0], argv[0]);
    return 2;
  }
  const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(ck);
  if (prefill > 0) {
    MemoryAccountant mem;
    auto w = infer::load_weights(d, std::nullopt, mem, infer::WeightsMemory::Map);
    const model::ParamSet& ps = *w->params;
    const int64_t V = ps.config().vocab;
    infer::Decoder dec(ps, ps.global(model::g::kLmHead).dtype, 1, prefill + 1, mem);
    std::vector<int32_t> prompt(static_cast<size_t>(prefill));
    for (int64_t i = 0; i < prefill; ++i) prompt[size_t(i)] = int32_t((i * 7919 + 3) % V);
    std::vector<float> lg(static_cast<size_t>(V));
    double best = 1e30, first = 0;
    profile::Totals best_t, first_t;
    for (int64_t r = 0; r <= steps; ++r) {
      dec.reset(0);
      profile::Session session;
      const auto t0 = Clock::now();
      dec.prefill(0, prompt, lg.data());
      const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
      if (r == 0) first = wall, first_t = session.totals();
      else if (wall < best) best = wall, best_t = session.totals();
    }
    std::printf("%s: prefill of %lld tokens, %d threads: first %.1f ms (%.0f tokens/s), best %.1f ms (%.0f tokens/s); "
                "by label (%s):\n",
                ck.c_str(), (long long)prefill, omp_get_max_threads(), 1e3 * first, double(prefill) / first,
                1e3 * best, double(prefill) / best, cold ? "first" : "best");
    if (cold) best_t = first_t;
    std::sort(best_t.labels.begin(), best_t.labels.end(),
              [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
    for (const auto& l : best_t.labels)
      std::printf("  %-40s %-14s %8.2f ms %5.1f%% %6llu calls\n", l.name.c_str(),
                  std::string(profile::phase_name(l.phase)).c_str(), 1e3 * l.seconds,
                  100 * l.seconds / best_t.wall_seconds, (unsigned long long)l.calls);
    std::printf("  matmul shapes (by time):\n");
    std::sort(best_t.matmul_shapes.begin(), best_t.matmul_shapes.end(),
              [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
    for (size_t i = 0; i < best_t.matmul_shapes.size() && i < 12; ++i) {
      const auto& m = best_t.matmul_shapes[i];
      std::printf("  %5lld x %5lld x %5lld%s%s %8.2f ms %4llu calls %6.1f GFLOP/s\n", (long long)m.shape.M,
                  (long long)m.shape.N, (long long)m.shape.K, m.shape.trans_b ? " (B^T)" : "",
                  m.shape.varying_rows ? " (varying)" : "", 1e3 * m.seconds, (unsigned long long)m.calls,
                  2.0 * m.shape.M * m.shape.N * m.shape.K * m.calls / m.seconds * 1e-9);
    }
    return 0;
  }
  struct Engine {
    const char* name;
    MemoryAccountant mem;
    std::unique_ptr<infer::InferenceWeights> w;
    std::unique_ptr<infer::Decoder> dec;
    Times step, head;
  };
  Engine e[2];
  e[0].name = "map";
  e[1].name = "copy";
  std::vector<int32_t> slots(static_cast<size_t>(batch)), ids(static_cast<size_t>(batch));
  std::vector<float> logits;
  for (int k = 0; k < 2; ++k) {
    e[k].w = infer::load_weights(d, std::nullopt, e[k].mem, k ? infer::WeightsMemory::Copy : infer::WeightsMemory::Map);
    const model::ParamSet& ps = *e[k].w->params;
    const DType dt = ps.global(model::g::kLmHead).dtype;
    e[k].dec = std::make_unique<infer::Decoder>(ps, dt, batch, context + 2 * steps + 8, e[k].mem);
    const int64_t V = ps.config().vocab;
    logits.resize(static_cast<size_t>(batch * V));
    std::vector<int32_t> prompt(static_cast<size_t>(context));
    for (int64_t s = 0; s < batch; ++s) {
      for (int64_t i = 0; i < context; ++i) prompt[size_t(i)] = int32_t((i * 7919 + s * 104729) % V);
      e[k].dec->prefill(s, prompt, logits.data());
      slots[size_t(s)] = int32_t(s);
    }
  }
  const model::ParamSet& ps0 = *e[0].w->params;
  const int64_t V = ps0.config().vocab, H = ps0.config().hidden;
  const bool bf = ps0.global(model::g::kLmHead).dtype == DType::BF16;
  std::vector<bf16> xb(size_t(batch * H), bf16(0.25f));
  std::vector<float> xf(size_t(batch * H), 0.25f);
  for (int64_t it = -2; it < steps; ++it)  // two warm-up rounds
    for (Engine& g : e) {
      for (int64_t s = 0; s < batch; ++s) ids[size_t(s)] = int32_t(((it + 8) * 31 + s * 17 + 5) % V);
      const auto st = timed([&] { g.dec->step(slots, ids, logits.data()); });
      const model::ParamSet& ps = *g.w->params;
      const auto hd = timed([&] {
        if (bf) lm_head(ps, xb.data(), logits.data(), batch);
        else lm_head(ps, xf.data(), logits.data(), batch);
      });
      if (it < 0) continue;
      g.step.add(st.first, st.second);
      g.head.add(hd.first, hd.second);
    }
  const double head_bytes = double(ps0.global(model::g::kLmHead).nbytes());
  std::printf("%s: batch %lld, context %lld, %d threads, %lld steps each, alternated; fused step: %s\n", ck.c_str(),
              (long long)batch, (long long)context, omp_get_max_threads(), (long long)steps,
              e[0].dec->fused() ? "yes" : "no");
  std::printf("%-5s %-26s %-26s %-22s %s\n", "", "step ms best/median wall", "step ms best/median cpu",
              "LM head ms wall/cpu", "LM head GB/s (best wall)");
  for (Engine& g : e)
    std::printf("%-5s %12.2f / %-11.2f %12.2f / %-11.2f %9.2f / %-10.2f %.1f\n", g.name, 1e3 * Times::best(g.step.wall),
                1e3 * Times::median(g.step.wall), 1e3 * Times::best(g.step.cpu), 1e3 * Times::median(g.step.cpu),
                1e3 * Times::best(g.head.wall), 1e3 * Times::best(g.head.cpu),
                head_bytes / Times::best(g.head.wall) * 1e-9);
  if (e[1].dec->fused()) {
    // Where a copied step's wall time goes, phase by phase (thread 0's view, summed over --steps more steps).
    infer::fused_step_timing(true);
    const auto t0 = Clock::now();
    for (int64_t it = 0; it < steps; ++it) {
      for (int64_t s = 0; s < batch; ++s) ids[size_t(s)] = int32_t(((it + 3) * 37 + s * 11 + 1) % V);
      e[1].dec->step(slots, ids, logits.data());
    }
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    auto times = infer::fused_step_phase_times();
    infer::fused_step_timing(false);
    std::sort(times.begin(), times.end(), [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
    std::printf("copy, fused step phases over %lld more steps (%.2f ms a step):\n", (long long)steps, 1e3 * wall / steps);
    double phases = 0;
    for (const auto& t : times) {
      phases += t.seconds;
      std::printf("  %-24s %8.3f ms a step %5.1f%% %5lld a step\n", t.name.c_str(), 1e3 * t.seconds / steps,
                  100 * t.seconds / wall, (long long)(t.count / steps));
    }
    std::printf("  %-24s %8.3f ms a step %5.1f%% (around the parallel region: the step's workspace, the call)\n",
                "outside the phases", 1e3 * (wall - phases) / steps, 100 * (wall - phases) / wall);
  }
  return 0;
}
