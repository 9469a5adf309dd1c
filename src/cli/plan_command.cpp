#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "kernels/matmul.h"
#include "planner/plan.h"

namespace hs::cli {

namespace {

struct PlanArgs {
  std::string model = "small", remat = "sublayer", weight_dtype = "fp32", compute_dtype = "bf16", moment_dtype = "fp32", chip, hbm,
      piece = std::to_string(train::kDefaultGatherPieceBytes),
      vocab_piece = std::to_string(train::kDefaultGatherPieceBytes), packed_weights, delta_products = "fp32";
  int64_t devices = 1, fsdp = 0, batch = 1, seq = 1024, ep = 1, context = 4096, gen_batch = 1;
  bool compare = false, json = false, generate = false, prefetch = false, fit = false, update_in_backward = false;
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

void plan_generation(const PlanArgs& a) {
  planner::GeneratePlanRequest r;
  r.model = model::load_config(a.model);
  r.context = a.context;
  r.batch = a.gen_batch;
  r.weight_dtype = parse_dtype(a.weight_dtype);
  const planner::GeneratePlan p = planner::plan_generate(r);
  if (a.json) {
    std::printf("%s\n", nlohmann::json({{"weights_bytes", p.weights}, {"kv_cache_bytes", p.kv_cache},
                                        {"recurrent_state_bytes", p.recurrent_state}, {"workspace_bytes", p.workspace},
                                        {"total_bytes", p.total}, {"context", r.context}, {"batch", r.batch}})
                            .dump()
                            .c_str());
    return;
  }
  std::printf("%s\ngenerate: %lld sequences x %lld positions, weights %s, one device\n", model::describe(r.model).c_str(),
              (long long)r.batch, (long long)r.context, a.weight_dtype.c_str());
  for (const auto& [what, bytes] : {std::pair{"weights", p.weights}, {"kv cache", p.kv_cache},
                                    {"recurrent state", p.recurrent_state}, {"workspace", p.workspace}, {"total", p.total}})
    std::printf("%-18s %12s\n", what, format_bytes(double(bytes)).c_str());
}

}  // namespace

void register_plan(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* c = app.add_subcommand("plan", "Predict the per-device memory of a training step (no hardware needed)");
  c->add_option("--model", a->model, "Preset name or Hugging Face config.json")->capture_default_str();
  c->add_option("--devices", a->devices, "Devices in the job")->capture_default_str();
  c->add_option("--fsdp", a->fsdp, "FSDP group size (default: all devices)");
  c->add_option("--expert-parallel", a->ep,
                "Split routed experts over E devices of each FSDP group (train --expert-parallel): each gathers only "
                "its 1/E of them and exchanges its tokens' rows; balanced routing is assumed")
      ->capture_default_str();
  c->add_option("--batch-per-device", a->batch, "Sequences per device per step")->capture_default_str();
  c->add_option("--seq", a->seq, "Tokens per sequence")->capture_default_str();
  c->add_option("--remat", a->remat, "none | block | sublayer | auto")
      ->check(CLI::IsMember({"none", "block", "sublayer", "auto"}))->capture_default_str();
  c->add_option("--weight-dtype", a->weight_dtype, "fp32 | bf16")->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  c->add_option("--compute-dtype", a->compute_dtype, "bf16 | fp32")->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  c->add_option("--moment-dtype", a->moment_dtype, "AdamW moments: fp32 | bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  c->add_option("--packed-weights", a->packed_weights,
                "on | off: reorder each sub-layer's weights once into oneDNN's packed layout for its products "
                "(default: as train without --chip / --hbm, off with them: the sizes are this CPU's oneDNN layouts); it "
                "must match train's for plan = measured")
      ->check(CLI::IsMember({"on", "off"}));
  c->add_option("--delta-rule-products", a->delta_products,
                "As train --delta-rule-products: fp32 | bf16 (bf16 plans the products' pack buffers where this CPU "
                "would run them)")
      ->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  auto* chip = c->add_option("--chip", a->chip, "v5p | v6e | tpu7x | h100 | h200 (sets the HBM per device)");
  auto* hbm = c->add_option("--hbm", a->hbm, "HBM per device, e.g. 95GiB or 80GB");
  chip->excludes(hbm);
  c->add_flag("--compare", a->compare, "Plan none, block and sublayer side by side");
  c->add_flag("--generate", a->generate, "Plan generation instead of training (weights in --weight-dtype)");
  c->add_option("--context", a->context, "--generate: positions per sequence (prompt + new tokens)")->capture_default_str();
  c->add_option("--batch", a->gen_batch, "--generate: sequences decoded together")->capture_default_str();
  c->add_flag("--json", a->json, "Print JSON");
  c->add_flag("--fit", a->fit,
              "With --chip or --hbm: the cheapest remat x moment dtype x update in backward that fits (least "
              "recomputation, then exact moments, then the usual step before --update-in-backward, then least memory), "
              "and why each other does not win");
  c->add_flag("--update-in-backward", a->update_in_backward,
              "As train --update-in-backward: AdamW per gradient shard in the backward, no gradient set across the step");
  c->add_flag("--prefetch", a->prefetch, "As train --prefetch: the next sub-layer's gathers overlap this one's compute");
  c->add_option("--gather-piece-bytes", a->piece, "As train --gather-piece-bytes (0: a whole layer's experts at once)")
      ->capture_default_str();
  c->add_option("--vocab-piece-bytes", a->vocab_piece,
                "As train --vocab-piece-bytes (0: the LM head and the embedding whole)")
      ->capture_default_str();
  c->callback([a] {
    if (a->generate) {
      plan_generation(*a);
      return;
    }
    planner::PlanRequest r;
    r.step.gather_piece_bytes = parse_bytes(a->piece);
    r.step.vocab_piece_bytes = parse_bytes(a->vocab_piece);
    r.model = model::load_config(a->model);
    r.devices = a->devices;
    r.fsdp = a->fsdp;
    r.step.expert_parallel = a->ep;
    r.step.prefetch = a->prefetch;
    // A plan for this machine (no --chip / --hbm) packs as train does by default; an accelerator's plan does not.
    r.step.pack_weights = !a->packed_weights.empty() ? a->packed_weights == "on"
                                                : a->chip.empty() && a->hbm.empty() && kernels::weight_packing_default();
    r.batch_per_device = a->batch;
    r.seq = a->seq;
    r.weight_dtype = parse_dtype(a->weight_dtype);
    r.step.compute = parse_dtype(a->compute_dtype);
    r.moment_dtype = parse_dtype(a->moment_dtype);
    r.update_in_backward = a->update_in_backward;
    r.step.delta_rule_bf16_products = a->delta_products == "bf16";
    r.hbm_bytes = !a->chip.empty() ? planner::chip_hbm_bytes(a->chip) : (!a->hbm.empty() ? parse_bytes(a->hbm) : 0);
    std::vector<planner::PlanResult> plans;
    if (a->fit) {
      if (r.hbm_bytes == 0) throw std::invalid_argument("--fit needs a memory budget: --chip or --hbm");
      const planner::FitResult f = planner::plan_fit(r, r.hbm_bytes);
      if (a->json) {
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
                  a->weight_dtype.c_str(), a->compute_dtype.c_str(), gb(r.hbm_bytes).c_str());
      std::printf("%-10s %-8s %-9s %12s %12s %12s  %s\n", "remat", "moments", "update", "argument", "temp", "total", "");
      for (const auto& cand : f.candidates)
        std::printf("%-10s %-8s %-9s %12s %12s %12s  %s\n", train::remat_name(cand.plan.remat).c_str(),
                    std::string(dtype_name(cand.plan.moment_dtype)).c_str(),
                    cand.plan.update_in_backward ? "backward" : "step", gb(cand.plan.argument_bytes).c_str(),
                    gb(cand.plan.temp_bytes).c_str(), gb(cand.plan.total_bytes).c_str(),
                    cand.why.empty() ? "<- the choice" : cand.why.c_str());
      if (f.choice < 0) std::printf("nothing fits\n");
      return;
    }
    if (a->compare) {
      for (auto p : {train::RematPolicy::None, train::RematPolicy::Block, train::RematPolicy::Sublayer}) {
        r.step.remat = p;
        plans.push_back(planner::plan(r));
      }
    } else if (a->remat == "auto") {
      if (r.hbm_bytes == 0) throw std::invalid_argument("--remat auto needs a memory budget: --chip or --hbm");
      plans.push_back(planner::plan_auto(r, r.hbm_bytes));
    } else {
      r.step.remat = train::parse_remat(a->remat);
      plans.push_back(planner::plan(r));
    }
    if (a->json) {
      nlohmann::json j = a->compare ? nlohmann::json::array() : to_json(plans[0]);
      if (a->compare)
        for (const auto& p : plans) j.push_back(to_json(p));
      std::printf("%s\n", j.dump().c_str());
      return;
    }
    std::printf("%s\n%lld devices, FSDP %lld, batch %lld x seq %lld per device, weights %s, compute %s\n",
                model::describe(r.model).c_str(), (long long)r.devices, (long long)plans[0].fsdp, (long long)r.batch_per_device,
                (long long)r.seq, a->weight_dtype.c_str(), a->compute_dtype.c_str());
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
  });
}

}  // namespace hs::cli
