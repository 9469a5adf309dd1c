// AdamW over a ParamSet (or this rank's shards of one: the moments are sharded alike) with fp32 or bf16 moments,
// global-norm gradient clipping, and a warmup + cosine learning-rate schedule.
#pragma once
#include <cstdint>

#include "model/params.h"

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
  OptimizerConfig cfg_;
  model::ParamSet m_, v_;
  int64_t step_ = 0;
};

}  // namespace hs::train
