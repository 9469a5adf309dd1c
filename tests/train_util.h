// The training tests' common starting point: a short, quiet run of `tiny` on random tokens.
#pragma once
#include <cstdint>

#include "train/trainer.h"

namespace hs::train {

inline TrainOptions tiny_synthetic_run(int64_t steps, int64_t seq) {
  TrainOptions o;
  o.model = "tiny";
  o.synthetic = true;
  o.steps = steps;
  o.batch = 2;
  o.seq = seq;
  o.opt.warmup = 2;
  o.progress = false;
  return o;
}

}  // namespace hs::train
