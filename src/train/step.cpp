#include "train/step.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace hs::train {

namespace {

// Multiplies every gradient of this rank by `factor` (exact when it is 1: nothing is done).
void scale_gradients(model::ParamSet& grads, double factor) {
  if (factor == 1.0) return;
  const float f = static_cast<float>(factor);
  for (auto& g : grads.all()) {
    float* p = g.tensor.as<float>();
    const int64_t n = g.tensor.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) p[i] *= f;
  }
}

// This rank's counted targets (>= 0) of a micro-batch; over shapes every target counts, as the schedule plans.
double local_targets(const Batch& b, bool planning) {
  if (planning) return static_cast<double>(b.batch * b.seq);
  int64_t n = 0;
  for (int64_t i = 0; i < b.batch * b.seq; ++i) n += b.targets[i] >= 0;
  return static_cast<double>(n);
}

// The micro-batches' results as one batch's: sums added, the cross-entropy the mean over all counted targets, the
// load-balance loss weighted by each micro-batch's share of them.
void add_result(StepResult& total, const StepResult& r, double weight) {
  total.ce_sum += r.ce_sum;
  total.count += r.count;
  total.mtp_ce += r.mtp_ce * static_cast<double>(r.mtp_count);  // a sum until run() divides it
  total.mtp_count += r.mtp_count;
  total.aux += weight * r.aux;
  if (total.router.empty()) {
    total.router = r.router;
    return;
  }
  for (size_t l = 0; l < r.router.size(); ++l) {
    kernels::RouterStats& t = total.router[l];
    for (size_t e = 0; e < t.expert_counts.size(); ++e) t.expert_counts[e] += r.router[l].expert_counts[e];
    for (size_t e = 0; e < t.prob_sums.size(); ++e) t.prob_sums[e] += r.router[l].prob_sums[e];
    t.rows += r.router[l].rows;
  }
}

}  // namespace

void check_grad_accum(int64_t micro_batches, bool update_in_backward) {
  if (micro_batches < 1)
    throw std::invalid_argument("--grad-accum " + std::to_string(micro_batches) +
                                ": the micro-batches summed into one update must be at least 1");
  if (micro_batches > 1 && update_in_backward)
    throw std::invalid_argument("--grad-accum " + std::to_string(micro_batches) +
                                " sums the gradients of several backwards before one update, but --update-in-backward "
                                "applies AdamW to each gradient as its backward completes it: drop one of the two");
}

Step::Step(const model::ModelConfig& cfg, DType weight_dtype, const OptimizerConfig& optimizer,
           const StepOptions& schedule, bool update_in_backward, Collectives* replicas, MemoryAccountant& mem)
    : mem_(mem),
      schedule_(schedule),
      update_in_backward_(update_in_backward),
      replicas_(replicas),
      params_(cfg, weight_dtype, mem, MemCategory::Parameters, false, schedule.comm ? schedule.comm->size() : 1),
      adamw_(params_, optimizer, mem) {
  if (schedule.update) throw std::logic_error("train::Step makes its own gradient sink (update_in_backward)");
  if (update_in_backward) check_update_in_backward(optimizer);
}

StepOutcome Step::run(std::span<const Batch> micro_batches) {
  const int64_t n = static_cast<int64_t>(micro_batches.size());
  check_grad_accum(n, update_in_backward_);
  StepOutcome out;
  out.lr = lr_at(adamw_.config(), adamw_.steps_taken());
  // inputs, targets and, with packed documents, positions: [batch, seq] int32 each.
  auto batch_buffer = [&](const Batch& b) {
    const size_t arrays = b.has_documents() ? 3 : 2;
    return mem_.allocate(arrays * static_cast<size_t>(b.batch * b.seq) * sizeof(int32_t), MemCategory::Batch, "batch");
  };
  if (update_in_backward_) {
    Buffer batch = batch_buffer(micro_batches[0]);
    mem_.reset_peak();
    InBackwardAdamW update(adamw_, params_, schedule_.comm, replicas_, &mem_);
    StepOptions with_sink = schedule_;
    with_sink.update = &update;
    out.result = forward_backward(params_, micro_batches[0], with_sink, mem_, nullptr);
    out.grad_norm = update.finish();
    return out;
  }
  // Each micro-batch's gradient comes out as the mean over its own c_i targets; the update needs the sum over all C
  // targets divided by C. Before micro-batch i the kept sum is rescaled so that it reads as a mean over c_i (it holds
  // sum_j S_j / c_prev), and at the end by c_last / C: with equal counts only that last factor, 1/N, is applied.
  // Micro-batches without targets (when others have some) add nothing to the cross-entropy and are skipped.
  const bool planning = mem_.planning();
  std::vector<double> counts(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) counts[size_t(i)] = local_targets(micro_batches[size_t(i)], planning);
  Collectives* group = schedule_.batch_group ? schedule_.batch_group : schedule_.comm;
  if (group && n > 1 && !planning) group->all_reduce_sum(counts.data(), n);
  double total = 0;
  for (double c : counts) total += c;
  const int64_t run = planning ? std::min<int64_t>(n, 2) : n;
  double previous = 0;  // the count the kept sum is a mean over
  bool first = true;
  for (int64_t i = 0; i < run; ++i) {
    const double c = counts[size_t(i)];
    if (c == 0 && total > 0) continue;
    if (!planning && previous > 0) scale_gradients(*grads_, previous / c);
    Buffer batch = batch_buffer(micro_batches[size_t(i)]);
    if (first) mem_.reset_peak();
    first = false;
    const StepResult r = forward_backward(params_, micro_batches[size_t(i)], schedule_, mem_, &grads_);
    add_result(out.result, r, total > 0 ? c / total : 1.0);
    if (c > 0) previous = c;
    if (total == 0) break;  // no targets anywhere: one micro-batch's (zero) gradient, as a batch without targets
  }
  if (!planning && previous > 0) scale_gradients(*grads_, previous / total);
  StepResult& r = out.result;
  r.ce = r.count ? r.ce_sum / static_cast<double>(r.count) : 0.0;
  r.loss = r.ce + params_.config().router_aux_coef * r.aux;
  r.mtp_ce = r.mtp_count ? r.mtp_ce / static_cast<double>(r.mtp_count) : 0.0;
  r.loss += schedule_.mtp_weight * r.mtp_ce;
  if (replicas_) sum_over_replicas(*grads_, *replicas_, mem_);
  // AdamW updates in place and allocates nothing: over shapes there is nothing to plan and nothing to compute.
  if (!planning) out.grad_norm = adamw_.step(params_, *grads_, schedule_.comm);  // leaves grads_ zeroed
  return out;
}

}  // namespace hs::train
