#include "train/optimizer.h"

#include <cmath>
#include <utility>
#include <vector>

#include "kernels/adamw.h"

namespace hs::train {

double lr_at(const OptimizerConfig& c, int64_t step) {
  if (c.warmup > 0 && step < c.warmup) return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup);
  const int64_t decay_steps = std::max<int64_t>(1, c.total_steps - c.warmup);
  const double t = std::min(1.0, static_cast<double>(step - c.warmup) / static_cast<double>(decay_steps));
  const double cosine = 0.5 * (1.0 + std::cos(3.14159265358979323846 * t));
  return c.lr * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * cosine);
}

AdamWOptimizer::AdamWOptimizer(const model::ParamSet& params, const OptimizerConfig& cfg, MemoryAccountant& mem)
    : cfg_(cfg),
      m_(params.config(), cfg.moment_dtype, mem, MemCategory::OptimizerState, true, params.shards()),
      v_(params.config(), cfg.moment_dtype, mem, MemCategory::OptimizerState, true, params.shards()) {}

double AdamWOptimizer::step(model::ParamSet& params, model::ParamSet& grads, Collectives* shards) {
  std::vector<std::pair<const float*, int64_t>> arrays;
  for (auto& g : grads.all()) arrays.emplace_back(g.tensor.as<float>(), g.tensor.numel());
  double squares = kernels::sum_squares_all(arrays);
  if (shards) squares = shards->all_reduce_sum(squares);
  const double norm = std::sqrt(squares);
  kernels::AdamWParams p;
  if (cfg_.clip > 0 && norm > cfg_.clip) p.grad_scale = static_cast<float>(cfg_.clip / (norm + 1e-6));
  p.lr = static_cast<float>(lr_at(cfg_, step_));
  p.beta1 = static_cast<float>(cfg_.beta1);
  p.beta2 = static_cast<float>(cfg_.beta2);
  p.eps = static_cast<float>(cfg_.eps);
  ++step_;
  // Every tensor in one pass (one parallel region), each gradient zeroed as it is read.
  auto& ps = params.all();
  std::vector<kernels::AdamWTensor> tensors(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    Tensor& w = ps[i].tensor;
    kernels::AdamWTensor& t = tensors[i];
    if (w.dtype() == DType::F32) t.w = w.as<float>();
    else t.w_bf16 = w.as<bf16>();
    t.grad = grads.all()[i].tensor.as<float>();
    Tensor& m = m_.all()[i].tensor;
    Tensor& v = v_.all()[i].tensor;
    if (m.dtype() == DType::F32) {
      t.m = m.as<float>();
      t.v = v.as<float>();
    } else {
      t.m_bf16 = m.as<bf16>();
      t.v_bf16 = v.as<bf16>();
    }
    t.n = w.numel();
    t.weight_decay = ps[i].spec.weight_decay ? static_cast<float>(cfg_.weight_decay) : 0.0f;
  }
  kernels::adamw_update_clear_all(tensors, p, step_);
  return norm;
}

}  // namespace hs::train
