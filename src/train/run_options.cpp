#include "train/run_options.h"

#include <cstdint>
#include <stdexcept>
#include <string>

namespace hs::train {

nlohmann::json options_to_json(const TrainOptions& o) {
  return {{"model", o.model}, {"text", o.text}, {"data", o.data}, {"chat", o.chat},
          {"chat_template", o.chat_template}, {"loss_on", o.loss_on}, {"skip_bad_lines", o.skip_bad_lines}, {"synthetic", o.synthetic}, {"steps", o.steps},
          {"batch", o.batch}, {"grad_accum", o.grad_accum}, {"seq", o.seq}, {"seed", o.seed}, {"lr", o.opt.lr},
          {"lr_schedule", lr_schedule_name(o.opt.schedule)}, {"min_lr", min_lr_of(o.opt)}, {"warmup", o.opt.warmup},
          {"decay_steps", o.opt.decay_steps}, {"wsd_decay_fraction", o.opt.wsd_decay_fraction}, {"beta1", o.opt.beta1}, {"beta2", o.opt.beta2}, {"eps", o.opt.eps},
          {"weight_decay", o.opt.weight_decay}, {"clip", o.opt.clip}, {"remat", remat_name(o.step.remat)},
          {"compute_dtype", std::string(dtype_name(o.step.compute))}, {"weight_dtype", std::string(dtype_name(o.weight_dtype))},
          {"moment_dtype", std::string(dtype_name(o.opt.moment_dtype))},
          {"delta_rule_products", o.step.delta_rule_bf16_products ? "bf16" : "fp32"},
          {"packing", packing_name(o.step.packing)}, {"mtp_weight", o.step.mtp_weight},
          {"eval_every", o.eval_every}, {"eval_batches", o.eval_batches}, {"heldout_fraction", o.heldout_fraction}, {"eval_data", o.eval_data}};
}

void options_from_json(const nlohmann::json& j, TrainOptions& o) {
  // The tokenizer is not taken back: the checkpoint carries its own copy, which a resume uses.
  o.text = j.value("text", o.text);
  o.data = j.value("data", o.data);
  o.chat = j.value("chat", o.chat);
  // The template the run rendered with (a command line that names one renders with it instead).
  if (o.chat_template.empty()) o.chat_template = j.value("chat_template", o.chat_template);
  o.loss_on = j.value("loss_on", o.loss_on);
  o.skip_bad_lines = j.value("skip_bad_lines", o.skip_bad_lines);
  o.synthetic = j.value("synthetic", o.synthetic);
  o.batch = j.value("batch", o.batch);
  o.grad_accum = j.value("grad_accum", int64_t(1));  // checkpoints from before --grad-accum summed none
  o.seq = j.value("seq", o.seq);
  o.seed = j.value("seed", o.seed);
  o.opt.lr = j.value("lr", o.opt.lr);
  // The schedule, as the checkpoint's run had it. Checkpoints from before --lr-schedule were cosine down to
  // lr * min_lr_ratio over the steps after the warmup.
  o.opt.schedule = parse_lr_schedule(j.value("lr_schedule", std::string("cosine")));
  o.opt.min_lr = j.contains("min_lr") ? j["min_lr"].get<double>() : o.opt.lr * j.value("min_lr_ratio", 0.1);
  o.opt.warmup = j.value("warmup", o.opt.warmup);
  o.opt.decay_steps = j.value("decay_steps", int64_t(0));
  o.opt.wsd_decay_fraction = j.value("wsd_decay_fraction", o.opt.wsd_decay_fraction);
  o.opt.beta1 = j.value("beta1", o.opt.beta1);
  o.opt.beta2 = j.value("beta2", o.opt.beta2);
  o.opt.eps = j.value("eps", o.opt.eps);
  o.opt.weight_decay = j.value("weight_decay", o.opt.weight_decay);
  o.opt.clip = j.value("clip", o.opt.clip);
  o.weight_dtype = parse_dtype(j.value("weight_dtype", std::string(dtype_name(o.weight_dtype))));
  o.opt.moment_dtype = parse_dtype(j.value("moment_dtype", std::string(dtype_name(o.opt.moment_dtype))));
  o.heldout_fraction = j.value("heldout_fraction", o.heldout_fraction);
  o.eval_data = j.value("eval_data", o.eval_data);
  o.step.mtp_weight = j.value("mtp_weight", o.step.mtp_weight);  // the loss a resume continues (0 before the flag)
  // How the run packed its windows (checkpoints from before --packing streamed, as auto still does on text); a
  // command line that names a packing keeps it.
  if (o.step.packing == Packing::Auto) o.step.packing = parse_packing(j.value("packing", std::string("auto")));
  // The step's arithmetic: a resume without them would silently compute another curve, so they come back too, and a
  // command line that names other ones is refused.
  if (j.contains("compute_dtype")) {
    const DType c = parse_dtype(j["compute_dtype"].get<std::string>());
    if (o.compute_given && c != o.step.compute)
      throw std::invalid_argument("compute dtype " + std::string(dtype_name(o.step.compute)) +
                                  " differs from the checkpoint's " + std::string(dtype_name(c)) +
                                  " (a resume continues the same arithmetic; leave it unset)");
    o.step.compute = c;
  }
  if (j.contains("remat")) {
    const RematPolicy r = parse_remat(j["remat"].get<std::string>());
    if (o.remat_given && r != o.step.remat)
      throw std::invalid_argument("remat policy " + remat_name(o.step.remat) + " differs from the checkpoint's " +
                                  remat_name(r) + " (a resume continues the same schedule; leave it unset)");
    o.step.remat = r;
  }
  if (j.contains("delta_rule_products")) {
    const bool bf16 = j["delta_rule_products"].get<std::string>() == "bf16";
    if (o.delta_products_given && bf16 != o.step.delta_rule_bf16_products)
      throw std::invalid_argument(std::string("delta rule products ") + (bf16 ? "fp32" : "bf16") +
                                  " differs from the checkpoint's " + (bf16 ? "bf16" : "fp32") +
                                  " (a resume continues the same arithmetic; leave it unset)");
    o.step.delta_rule_bf16_products = bf16;
  }
}

void check_same_run(const TrainOptions& o, const model::ModelConfig& cfg, Collectives& world) {
  const std::string mine = options_to_json(o).dump() + "|" + model::describe(cfg) + "|" + std::to_string(o.stop_after) +
                           "|" + std::to_string(o.save_every) + "|" + o.out + "|" + o.init + "|" + o.resume + "|" +
                           std::to_string(o.step.prefetch) + "|" + std::to_string(o.step.gather_piece_bytes) + "|" +
                           std::to_string(o.step.vocab_piece_bytes) + "|" +
                           std::to_string(o.update_in_backward) + "|" + std::to_string(o.dist->fsdp->size()) + "|" +
                           std::to_string(o.step.expert_parallel);
  uint64_t h = 1469598103934665603ull, root;
  for (char ch : mine) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
  root = h;
  world.broadcast(&root, sizeof root, 0);
  const double differing = world.all_reduce_sum(root == h ? 0.0 : 1.0);
  if (differing > 0)
    throw std::invalid_argument(std::to_string(static_cast<int64_t>(differing)) + " of " + std::to_string(world.size()) +
                                " ranks were started with other options or another model than rank 0" +
                                (root == h ? std::string() : " (rank " + std::to_string(world.rank()) + " is one)") +
                                ": every rank must run the same command");
}

}  // namespace hs::train
