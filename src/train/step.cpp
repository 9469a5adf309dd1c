#include "train/step.h"

#include <stdexcept>

namespace hs::train {

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

StepOutcome Step::run(const Batch& b) {
  // inputs, targets and, with packed documents, positions: [batch, seq] int32 each.
  const size_t arrays = b.has_documents() ? 3 : 2;
  Buffer batch = mem_.allocate(arrays * static_cast<size_t>(b.batch * b.seq) * sizeof(int32_t), MemCategory::Batch, "batch");
  mem_.reset_peak();
  StepOutcome out;
  out.lr = lr_at(adamw_.config(), adamw_.steps_taken());
  if (update_in_backward_) {
    InBackwardAdamW update(adamw_, params_, schedule_.comm, replicas_, &mem_);
    StepOptions with_sink = schedule_;
    with_sink.update = &update;
    out.result = forward_backward(params_, b, with_sink, mem_, nullptr);
    out.grad_norm = update.finish();
  } else {
    out.result = forward_backward(params_, b, schedule_, mem_, &grads_);
    if (replicas_) sum_over_replicas(*grads_, *replicas_, mem_);
    // AdamW updates in place and allocates nothing: over shapes there is nothing to plan and nothing to compute.
    if (!mem_.planning()) out.grad_norm = adamw_.step(params_, *grads_, schedule_.comm);  // leaves grads_ zeroed
  }
  return out;
}

}  // namespace hs::train
