#include "train/optimizer.h"

#include <cmath>
#include <stdexcept>
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

namespace {
kernels::AdamWParams adamw_params(const OptimizerConfig& c, int64_t step) {
  kernels::AdamWParams p;
  p.lr = static_cast<float>(lr_at(c, step));
  p.beta1 = static_cast<float>(c.beta1);
  p.beta2 = static_cast<float>(c.beta2);
  p.eps = static_cast<float>(c.eps);
  return p;
}
}  // namespace

double AdamWOptimizer::step(model::ParamSet& params, model::ParamSet& grads, Collectives* shards) {
  std::vector<std::pair<const float*, int64_t>> arrays;
  for (auto& g : grads.all()) arrays.emplace_back(g.tensor.as<float>(), g.tensor.numel());
  double squares = kernels::sum_squares_all(arrays);
  if (shards) squares = shards->all_reduce_sum(squares);
  const double norm = std::sqrt(squares);
  kernels::AdamWParams p = adamw_params(cfg_, step_);
  if (cfg_.clip > 0 && norm > cfg_.clip) p.grad_scale = static_cast<float>(cfg_.clip / (norm + 1e-6));
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

void check_update_in_backward(const OptimizerConfig& c) {
  if (c.clip > 0)
    throw std::invalid_argument(
        "AdamW in the backward needs gradient clipping off (clip 0): AdamW is not scale-invariant, so clipping to the global gradient norm "
        "needs that norm before the first update, and it is known only once the backward has produced every gradient");
}

InBackwardAdamW::InBackwardAdamW(AdamWOptimizer& opt, model::ParamSet& params, Collectives* shards,
                                 Collectives* replicas, MemoryAccountant* mem)
    : opt_(opt), params_(params), shards_(shards), replicas_(replicas), mem_(mem) {
  check_update_in_backward(opt.config());
  if (replicas_ && replicas_->size() > 1 && !mem_)
    throw std::logic_error("InBackwardAdamW: the replicas' sums need an accountant for their scratch");
}

void InBackwardAdamW::apply(const std::vector<Slice>& slices) {
  if (finished_) throw std::logic_error("InBackwardAdamW: gradient handed over after finish()");
  std::vector<kernels::AdamWTensor> tensors;
  for (const Slice& s : slices) {
    if (replicas_ && replicas_->size() > 1) {
      Buffer scratch = mem_->allocate_n<float>(static_cast<size_t>(replicas_->all_reduce_scratch_elems(s.n)),
                                               MemCategory::Workspace, "replica_all_reduce");
      if (s.grad && !mem_->planning()) replicas_->all_reduce_sum(s.grad, s.n, ptr<float>(scratch));
    }
    if (!s.grad || !s.w.data) continue;  // planning: shapes only (every tensor's scratch is still planned)
    squares_ += kernels::sum_squares(s.grad, s.n);
    kernels::AdamWTensor t;
    if (s.w.dtype == DType::F32) t.w = static_cast<float*>(s.w.data);
    else t.w_bf16 = static_cast<bf16*>(s.w.data);
    if (s.m.dtype == DType::F32) {
      t.m = static_cast<float*>(s.m.data);
      t.v = static_cast<float*>(s.v.data);
    } else {
      t.m_bf16 = static_cast<bf16*>(s.m.data);
      t.v_bf16 = static_cast<bf16*>(s.v.data);
    }
    t.grad = s.grad;
    t.n = s.n;
    t.weight_decay = s.decay ? static_cast<float>(opt_.cfg_.weight_decay) : 0.0f;
    tensors.push_back(t);
  }
  if (tensors.empty()) return;
  kernels::adamw_update_clear_all(tensors, adamw_params(opt_.cfg_, opt_.step_), opt_.step_ + 1);
}

void InBackwardAdamW::layer(const model::LayerSlot& s, const model::LayerWeights& grads) {
  const auto specs = model::layer_specs(params_.config(), s.kind());
  const model::LayerWeights w = params_.layer(s), m = opt_.m_.layer(s), v = opt_.v_.layer(s);
  if (grads.t.size() != specs.size()) throw std::logic_error("InBackwardAdamW: a layer's gradients do not match its specs");
  std::vector<Slice> slices;
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t n =
        params_.shards() > 1 ? model::layer_shard_elems(specs[i], params_.shards()) : hs::numel(specs[i].shape);
    slices.push_back({w[i], m[i], v[i], static_cast<float*>(grads[i].data), n, specs[i].weight_decay});
  }
  apply(slices);
}

void InBackwardAdamW::global(model::g::Global which, float* grad) {
  const auto i = static_cast<size_t>(which);
  const model::StackedParam& p = params_.all()[i];
  apply({{p.tensor.view(), opt_.m_.all()[i].tensor.view(), opt_.v_.all()[i].tensor.view(), grad, p.tensor.numel(),
          p.spec.weight_decay}});
}

double InBackwardAdamW::finish() {
  if (finished_) throw std::logic_error("InBackwardAdamW: finish() called twice");
  finished_ = true;
  ++opt_.step_;
  const double squares = shards_ ? shards_->all_reduce_sum(squares_) : squares_;
  return std::sqrt(squares);
}

}  // namespace hs::train
