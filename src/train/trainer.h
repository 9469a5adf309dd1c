// The training loop behind `hybridscan train`: data, steps, optimizer, evaluation, progress, metrics, loss curve.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>

#include "core/memory.h"
#include "model/config.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace hs::train {

struct TrainOptions {
  std::string model = "small";  // preset name or config.json path
  std::string text;             // corpus (byte tokens)
  bool synthetic = false;       // random tokens instead of text
  int64_t steps = 200, batch = 8, seq = 256;
  uint64_t seed = 1;
  OptimizerConfig opt;
  StepOptions step;
  DType weight_dtype = DType::F32;
  std::string out;              // output directory: metrics.jsonl, loss.svg, checkpoints
  int64_t eval_every = 50, eval_batches = 8;
  double heldout_fraction = 0.02;
  bool progress = true;         // live progress line on stderr
};

struct TrainSummary {
  int64_t steps = 0, tokens = 0;
  double final_loss = 0, final_ce = 0, eval_ce = -1;
  double tokens_per_s = 0, seconds = 0;
  MemorySnapshot peak;          // the largest step peak (live bytes per category then)
  size_t argument_bytes = 0, temp_bytes = 0, peak_bytes = 0;
};

TrainSummary run_training(const TrainOptions& o, std::ostream& log);

// Mean cross-entropy (nats) and count over `tokens` cut into windows of seq+1 that overlap by one token.
struct EvalResult { double ce = 0; int64_t count = 0; };
EvalResult evaluate_tokens(const model::ParamSet& params, const std::vector<int32_t>& tokens, int64_t seq,
                           int64_t batch, DType compute, MemoryAccountant& mem, int64_t max_batches = -1);

// Writes an SVG line chart of (x, y) series to `path` (atomically).
struct Series { std::string name, color; std::vector<std::pair<double, double>> points; };
void write_svg_chart(const std::string& path, const std::string& title, const std::string& xlabel,
                     const std::string& ylabel, const std::vector<Series>& series);

}  // namespace hs::train
