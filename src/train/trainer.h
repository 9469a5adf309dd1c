// The training loop behind `hybridscan train`: data, steps, checkpoints, evaluation, progress, metrics, loss curve.
#pragma once
#include <cstdint>
#include <ostream>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/memory.h"
#include "train/run_options.h"

namespace hs::train {

struct TrainSummary {
  int64_t steps = 0, tokens = 0;
  double final_loss = 0, final_ce = 0, eval_ce = -1, eval_bits_per_byte = -1;
  double tokens_per_s = 0, seconds = 0;
  MemorySnapshot peak;          // the largest step peak (live bytes per category then)
  size_t argument_bytes = 0, temp_bytes = 0, peak_bytes = 0;
  std::vector<double> losses;   // per step run here
  double comm_exposed_s = 0;    // steady-state steps: seconds this rank waited for communication
  double step_s = 0;            // steady-state steps: seconds
  // With TrainOptions::profile: seconds and calls per phase, matmul FLOPs, page faults and the steps' own wall time,
  // summed over the steady-state steps (all steps when only one ran); null otherwise.
  nlohmann::json profile;
};

TrainSummary run_training(const TrainOptions& o, std::ostream& log);

}  // namespace hs::train
