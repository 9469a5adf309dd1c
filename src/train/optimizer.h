// AdamW over a ParamSet (or this rank's shards of one: the moments are sharded alike) with fp32 or bf16 moments,
// global-norm gradient clipping, and the learning-rate schedules (warmup, then constant, cosine, linear or WSD).
#pragma once
#include <cstdint>
#include <string>

#include "model/params.h"
#include "train/schedule.h"

namespace hs::train {

// The learning rate over the run (train --lr-schedule; docs/training.md has the formulas). Each starts with `warmup`
// steps rising linearly to `lr`. constant: lr. cosine / linear: from lr down to min_lr over decay_steps (default:
// the steps after the warmup), then min_lr. wsd (warmup-stable-decay): lr until the last decay_steps steps (default:
// wsd_decay_fraction of all the steps), which fall linearly to min_lr.
enum class LrSchedule { Constant, Cosine, Linear, Wsd };
std::string lr_schedule_name(LrSchedule s);
LrSchedule parse_lr_schedule(const std::string& s);  // throws std::invalid_argument

struct OptimizerConfig {
  double lr = 3e-3;
  LrSchedule schedule = LrSchedule::Cosine;
  double min_lr = -1;          // where the decay ends; < 0: lr / 10
  int64_t warmup = 20;
  int64_t decay_steps = 0;     // the decay's length; 0: the schedule's default (above)
  double wsd_decay_fraction = 0.2;
  int64_t total_steps = 1000;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;  // on matrices and embeddings only
  double clip = 1.0;          // max global gradient norm (0 = off)
  // AdamW moments stored in fp32 or bf16 (computed in fp32 each step, stored rounded to nearest even): bf16 saves
  // 4 bytes a parameter of the optimizer state.
  DType moment_dtype = DType::F32;
};

// min_lr with its default resolved.
double min_lr_of(const OptimizerConfig& c);
// Refuses (std::invalid_argument) a schedule that cannot run: a negative warmup or decay, min_lr above lr, a WSD
// decay fraction outside (0, 1].
void check_lr_schedule(const OptimizerConfig& c);
// One line for logs: the schedule, its peak and end, and where the decay runs.
std::string describe_lr_schedule(const OptimizerConfig& c);
// Learning rate of the update at 0-based `step` (the schedule above; total_steps is the run's --steps).
double lr_at(const OptimizerConfig& c, int64_t step);

class AdamWOptimizer {
 public:
  AdamWOptimizer(const model::ParamSet& params, const OptimizerConfig& cfg, MemoryAccountant& mem);
  // Clips `grads` to the configured global norm, updates `params` and leaves `grads` zeroed (ready to
  // accumulate the next step's gradients); returns the norm before clipping. Sharded sets: `shards` is the group
  // holding the other shards, over which the squared norm is summed.
  double step(model::ParamSet& params, model::ParamSet& grads, Collectives* shards = nullptr);
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t s) { step_ = s; }
  model::ParamSet& first_moment() { return m_; }
  model::ParamSet& second_moment() { return v_; }
  const OptimizerConfig& config() const { return cfg_; }

 private:
  friend class InBackwardAdamW;
  OptimizerConfig cfg_;
  model::ParamSet m_, v_;
  int64_t step_ = 0;
};

// Refuses (std::invalid_argument) what AdamW applied inside the backward cannot give exactly: global-norm clipping
// (clip > 0). AdamW is not invariant to the gradient's scale, so the clip factor must be known before the first
// update, and the global norm is known only once the backward has produced every gradient.
void check_update_in_backward(const OptimizerConfig& c);

// One optimizer step taken inside the backward (train --update-in-backward, StepOptions::update): each gradient the
// schedule hands over (a layer's, a global tensor's: this rank's shards) is summed over the data-parallel replicas
// (when given: the same rank-order sums as the whole set's, through accounted scratch) and consumed at once by the update AdamWOptimizer::step
// gives each element (the same kernel, clipping off), so parameters and moments come out the same to the bit, and
// the schedule frees it: no gradient set lives across the step. The constructor refuses clip > 0
// (check_update_in_backward). In planning mode (null gradients) it computes nothing and allocates only the replicas' scratch.
class InBackwardAdamW : public GradientSink {
 public:
  // With replicas of more than one rank, `mem` (required then) holds each sum's scratch (the same
  // "replica_all_reduce" workspace as train::sum_over_replicas, one tensor's at a time), planned and measured alike.
  InBackwardAdamW(AdamWOptimizer& opt, model::ParamSet& params, Collectives* shards = nullptr,
                  Collectives* replicas = nullptr, MemoryAccountant* mem = nullptr);
  void layer(const model::LayerSlot& s, const model::LayerWeights& grads) override;
  void global(model::g::Global which, float* grad) override;
  // Ends the step (the optimizer counts it) and returns the global gradient norm, summed over `shards`: the same
  // value as step()'s to double rounding (another order of additions), not to the bit.
  double finish();

 private:
  struct Slice {
    TensorView w, m, v;
    float* grad;
    int64_t n;
    bool decay;
  };
  void apply(const std::vector<Slice>& slices);

  AdamWOptimizer& opt_;
  model::ParamSet& params_;
  Collectives *shards_, *replicas_;
  MemoryAccountant* mem_;
  double squares_ = 0;
  bool finished_ = false;
};

}  // namespace hs::train
