// AdamW over a ParamSet (or this rank's shards of one: the moments are sharded alike) with fp32 or bf16 moments,
// global-norm gradient clipping, and a warmup + cosine learning-rate schedule.
#pragma once
#include <cstdint>

#include "model/params.h"
#include "train/schedule.h"

namespace hs::train {

struct OptimizerConfig {
  double lr = 3e-3;
  double min_lr_ratio = 0.1;  // cosine decays to lr * min_lr_ratio
  int64_t warmup = 20;
  int64_t total_steps = 1000;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;  // on matrices and embeddings only
  double clip = 1.0;          // max global gradient norm (0 = off)
  // AdamW moments stored in fp32 or bf16 (computed in fp32 each step, stored rounded to nearest even): bf16 saves
  // 4 bytes a parameter of the optimizer state.
  DType moment_dtype = DType::F32;
};

// Learning rate at 0-based `step`: linear warmup over `warmup` steps, then cosine to lr * min_lr_ratio.
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
