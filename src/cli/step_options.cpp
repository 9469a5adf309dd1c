#include "cli/step_options.h"

#include "cli/threads.h"
#include "core/memory.h"

namespace hs::cli {

std::string dtype_flag(DType t) { return t == DType::BF16 ? "bf16" : "fp32"; }

CLI::Option* add_dtype_option(CLI::App* c, const std::string& name, std::string& value, const std::string& help) {
  return c->add_option(name, value, help)->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
}

void add_step_options(CLI::App* c, StepArgs& a, const StepDefaults& d) {
  a.batch = d.batch;
  a.seq = d.seq;
  c->add_option("--model,--preset,--config", a.model,
                "Model: a preset (tiny, small, qwen3.5-tiny with the Qwen3.5 vocabulary, qwen3-next-80b-a3b, "
                "qwen3.5-35b-a3b, qwen3.5-397b-a17b; any of them + \"+mtp\" for a multi-token-prediction layer, e.g. "
                "small+mtp) or a Hugging Face config.json (or a directory holding one)")
      ->capture_default_str();
  a.batch_option = c->add_option("--batch", a.batch, "Sequences per step, over all devices (ranks) together")
                       ->capture_default_str();
  c->add_option("--seq", a.seq, "Tokens per sequence")->capture_default_str();
  c->add_option("--grad-accum", a.grad_accum,
                "Micro-batches of --batch sequences whose gradients are summed into one update (the loss is the "
                "mean over all their targets; the memory is one micro-batch's). Not with --update-in-backward")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  a.remat_option =
      c->add_option("--remat", a.remat,
                    "Rematerialisation: none | block | sublayer | auto (least recomputation within --memory-budget)")
          ->check(CLI::IsMember({"none", "block", "sublayer", "auto"}))
          ->capture_default_str();
  c->add_option("--memory-budget,--hbm", a.memory_budget,
                "Memory per device, e.g. 2GiB or 80GB: the budget of --remat auto (and of plan's fit)");
  add_dtype_option(c, "--weight-dtype", a.weight_dtype, "Weight storage: fp32 | bf16");
  a.compute_option = add_dtype_option(c, "--compute-dtype", a.compute_dtype, "Compute / activation dtype: fp32 | bf16");
  add_dtype_option(c, "--moment-dtype", a.moment_dtype, "AdamW moments: fp32 | bf16 (stored rounded to nearest even)");
  c->add_option("--fsdp", a.fsdp, "Ranks (devices) per FSDP group (default: all; data parallel across groups)");
  c->add_option("--expert-parallel", a.expert_parallel,
                "Split the routed experts over E consecutive ranks of each FSDP group and exchange the tokens' rows "
                "with them (all-to-all); E divides the group and the experts")
      ->capture_default_str();
  c->add_flag("--prefetch", a.prefetch,
              "Sharded runs: gather the next sub-layer's weights while this one computes and reduce-scatter its "
              "gradients during the next backward (one more sub-layer's weights and gradients live)");
  c->add_option("--gather-piece-bytes", a.gather_piece_bytes,
                "Routed experts are gathered and their gradients reduce-scattered in pieces of at most this size "
                "(compute dtype; 0: a whole layer)")
      ->capture_default_str();
  c->add_option("--vocab-piece-bytes", a.vocab_piece_bytes,
                "The LM head and the embedding are gathered (or cast) and their gradients reduce-scattered in "
                "vocabulary pieces of at most this size (compute dtype; 0: whole tensors); the LM head's log-sum-exp "
                "is then streamed over the pieces")
      ->capture_default_str();
  c->add_flag("--update-in-backward", a.update_in_backward,
              "Apply AdamW to each gradient shard as soon as the backward completes it (no gradient set lives across "
              "the step; the same parameters to the bit). Needs --clip 0: clipping needs the global norm before any "
              "update");
  c->add_option("--packed-weights", a.packed_weights,
                "on | off: reorder each sub-layer's weights once into oneDNN's packed layout for its products (the "
                "same bits; default: HS_PACKED_WEIGHTS, else off; plan with --chip or --memory-budget: off, the sizes "
                "are this CPU's oneDNN layouts)")
      ->check(CLI::IsMember({"on", "off"}));
  a.delta_option = c->add_option("--delta-rule-products", a.delta_rule_products,
                                 "fp32 | bf16: the delta rule's matrix products in fp32, or with bf16 inputs and fp32 "
                                 "sums (vdpbf16ps; bf16 compute on a CPU with AVX-512-BF16, else fp32)")
                       ->check(CLI::IsMember({"fp32", "bf16"}))
                       ->capture_default_str();
  c->add_option("--mtp-weight", a.mtp_weight,
                "Multi-token prediction: loss = main + this weight x the MTP layer's mean cross-entropy of the token "
                "after next (DeepSeek-V3 uses 0.3, then 0.1); needs a model with an MTP layer (e.g. small+mtp). 0: "
                "the MTP layer is not run")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  c->add_option("--packing", a.packing,
                "documents | stream | auto: documents restarts the model at every document start of the data (no "
                "token sees another document, no loss across one); stream reads the data as one sequence; auto: "
                "documents when the data has documents (a token file of several; plan: stream)")
      ->check(CLI::IsMember({"documents", "stream", "auto"}))
      ->capture_default_str();
  add_threads_option(c, a.threads);
}

train::StepOptions schedule_options(const StepArgs& a, bool for_this_machine) {
  train::StepOptions s;
  if (a.remat != "auto") s.remat = train::parse_remat(a.remat);
  s.compute = parse_dtype(a.compute_dtype);
  s.expert_parallel = a.expert_parallel;
  s.prefetch = a.prefetch;
  s.gather_piece_bytes = parse_bytes(a.gather_piece_bytes);
  s.vocab_piece_bytes = parse_bytes(a.vocab_piece_bytes);
  s.pack_weights =
      a.packed_weights.empty() ? for_this_machine && train::packed_weights_default() : a.packed_weights == "on";
  s.delta_rule_bf16_products = a.delta_rule_products == "bf16";
  s.mtp_weight = a.mtp_weight;
  s.packing = train::parse_packing(a.packing);
  return s;
}

void fill_train_options(const StepArgs& a, train::TrainOptions& o) {
  o.model = a.model;
  o.batch = a.batch;
  o.seq = a.seq;
  o.grad_accum = a.grad_accum;
  o.weight_dtype = parse_dtype(a.weight_dtype);
  o.opt.moment_dtype = parse_dtype(a.moment_dtype);
  o.update_in_backward = a.update_in_backward;
  o.step = schedule_options(a, /*for_this_machine=*/true);
}

planner::PlanRequest step_plan_request(const StepArgs& a, const model::ModelConfig& model, int64_t devices,
                                       int64_t batch_per_device, bool for_this_machine) {
  planner::PlanRequest r;
  r.model = model;
  r.devices = devices;
  r.fsdp = a.fsdp;
  r.batch_per_device = batch_per_device;
  r.seq = a.seq;
  r.grad_accum = a.grad_accum;
  r.weight_dtype = parse_dtype(a.weight_dtype);
  r.moment_dtype = parse_dtype(a.moment_dtype);
  r.update_in_backward = a.update_in_backward;
  r.step = schedule_options(a, for_this_machine);
  return r;
}

}  // namespace hs::cli
