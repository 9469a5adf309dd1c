// The options of a training run (hybridscan train), what a checkpoint records of them and takes back on --resume,
// and the check that every rank of a multi-process run was started with the same ones.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "core/collectives.h"
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
  // corpus: a chat file (JSONL), rendered with `chat_template` (default: the --init / --resume checkpoint's) and
  // tokenized with the loss mask of `loss_on` (train::load_chat_tokens); conversations longer than `seq` dropped.
  std::string chat;
  std::string chat_template;    // a .jinja file, tokenizer_config.json or checkpoint directory ("": the checkpoint's)
  std::string loss_on = "assistant";
  bool skip_bad_lines = false;  // chat files: skip (count, report) bad lines instead of stopping
  int64_t steps = 200, batch = 8, seq = 256;
  // Micro-batches of `batch` sequences whose gradients are summed into each update (--grad-accum): an update sees
  // batch * grad_accum sequences with the memory of `batch`.
  int64_t grad_accum = 1;
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
  // Held-out data evaluated every eval_every steps instead of the last heldout_fraction of the training data: a token
  // file or a text in the training data's ids (train::load_eval_tokens).
  std::string eval_data;
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
// Every rank must run the same command: rank 0's options and model are compared with each rank's before any step
// (std::invalid_argument on every rank otherwise).
void check_same_run(const TrainOptions& o, const model::ModelConfig& cfg, Collectives& world);

}  // namespace hs::train
