#include <cstdio>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/gguf_options.h"
#include "cli/speculative_options.h"
#include "cli/step_options.h"
#include "cli/threads.h"
#include "gguf/export.h"
#include "gguf/import.h"
#include "planner/plan.h"

namespace hs::cli {

namespace {

struct PlanArgs {
  StepArgs step;
  std::string chip;
  int64_t devices = 1, batch_per_device = 0, context = 4096, parallel = 4;
  std::string cache_bytes = "1GiB";
  bool compare = false, json = false, generate = false, fit = false, serve = false;
  GgufArgs gguf;  // --gguf-blocks, --gguf-dequantize (plan --generate, plan --serve)
  int64_t prefill_piece = 512;
  SpeculativeArgs spec;  // --speculative, --draft (plan --generate)
};

nlohmann::json to_json(const planner::PlanResult& p) {
  nlohmann::json cat, largest = nlohmann::json::array();
  for (size_t i = 0; i < kNumMemCategories; ++i)
    if (!is_argument(static_cast<MemCategory>(i))) cat[std::string(category_name(static_cast<MemCategory>(i)))] = p.peak.bytes[i];
  for (const auto& b : p.peak.largest)
    largest.push_back({{"name", b.tag}, {"category", std::string(category_name(b.category))}, {"bytes", b.bytes}});
  return {{"remat", train::remat_name(p.remat)}, {"moment_dtype", std::string(dtype_name(p.moment_dtype))},
          {"update_in_backward", p.update_in_backward}, {"fsdp", p.fsdp},
          {"argument_bytes", p.argument_bytes}, {"output_bytes", p.output_bytes}, {"alias_bytes", p.alias_bytes},
          {"temp_bytes", p.temp_bytes}, {"total_bytes", p.total_bytes}, {"hbm_bytes", p.hbm_bytes},
          {"fits", p.fits}, {"temp_by_category", cat}, {"largest_at_peak", largest}, {"plan_seconds", p.seconds}};
}

std::string gb(size_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GB", double(b) / 1e9);
  return s;
}

// plan --generate --gguf-blocks: what generate --gguf-blocks runs (the file's quantized blocks in place, the rest
// converted to fp32, prompts prefilled in --prefill-piece pieces on the blocks), planned by running that decoder over
// shapes: equal to generate's accounted peak plus the blocks (its weights_mapped_bytes) when a prompt fills two pieces.
void plan_quantized_generation(const PlanArgs& a) {
  if (a.prefill_piece <= 0) throw std::invalid_argument("--prefill-piece must be positive");
  planner::GeneratePlanRequest r;
  r.context = a.context;
  r.batch = a.step.batch;
  r.piece = a.prefill_piece;
  const planner::QuantizedGeneratePlan q = planner::plan_generate_gguf(a.step.model, r);
  const planner::GeneratePlan& p = q.plan;
  if (a.json) {
    std::printf("%s\n", nlohmann::json({{"weights_bytes", p.weights}, {"kv_cache_bytes", p.kv_cache},
                                        {"recurrent_state_bytes", p.recurrent_state}, {"workspace_bytes", p.workspace},
                                        {"total_bytes", p.total}, {"context", r.context}, {"batch", r.batch},
                                        {"prefill_piece", r.piece}, {"weights_run_as", "gguf blocks"},
                                        {"quantized_weights_bytes", q.quantized_bytes},
                                        {"converted_weights_bytes", q.converted_bytes}})
                            .dump()
                            .c_str());
    return;
  }
  const gguf::GgufReader file(a.step.model);
  std::printf("%s\ngenerate --gguf-blocks: %lld sequences x %lld positions, prefill pieces of %lld, one device\n",
              model::describe(gguf::config_from_gguf(file)).c_str(), (long long)r.batch, (long long)r.context,
              (long long)r.piece);
  for (const auto& [what, bytes] :
       {std::pair{"quantized blocks", size_t(q.quantized_bytes)}, {"converted (fp32)", q.converted_bytes},
        {"kv cache", p.kv_cache}, {"recurrent state", p.recurrent_state}, {"workspace", p.workspace},
        {"total", p.total}})
    std::printf("%-18s %12s\n", what, format_bytes(double(bytes)).c_str());
}

void plan_generation(const PlanArgs& a) {
  // As generate: a .gguf file from its blocks unless --speculative needs it dequantized.
  std::vector<std::string> needs_dequantized;
  if (!a.spec.speculative.empty()) needs_dequantized.push_back("--speculative " + a.spec.speculative);
  if (gguf_from_blocks(a.gguf, a.step.model, needs_dequantized, "plan")) return plan_quantized_generation(a);
  planner::GeneratePlanRequest r;
  // A .gguf --model here runs dequantized (--gguf-dequantize, or --speculative): the run holds its weights in fp32
  // (bf16 where the file's embedding is BF16), which is what plan_generate plans and generate measures. For a preset
  // with a GGUF type for --weight-dtype, what its file would hold is reported beside it (quantized_weights_bytes).
  std::optional<uint64_t> quantized;
  std::string stored = a.step.weight_dtype;
  if (gguf::is_gguf_path(a.step.model)) {
    const gguf::GgufReader file(a.step.model);
    r.model = gguf::config_from_gguf(file);
    uint64_t bytes = 0;
    for (const gguf::TensorInfo& t : file.tensors()) bytes += t.nbytes;
    quantized = bytes;
    const bool bf16 = file.tensor("token_embd.weight").type == gguf::ggml_type::BF16;
    r.weight_dtype = bf16 ? DType::BF16 : DType::F32;
    stored = "the file's types";
  } else {
    r.model = model::load_config(a.step.model);
    if (a.step.weight_dtype == "fp32" || a.step.weight_dtype == "bf16") {
      r.weight_dtype = parse_dtype(a.step.weight_dtype);
    } else {
      quantized = gguf::quantized_weight_bytes(r.model, gguf::parse_quant_scheme(a.step.weight_dtype));
      r.weight_dtype = DType::F32;
    }
  }
  r.context = a.context;
  r.batch = a.step.batch;
  r.draft = speculative_draft(a.spec);
  if (r.draft > 0 && r.model.mtp_layers < 1)
    throw std::invalid_argument("--speculative mtp: model " + a.step.model + " has no multi-token-prediction layer "
                                "(mtp.*; num_nextn_predict_layers / mtp_num_hidden_layers is 0): plan a '+mtp' preset "
                                "(e.g. --model small+mtp), or plan without --speculative");
  const planner::GeneratePlan p = planner::plan_generate(r);
  const std::string runs_as(dtype_name(r.weight_dtype));
  if (a.json) {
    nlohmann::json j{{"weights_bytes", p.weights}, {"kv_cache_bytes", p.kv_cache},
                     {"recurrent_state_bytes", p.recurrent_state}, {"workspace_bytes", p.workspace},
                     {"total_bytes", p.total}, {"context", r.context}, {"batch", r.batch}};
    if (r.draft > 0) {
      j["speculative"] = "mtp";
      j["draft"] = r.draft;
      j["mtp_kv_cache_bytes"] = p.mtp_kv_cache;
    }
    if (quantized) {
      j["weights_run_as"] = runs_as;
      j["quantized_weights_bytes"] = *quantized;
      j["total_with_quantized_weights_bytes"] = p.total - p.weights + *quantized;
    }
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("%s\ngenerate: %lld sequences x %lld positions, weights %s%s, one device\n",
              model::describe(r.model).c_str(), (long long)r.batch, (long long)r.context, stored.c_str(),
              r.draft > 0 ? (", speculative mtp, draft " + std::to_string(r.draft)).c_str() : "");
  if (quantized)
    std::printf("(dequantized at load today: the run holds the weights in %s, as planned below)\n", runs_as.c_str());
  for (const auto& [what, bytes] : {std::pair{"weights", p.weights}, {"kv cache", p.kv_cache},
                                    {"recurrent state", p.recurrent_state}, {"mtp kv cache", p.mtp_kv_cache},
                                    {"workspace", p.workspace}, {"total", p.total}})
    if (r.draft > 0 || std::string(what) != "mtp kv cache")
      std::printf("%-18s %12s\n", what, format_bytes(double(bytes)).c_str());
  if (quantized)
    std::printf("%-18s %12s  (total %s once quantized storage lands: a prediction; its dequantizing workspace is "
                "not planned)\n",
                "quantized weights", format_bytes(double(*quantized)).c_str(),
                format_bytes(double(p.total - p.weights + *quantized)).c_str());
}

// plan --serve: hybridscan serve's peak for --parallel slots of --ctx positions and a --cache-bytes prefix cache.
// A .gguf --model: as serve runs it, from its quantized blocks (unless --speculative or --gguf-dequantize needs it
// dequantized: then in fp32, bf16 where the file's embedding is BF16, as the imported checkpoint holds it).
void plan_serving(const PlanArgs& a) {
  planner::ServePlanRequest r;
  std::vector<std::string> needs_dequantized;
  if (!a.spec.speculative.empty()) needs_dequantized.push_back("--speculative " + a.spec.speculative);
  const bool blocks = gguf_from_blocks(a.gguf, a.step.model, needs_dequantized, "plan");
  std::string weights = a.step.weight_dtype;
  if (blocks) {
    r.gguf_path = a.step.model;
    r.model = gguf::config_from_gguf(gguf::GgufReader(a.step.model));
    weights = "gguf blocks";
  } else if (gguf::is_gguf_path(a.step.model)) {
    const gguf::GgufReader file(a.step.model);
    r.model = gguf::config_from_gguf(file);
    r.weight_dtype = file.tensor("token_embd.weight").type == gguf::ggml_type::BF16 ? DType::BF16 : DType::F32;
    weights = std::string(dtype_name(r.weight_dtype)) + " (the .gguf dequantized)";
  } else {
    r.model = model::load_config(a.step.model);
    r.weight_dtype = parse_dtype(a.step.weight_dtype);
  }
  r.context = a.context;
  r.parallel = a.parallel;
  r.cache_bytes = parse_bytes(a.cache_bytes);
  r.draft = speculative_draft(a.spec);
  if (r.draft > 0 && r.model.mtp_layers < 1)
    throw std::invalid_argument("--speculative mtp: model " + a.step.model + " has no multi-token-prediction layer "
                                "(mtp.*) to draft with: plan a model with one (e.g. --model small+mtp), or plan "
                                "without --speculative");
  const planner::ServePlan p = planner::plan_serve(r);
  if (a.json) {
    nlohmann::json j{{"weights_bytes", p.weights}, {"kv_cache_bytes", p.kv_cache},
                     {"recurrent_state_bytes", p.recurrent_state}, {"prefix_cache_bytes", p.prefix_cache},
                     {"workspace_bytes", p.workspace}, {"total_bytes", p.total}, {"context", r.context},
                     {"parallel", r.parallel}};
    if (blocks) {
      j["weights_run_as"] = "gguf blocks";
      j["converted_weights_bytes"] = p.converted_bytes;
      j["quantized_weights_bytes"] = p.quantized_bytes;
    }
    if (r.draft > 0) {
      j["speculative"] = "mtp";
      j["draft"] = r.draft;
      j["mtp_kv_cache_bytes"] = p.mtp_kv_cache;
    }
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("%s\nserve: %lld slots x %lld positions, prefix cache %s, weights %s%s, one device\n",
              model::describe(r.model).c_str(), (long long)r.parallel, (long long)r.context,
              format_bytes(double(r.cache_bytes)).c_str(), weights.c_str(),
              r.draft > 0 ? (", speculative mtp, draft " + std::to_string(r.draft)).c_str() : "");
  for (const auto& [what, bytes] : {std::pair{"weights", p.weights}, {"kv cache", p.kv_cache},
                                    {"recurrent state", p.recurrent_state}, {"mtp kv cache", p.mtp_kv_cache},
                                    {"prefix cache", p.prefix_cache}, {"workspace", p.workspace}, {"total", p.total}})
    if (r.draft > 0 || std::string_view(what) != "mtp kv cache")
      std::printf("%-18s %12s\n", what, format_bytes(double(bytes)).c_str());
  if (blocks)
    std::printf("(weights: %s converted to fp32 + %s of quantized blocks used in place from the file)\n",
                format_bytes(double(p.converted_bytes)).c_str(), format_bytes(double(p.quantized_bytes)).c_str());
}

// The request of a training-step plan: --batch is over all devices (a multiple of them), --batch-per-device per device
// (default 1); the budget is --chip's HBM or --memory-budget.
planner::PlanRequest plan_request(const PlanArgs& a) {
  const bool global_batch = a.step.batch_option->count() > 0;
  if (global_batch && a.step.batch % a.devices != 0)
    throw std::invalid_argument("--batch " + std::to_string(a.step.batch) + " must be a multiple of --devices " +
                                std::to_string(a.devices));
  const int64_t per_device =
      global_batch ? a.step.batch / a.devices : (a.batch_per_device > 0 ? a.batch_per_device : planner::PlanRequest{}.batch_per_device);
  const bool budget = !a.chip.empty() || !a.step.memory_budget.empty();
  planner::PlanRequest r = step_plan_request(a.step, model::load_config(a.step.model), a.devices, per_device,
                                             /*for_this_machine=*/!budget);
  r.hbm_bytes = !a.chip.empty() ? planner::chip_hbm_bytes(a.chip)
                                : (!a.step.memory_budget.empty() ? parse_bytes(a.step.memory_budget) : 0);
  return r;
}

// plan --fit: every candidate, the choice and why each other is not it.
void run_fit(const PlanArgs& a, const planner::PlanRequest& r) {
  if (r.hbm_bytes == 0) throw std::invalid_argument("--fit needs a memory budget: --chip or --memory-budget");
  const planner::FitResult f = planner::plan_fit(r, r.hbm_bytes);
  if (a.json) {
    nlohmann::json j = {{"choice", f.choice}, {"candidates", nlohmann::json::array()}};
    for (const auto& cand : f.candidates) {
      nlohmann::json e = to_json(cand.plan);
      e["why_not"] = cand.why;
      j["candidates"].push_back(e);
    }
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("%s\n%lld devices, batch %lld x seq %lld per device, weights %s, compute %s, budget %s\n",
              model::describe(r.model).c_str(), (long long)r.devices, (long long)r.batch_per_device, (long long)r.seq,
              a.step.weight_dtype.c_str(), a.step.compute_dtype.c_str(), gb(r.hbm_bytes).c_str());
  std::printf("%-10s %-8s %-9s %12s %12s %12s  %s\n", "remat", "moments", "update", "argument", "temp", "total", "");
  for (const auto& cand : f.candidates)
    std::printf("%-10s %-8s %-9s %12s %12s %12s  %s\n", train::remat_name(cand.plan.remat).c_str(),
                std::string(dtype_name(cand.plan.moment_dtype)).c_str(),
                cand.plan.update_in_backward ? "backward" : "step", gb(cand.plan.argument_bytes).c_str(),
                gb(cand.plan.temp_bytes).c_str(), gb(cand.plan.total_bytes).c_str(),
                cand.why.empty() ? "<- the choice" : cand.why.c_str());
  if (f.choice < 0) std::printf("nothing fits\n");
}

// The plans of one policy, of each (--compare) or of the one --remat auto picks: JSON, or a table with the last
// one's temp by category and its largest buffers.
void print_plans(const PlanArgs& a, const planner::PlanRequest& r, const std::vector<planner::PlanResult>& plans) {
  if (a.json) {
    nlohmann::json j = a.compare ? nlohmann::json::array() : to_json(plans[0]);
    if (a.compare)
      for (const auto& p : plans) j.push_back(to_json(p));
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("%s\n%lld devices, FSDP %lld, batch %lld x seq %lld per device%s, weights %s, compute %s\n",
              model::describe(r.model).c_str(), (long long)r.devices, (long long)plans[0].fsdp, (long long)r.batch_per_device,
              (long long)r.seq,
              r.grad_accum > 1 ? (" (" + std::to_string(r.grad_accum) + " micro-batches an update)").c_str() : "",
              a.step.weight_dtype.c_str(), a.step.compute_dtype.c_str());
  std::printf("%-10s %12s %12s %12s %12s  %s\n", "remat", "argument", "temp", "total", "hbm", "fits");
  for (const auto& p : plans)
    std::printf("%-10s %12s %12s %12s %12s  %s\n", train::remat_name(p.remat).c_str(), gb(p.argument_bytes).c_str(),
                gb(p.temp_bytes).c_str(), gb(p.total_bytes).c_str(), p.hbm_bytes ? gb(p.hbm_bytes).c_str() : "-",
                p.hbm_bytes ? (p.fits ? "yes" : "NO") : "-");
  const auto& last = plans.back();
  std::printf("temp of '%s' by category:", train::remat_name(last.remat).c_str());
  for (size_t i = 0; i < kNumMemCategories; ++i)
    if (!is_argument(static_cast<MemCategory>(i)))
      std::printf(" %s %s;", std::string(category_name(static_cast<MemCategory>(i))).c_str(), gb(last.peak.bytes[i]).c_str());
  std::printf("\nlargest live buffers at the peak:\n");
  for (const auto& b : last.peak.largest)
    std::printf("  %-24s %-16s %s\n", b.tag.c_str(), std::string(category_name(b.category)).c_str(), gb(b.bytes).c_str());
}

void run_plan(const PlanArgs& a) {
  apply_threads(a.step.threads);
  if (a.generate && a.serve) throw std::invalid_argument("give --generate or --serve, not both");
  if ((a.gguf.blocks || a.gguf.dequantize) && !a.generate && !a.serve)
    throw std::invalid_argument("--gguf-blocks and --gguf-dequantize are for plan --generate and plan --serve");
  if (!a.generate && !a.serve && (!a.spec.speculative.empty() || a.spec.draft != -1))
    throw std::invalid_argument("--speculative and --draft are for plan --generate and plan --serve");
  if (a.generate) {
    plan_generation(a);
    return;
  }
  if (a.step.weight_dtype != "fp32" && a.step.weight_dtype != "bf16")
    throw std::invalid_argument("--weight-dtype " + a.step.weight_dtype + " (GGUF) is for plan --generate; training "
                                "stores fp32 or bf16");
  if (a.serve) {
    plan_serving(a);
    return;
  }
  planner::PlanRequest r = plan_request(a);
  if (a.fit) return run_fit(a, r);
  std::vector<planner::PlanResult> plans;
  if (a.compare) {
    for (auto p : {train::RematPolicy::None, train::RematPolicy::Block, train::RematPolicy::Sublayer}) {
      r.step.remat = p;
      plans.push_back(planner::plan(r));
    }
  } else if (a.step.remat == "auto") {
    if (r.hbm_bytes == 0) throw std::invalid_argument("--remat auto needs a memory budget: --chip or --memory-budget");
    plans.push_back(planner::plan_auto(r, r.hbm_bytes));
  } else {
    plans.push_back(planner::plan(r));
  }
  print_plans(a, r, plans);
}

}  // namespace

void register_plan(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* c = app.add_subcommand("plan", "Predict the per-device memory of a training step (no hardware needed)");
  // Without --batch: one sequence per device (PlanRequest::batch_per_device).
  add_step_options(c, a->step, {planner::PlanRequest{}.batch_per_device, planner::PlanRequest{}.seq});
  c->add_option("--devices", a->devices, "Devices in the job")->capture_default_str();
  c->add_option("--batch-per-device", a->batch_per_device, "Sequences per device per step (default 1; or --batch for all)")
      ->excludes(a->step.batch_option);
  c->add_option("--chip", a->chip, "v5p | v6e | tpu7x | h100 | h200 (sets --memory-budget to its HBM per device)")
      ->excludes(c->get_option("--memory-budget"));
  c->add_flag("--compare", a->compare, "Plan none, block and sublayer side by side");
  c->add_flag("--generate", a->generate,
              "Plan generation instead of training: --batch sequences decoded together on one device, weights in "
              "--weight-dtype");
  c->add_option("--context,--ctx", a->context, "--generate, --serve: positions per sequence (prompt + new tokens)")
      ->capture_default_str();
  c->add_flag("--serve", a->serve,
              "Plan hybridscan serve instead of training: --parallel slots of --ctx positions, a --cache-bytes prefix "
              "cache, weights in --weight-dtype");
  add_speculative_options(c, a->spec);
  c->add_option("--parallel", a->parallel, "--serve: slots (requests decoded together)")->capture_default_str();
  c->add_option("--cache-bytes", a->cache_bytes, "--serve: the prefix cache's budget")->capture_default_str();
  // plan --generate also takes GGUF types (and a .gguf --model); the step's flag knows only fp32 | bf16.
  c->remove_option(c->get_option("--weight-dtype"));
  c->add_option("--weight-dtype", a->step.weight_dtype,
                "Weight storage: fp32 | bf16; with --generate also f16 | q8_0 | q4_k | q5_k | q6_k | mixed (GGUF)")
      ->check(CLI::IsMember({"fp32", "bf16", "f16", "q8_0", "q4_k", "q5_k", "q6_k", "mixed"}))
      ->capture_default_str();
  add_gguf_options(c, a->gguf);
  c->add_option("--prefill-piece", a->prefill_piece, "--generate of a .gguf from its blocks: prompt tokens per prefill pass")
      ->capture_default_str();
  c->add_flag("--json", a->json, "Print JSON");
  c->add_flag("--fit", a->fit,
              "With --chip or --memory-budget: the cheapest remat x moment dtype x update in backward that fits (least "
              "recomputation, then exact moments, then the usual step before --update-in-backward, then least memory), "
              "and why each other does not win");
  c->callback([a] { run_plan(*a); });
}

}  // namespace hs::cli
