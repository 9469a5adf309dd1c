// The training loop behind `hybridscan train`: data, steps, optimizer, evaluation, progress, metrics, loss curve.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/memory.h"
#include "dataset/token_source.h"
#include "model/config.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace hs::train {

// The process groups of a multi-process run (mpirun). Parameters, gradients and AdamW moments are sharded over
// `fsdp`; the global batch is split over `world` in rank order (each rank trains on its own rows); the gradient
// shards are summed over `replicas`, the ranks of the other FSDP groups that hold the same shards.
struct Distributed {
  Collectives* world = nullptr;
  Collectives* fsdp = nullptr;
  Collectives* replicas = nullptr;
  // --expert-parallel E: the E consecutive ranks (of an FSDP group) that exchange their tokens' rows.
  Collectives* experts = nullptr;
};

struct TrainOptions {
  std::string model = "small";  // preset name or config.json path
  std::string text;             // corpus: byte tokens, or encoded by `tokenizer` / the --init checkpoint's tokenizer.json
  std::string data;             // corpus: a token file (memory-mapped)
  std::string tokenizer;        // tokenizer.json for `text` (default: the one beside the --init / --resume weights)
  bool synthetic = false;       // random tokens instead of text
  int64_t steps = 200, batch = 8, seq = 256;
  uint64_t seed = 1;
  OptimizerConfig opt;
  StepOptions step;
  // AdamW applied to each gradient shard as soon as the backward completes it (InBackwardAdamW): no gradient set
  // lives across the step. Needs opt.clip == 0 (refused otherwise); the same parameters to the bit as the usual step.
  bool update_in_backward = false;
  // Phase timing (core/profile.h) of every step: a "profile" object in each metrics.jsonl line and, summed over the
  // steady-state steps, TrainSummary::profile. Also switched on by HS_PROFILE=1.
  bool profile = false;
  DType weight_dtype = DType::F32;
  std::string out;              // output directory: metrics.jsonl, loss.svg, checkpoints
  int64_t eval_every = 50, eval_batches = 8;
  double heldout_fraction = 0.02;
  bool progress = true;         // live progress line on stderr
  int64_t save_every = 0;       // write <out>/checkpoint-<step> every N steps (0: only at the end, when --out is set)
  std::string init;             // start from these weights (native or Hugging Face checkpoint directory)
  std::string resume;           // continue a native training checkpoint exactly (weights, moments, step, data order)
  int64_t stop_after = -1;      // stop (and save) after this many steps of the schedule (-1: run to --steps)
  const Distributed* dist = nullptr;  // null: one process
  // --resume takes the compute dtype and the remat policy back from the checkpoint; these say whether the command
  // line named them, in which case they must agree with it (a clear error otherwise).
  bool compute_given = false, remat_given = false, delta_products_given = false;
};

// The options a training checkpoint records, and the ones a resume takes back from it.
nlohmann::json options_to_json(const TrainOptions& o);
void options_from_json(const nlohmann::json& j, TrainOptions& o);

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

// Cross-entropy over `tokens` cut into windows of seq+1 that overlap by one token: the mean in nats per predicted
// token, their count, the bytes of original text they stand for, and bits per byte = total nats / ln 2 / those bytes.
// Sharded parameters: `shards` is their group, whose ranks all evaluate the same windows.
struct EvalResult {
  double ce = 0;
  int64_t count = 0, text_bytes = 0;
  double bits_per_byte = 0;
};
EvalResult evaluate_tokens(const model::ParamSet& params, const dataset::TokenSource& tokens, int64_t seq,
                           int64_t batch, DType compute, MemoryAccountant& mem, int64_t max_batches = -1,
                           Collectives* shards = nullptr);

// Writes an SVG line chart of (x, y) series to `path` (atomically).
struct Series { std::string name, color; std::vector<std::pair<double, double>> points; };
void write_svg_chart(const std::string& path, const std::string& title, const std::string& xlabel,
                     const std::string& ylabel, const std::vector<Series>& series);

}  // namespace hs::train
