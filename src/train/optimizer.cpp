#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <utility>
#include <vector>

#include "kernels/adamw.h"

namespace hs::train {

std::string lr_schedule_name(LrSchedule s) {
  switch (s) {
    case LrSchedule::Constant: return "constant";
    case LrSchedule::Cosine: return "cosine";
    case LrSchedule::Linear: return "linear";
    case LrSchedule::Wsd: return "wsd";
  }
  return "?";
}

LrSchedule parse_lr_schedule(const std::string& s) {
  if (s == "constant") return LrSchedule::Constant;
  if (s == "cosine") return LrSchedule::Cosine;
  if (s == "linear") return LrSchedule::Linear;
  if (s == "wsd") return LrSchedule::Wsd;
  throw std::invalid_argument("unknown learning-rate schedule '" + s + "' (known: constant, cosine, linear, wsd)");
}

double min_lr_of(const OptimizerConfig& c) { return c.min_lr < 0 ? c.lr / 10 : c.min_lr; }

void check_lr_schedule(const OptimizerConfig& c) {
  if (c.warmup < 0 || c.decay_steps < 0)
    throw std::invalid_argument("warmup " + std::to_string(c.warmup) + " and decay steps " +
                                std::to_string(c.decay_steps) + ": neither may be negative");
  if (min_lr_of(c) > c.lr)
    throw std::invalid_argument("--min-lr " + std::to_string(min_lr_of(c)) + " is above --lr " + std::to_string(c.lr) +
                                ": the schedule decays from --lr down to --min-lr");
  if (!(c.wsd_decay_fraction > 0 && c.wsd_decay_fraction <= 1))
    throw std::invalid_argument("--wsd-decay-fraction " + std::to_string(c.wsd_decay_fraction) +
                                " must be in (0, 1]: the share of the steps that decay");
}

namespace {
// The decay's first step and length (not for constant).
struct Decay {
  int64_t start, length;
};
Decay decay_of(const OptimizerConfig& c) {
  if (c.schedule == LrSchedule::Wsd) {
    const int64_t length =
        c.decay_steps > 0 ? c.decay_steps
                          : std::max<int64_t>(1, std::llround(c.wsd_decay_fraction * static_cast<double>(c.total_steps)));
    return {std::max(c.warmup, c.total_steps - length), length};
  }
  return {c.warmup, c.decay_steps > 0 ? c.decay_steps : std::max<int64_t>(1, c.total_steps - c.warmup)};
}
}  // namespace

std::string describe_lr_schedule(const OptimizerConfig& c) {
  char line[256];
  int n = std::snprintf(line, sizeof line, "%s, peak %g after %lld warmup steps", lr_schedule_name(c.schedule).c_str(),
                        c.lr, static_cast<long long>(c.warmup));
  if (c.schedule != LrSchedule::Constant) {
    const Decay d = decay_of(c);
    std::snprintf(line + n, sizeof line - static_cast<size_t>(n), ", decaying from step %lld to %g at step %lld",
                  static_cast<long long>(d.start + 1), min_lr_of(c), static_cast<long long>(d.start + d.length + 1));
  }
  return line;
}

double lr_at(const OptimizerConfig& c, int64_t step) {
  if (c.warmup > 0 && step < c.warmup) return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup);
  if (c.schedule == LrSchedule::Constant) return c.lr;
  const Decay d = decay_of(c);
  if (step < d.start) return c.lr;  // WSD's stable phase
  const double lo = min_lr_of(c);
  const double t = std::min(1.0, static_cast<double>(step - d.start) / static_cast<double>(d.length));
  const double shape = c.schedule == LrSchedule::Cosine ? 0.5 * (1.0 + std::cos(3.14159265358979323846 * t)) : 1.0 - t;
  return lo + (c.lr - lo) * shape;
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
