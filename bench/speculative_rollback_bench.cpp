// Roll-back of the recurrent part in speculative decoding: snapshots (what Decoder::verify / accept do: the conv window
// and delta-rule state after every verified position kept in a slot of its own, one copy back on accept) against a
// recompute (save the state before the step, restore it after a rejection and feed the kept positions again), on a
// checkpoint's weights. Prints the median wall time of: a plain one-row decode step; a verification of n = 1..4
// positions (n - 1 state copies inside it) + accept; one copy of a slot's recurrent part (what accept copies, what a
// recompute saves and restores). Not a test.
//   build/bench/speculative_rollback_bench --checkpoint DIR [--steps 200] [--context 64]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint/convert.h"
#include "infer/decoder.h"
#include "infer/weights.h"

using namespace hs;
using Clock = std::chrono::steady_clock;

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  std::string ck;
  int64_t steps = 200, context = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--checkpoint") ck = argv[i + 1];
    else if (a == "--steps") steps = std::atoll(argv[i + 1]);
    else if (a == "--context") context = std::atoll(argv[i + 1]);
  }
  if (ck.empty()) {
    std::fprintf(stderr, "usage: speculative_rollback_bench --checkpoint DIR [--steps 200] [--context 64]\n");
    return 2;
  }
  MemoryAccountant mem;
  const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(ck);
  auto w = infer::load_weights(d, std::nullopt, mem, infer::WeightsMemory::Copy);
  const model::ParamSet& ps = *w->params;
  const DType dt = ps.global(model::g::kLmHead).dtype;
  const int64_t V = ps.config().vocab, cap = context + 10 * steps + 8;
  std::vector<int32_t> prompt(static_cast<size_t>(context));
  for (int64_t i = 0; i < context; ++i) prompt[static_cast<size_t>(i)] = static_cast<int32_t>((i * 37 + 11) % V);
  std::vector<float> lg(static_cast<size_t>(4 * V));
  infer::Decoder plain(ps, dt, 1, cap, mem);
  infer::Decoder dec(ps, dt, 1, cap, mem, 512, nullptr, 3);
  plain.prefill(0, prompt, lg.data());
  dec.prefill(0, prompt, lg.data());
  const std::vector<int32_t> slot{0};
  std::vector<double> t_step, t_copy;
  std::vector<std::vector<double>> t_verify(4);
  std::vector<char> buf(dec.recurrent_bytes_per_slot());
  for (int64_t s = 0; s < steps; ++s) {
    const int32_t id = static_cast<int32_t>((s * 13 + 5) % V);
    auto t0 = Clock::now();
    plain.step(slot, std::vector<int32_t>{id}, lg.data());
    t_step.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    for (int64_t n = 1; n <= 4; ++n) {
      std::vector<int32_t> ids(static_cast<size_t>(n), id);
      t0 = Clock::now();
      dec.verify(slot, n, ids, lg.data());
      dec.accept(0, n);  // n kept: the accept copy happens (n > 1)
      t_verify[static_cast<size_t>(n - 1)].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    t0 = Clock::now();
    dec.save_recurrent(0, buf.data());
    t_copy.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::printf("recurrent part per slot: %.1f KiB\n", double(dec.recurrent_bytes_per_slot()) / 1024);
  std::printf("plain step (1 row):           %8.1f us\n", 1e6 * median(t_step));
  for (int64_t n = 1; n <= 4; ++n)
    std::printf("verify n=%lld + accept(%lld):     %8.1f us  (%lld in-step state copies + %d accept copy)\n",
                (long long)n, (long long)n, 1e6 * median(t_verify[static_cast<size_t>(n - 1)]), (long long)(n - 1),
                n > 1 ? 1 : 0);
  std::printf("one recurrent-part copy:      %8.1f us\n", 1e6 * median(t_copy));
  std::printf("snapshots cost per step of n positions: (n - 1) + 1 copies; a recompute instead costs a save and, on "
              "a rejection, a restore + a step of the kept positions (~ the plain step above)\n");
  return 0;
}
