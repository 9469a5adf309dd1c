// The options of one training step, declared once for every subcommand that runs or plans one (train, plan): the
// model, batch and sequence, remat and the memory budget, the dtypes, FSDP and expert parallelism, prefetch, the
// piece sizes, AdamW in the backward, packed weights, the delta rule's products and the threads. Each flag means the
// same in both; a default that differs (batch, sequence) is the subcommand's, given to add_step_options.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "planner/plan.h"
#include "train/run_options.h"

namespace hs::cli {

// The flag value of a floating-point dtype ("fp32" | "bf16"; parse_dtype reads it back).
std::string dtype_flag(DType t);
// Adds an fp32 | bf16 option whose default is `value`'s current content.
CLI::Option* add_dtype_option(CLI::App* c, const std::string& name, std::string& value, const std::string& help);

// The defaults are the libraries' own (train::TrainOptions, train::StepOptions, train::OptimizerConfig).
struct StepArgs {
  std::string model = train::TrainOptions{}.model;  // --model (also --preset, --config): a preset name, or a config.json or its directory
  int64_t batch = 0;            // --batch: sequences per step over all devices (ranks)
  int64_t seq = 0;              // --seq: tokens per sequence
  int64_t grad_accum = 1;       // --grad-accum: micro-batches of --batch summed into one update
  std::string remat = train::remat_name(train::StepOptions{}.remat);
  std::string memory_budget;    // --memory-budget (also --hbm): memory per device, for --remat auto and plan's fit
  std::string weight_dtype = dtype_flag(train::TrainOptions{}.weight_dtype);
  std::string compute_dtype = dtype_flag(train::StepOptions{}.compute);
  std::string moment_dtype = dtype_flag(train::OptimizerConfig{}.moment_dtype);
  int64_t fsdp = 0;             // ranks (devices) per FSDP group; 0: all
  int64_t expert_parallel = train::StepOptions{}.expert_parallel;
  bool prefetch = false, update_in_backward = false;
  std::string gather_piece_bytes = std::to_string(train::StepOptions{}.gather_piece_bytes);
  std::string vocab_piece_bytes = std::to_string(train::StepOptions{}.vocab_piece_bytes);
  std::string packed_weights;   // on | off; empty: the subcommand's default (HS_PACKED_WEIGHTS, else off)
  std::string delta_rule_products = train::StepOptions{}.delta_rule_bf16_products ? "bf16" : "fp32";
  double mtp_weight = train::StepOptions{}.mtp_weight;  // --mtp-weight: the MTP layer's loss weight (0: not run)
  std::string packing = train::packing_name(train::StepOptions{}.packing);  // --packing documents | stream | auto
  int threads = 0;
  // Set by add_step_options: whether the command line named them (a resume refuses other values than its own).
  CLI::Option *remat_option = nullptr, *compute_option = nullptr, *delta_option = nullptr, *batch_option = nullptr;
};

// The subcommand's defaults of the flags that have one of their own (its library's: train::TrainOptions,
// planner::PlanRequest).
struct StepDefaults {
  int64_t batch;  // sequences per step
  int64_t seq;
};

// Declares the step's flags on `c`, filling `a`.
void add_step_options(CLI::App* c, StepArgs& a, const StepDefaults& d);

// The schedule's options from the parsed flags (remat "auto" is left at the default: the caller plans it). Without
// --packed-weights, weights are packed as HS_PACKED_WEIGHTS says for a step on this machine (`for_this_machine`),
// never for another (plan --chip / --memory-budget: oneDNN's packed sizes are this CPU's).
train::StepOptions schedule_options(const StepArgs& a, bool for_this_machine);

// A training run's step options: the model, batch, sequence, dtypes, schedule and update (train --remat auto is the
// caller's, which plans it with step_plan_request).
void fill_train_options(const StepArgs& a, train::TrainOptions& o);

// The plan of these options' step on `devices` devices, `batch_per_device` sequences each, for `model`.
planner::PlanRequest step_plan_request(const StepArgs& a, const model::ModelConfig& model, int64_t devices,
                                       int64_t batch_per_device, bool for_this_machine);

}  // namespace hs::cli
