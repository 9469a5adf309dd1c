// One training step: the sequence `hybridscan train` runs every step and the planner runs once over shapes. A Step
// owns this rank's parameters and AdamW's moments (the step's arguments) and the gradient set kept between steps;
// run() is, for each micro-batch (train --grad-accum N), its buffer and forward and backward through the schedule
// (train::forward_backward, which adds into the kept set), then once per update the gradients' sum over the
// data-parallel replicas and the update (AdamW after the backward, or InBackwardAdamW inside it). Made on a
// planning-mode MemoryAccountant with virtual collectives and run on a batch without data, the same object gives the
// plan: allocations are virtual and no kernel computes, so "plan == run" holds by construction.
#pragma once
#include <memory>
#include <span>

#include "core/collectives.h"
#include "core/memory.h"
#include "model/config.h"
#include "model/params.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace hs::train {

struct StepOutcome {
  StepResult result;
  double grad_norm = 0;  // the global gradient norm before clipping (0 over shapes)
  double lr = 0;         // the learning rate of this step's update
};

// Refuses (std::invalid_argument) `micro_batches` < 1, and more than one with the update in the backward: that update
// consumes each gradient as the backward completes it, so there is no gradient set to sum N backwards into.
void check_grad_accum(int64_t micro_batches, bool update_in_backward);

class Step {
 public:
  // Parameters stored in `weight_dtype` (this rank's shards when `schedule.comm` has more than one rank) and AdamW's
  // moments, on `mem`. `schedule.update` must be null: with `update_in_backward` each run makes its own
  // InBackwardAdamW sink (which refuses optimizer.clip > 0). `replicas` (null: none) are the ranks that hold the same
  // shards; every gradient is summed over them before the update.
  Step(const model::ModelConfig& cfg, DType weight_dtype, const OptimizerConfig& optimizer, const StepOptions& schedule,
       bool update_in_backward, Collectives* replicas, MemoryAccountant& mem);

  // One step on `b` (inputs and targets may be null over shapes): the batch's buffer (category Batch) is allocated
  // and the accountant's peak reset, so MemoryAccountant::at_peak() afterwards is this step's peak.
  StepOutcome run(const Batch& b) { return run(std::span<const Batch>(&b, 1)); }
  // One update from the micro-batches' gradients summed (gradient accumulation): each micro-batch's buffer lives
  // only while it runs, so the step's peak is one micro-batch's. The loss is the mean over the targets of all of them
  // together: micro-batch i's gradient is weighted by its share c_i / C of the counted targets (c_i summed over the
  // batch group), so N micro-batches of b rows give the update of one batch of their N b rows (to rounding); the MoE
  // load-balance loss is each micro-batch's own, weighted alike. Over shapes only the first two micro-batches run:
  // the rest repeat the second's allocations exactly (the gradient set is live from its start).
  StepOutcome run(std::span<const Batch> micro_batches);

  model::ParamSet& params() { return params_; }
  const model::ParamSet& params() const { return params_; }
  AdamWOptimizer& optimizer() { return adamw_; }
  const StepOptions& schedule() const { return schedule_; }

 private:
  MemoryAccountant& mem_;
  StepOptions schedule_;
  bool update_in_backward_;
  Collectives* replicas_;
  model::ParamSet params_;
  AdamWOptimizer adamw_;
  // One gradient set for the whole run: the update leaves it zeroed, so no step clears it.
  std::unique_ptr<model::ParamSet> grads_;
};

}  // namespace hs::train
