#include <omp.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/memory.h"
#include "kernels/matmul.h"
#include "mpi/mpi_collectives.h"
#include "planner/plan.h"
#include "train/trainer.h"

namespace hs::cli {

namespace {

constexpr const char* kDefaultCorpus = "data/kjv.txt";  // train's corpus when none is named

struct TrainArgs {
  train::TrainOptions o;
  std::string preset, config, remat = "sublayer", weight_dtype = "fp32", compute_dtype = "bf16", moment_dtype = "fp32", budget,
      piece = std::to_string(train::kDefaultGatherPieceBytes),
      vocab_piece = std::to_string(train::kDefaultGatherPieceBytes), packed_weights, delta_products = "fp32";
  int threads = 0;
  int64_t fsdp = 0;
  bool report_memory = false, json = false, quiet = false;
};

nlohmann::json memory_json(const MemorySnapshot& s) {
  nlohmann::json j;
  for (size_t i = 0; i < kNumMemCategories; ++i) j[std::string(category_name(static_cast<MemCategory>(i)))] = s.bytes[i];
  return j;
}

void print_memory(const MemorySnapshot& s) {
  std::printf("measured step peak by category (live at the peak):\n");
  for (size_t i = 0; i < kNumMemCategories; ++i) {
    MemCategory c = static_cast<MemCategory>(i);
    std::printf("  %-18s %12s  %s\n", std::string(category_name(c)).c_str(), format_bytes(double(s.bytes[i])).c_str(),
                is_argument(c) ? "(argument)" : "(temp)");
  }
  std::printf("  %-18s %12s\n  %-18s %12s\n  %-18s %12s\n", "argument", format_bytes(double(s.argument())).c_str(),
              "temp", format_bytes(double(s.temp())).c_str(), "peak", format_bytes(double(s.total())).c_str());
  std::printf("largest live buffers at the peak:\n");
  for (const auto& b : s.largest)
    std::printf("  %-28s %-18s %12s\n", b.tag.c_str(), std::string(category_name(b.category)).c_str(),
                format_bytes(double(b.bytes)).c_str());
}

}  // namespace

void register_train(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  CLI::App* c = app.add_subcommand("train", "Train a model on a text (byte tokens or a tokenizer's), a token file, or random tokens");
  auto* preset = c->add_option("--preset", a->preset, "Model preset: tiny, small, qwen3.5-tiny (the Qwen3.5 vocabulary), qwen3-next-80b-a3b, qwen3.5-35b-a3b, qwen3.5-397b-a17b");
  auto* config = c->add_option("--config", a->config, "Hugging Face config.json (or a directory holding one)");
  preset->excludes(config);
  auto* text = c->add_option("--text", a->o.text,
                             "Training text: byte tokens, or encoded by --tokenizer (default: the tokenizer.json beside "
                             "the --init / --resume weights); the last 2% is held out")
                   ->check(CLI::ExistingFile);
  c->add_option("--data", a->o.data, "Token file from 'hybridscan tokenize' (memory-mapped); the last 2% is held out")
      ->check(CLI::ExistingFile)
      ->excludes(text);
  c->add_option("--tokenizer", a->o.tokenizer,
                "tokenizer.json (or a directory holding one) to encode --text with and to check --data against")
      ->check(CLI::ExistingPath);
  c->add_flag("--synthetic", a->o.synthetic, "Train on random tokens (for benchmarking)");
  c->add_option("--steps", a->o.steps, "Optimizer steps")->capture_default_str();
  c->add_option("--batch", a->o.batch, "Sequences per step")->capture_default_str();
  c->add_option("--seq", a->o.seq, "Tokens per sequence")->capture_default_str();
  c->add_option("--lr", a->o.opt.lr, "Peak learning rate (warmup then cosine decay)")->capture_default_str();
  c->add_option("--warmup", a->o.opt.warmup, "Warmup steps")->capture_default_str();
  c->add_option("--weight-decay", a->o.opt.weight_decay, "AdamW weight decay (matrices and embeddings)")->capture_default_str();
  c->add_option("--clip", a->o.opt.clip, "Global gradient-norm clip (0: off)")->capture_default_str();
  c->add_option("--seed", a->o.seed, "Seed for initialisation and data order")->capture_default_str();
  c->add_option("--remat", a->remat,
                "Rematerialisation: none | block | sublayer | auto (least recomputation within --memory-budget)")
      ->check(CLI::IsMember({"none", "block", "sublayer", "auto"}))->capture_default_str();
  c->add_option("--memory-budget", a->budget, "Memory budget for --remat auto, e.g. 2GiB");
  c->add_option("--weight-dtype", a->weight_dtype, "Weight storage: fp32 | bf16")->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  c->add_option("--compute-dtype", a->compute_dtype, "Compute / activation dtype: fp32 | bf16")->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  c->add_option("--moment-dtype", a->moment_dtype, "AdamW moments: fp32 | bf16 (stored rounded to nearest even)")
      ->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  c->add_option("--threads", a->threads, "OpenMP threads (0: all cores)")->capture_default_str();
  c->add_option("--packed-weights", a->packed_weights,
                "on | off: reorder each sub-layer's weights once into oneDNN's packed layout for its products "
                "(the same bits; default: HS_PACKED_WEIGHTS, else off)")
      ->check(CLI::IsMember({"on", "off"}));
  c->add_option("--delta-rule-products", a->delta_products,
                "fp32 | bf16: the delta rule's matrix products in fp32, or with bf16 inputs and fp32 sums (vdpbf16ps; "
                "bf16 compute on a CPU with AVX-512-BF16, else fp32)")
      ->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  c->add_option("--out", a->o.out, "Output directory (metrics.jsonl, loss.svg)");
  c->add_option("--eval-every", a->o.eval_every, "Held-out evaluation every N steps (0: never)")->capture_default_str();
  c->add_option("--eval-batches", a->o.eval_batches, "Batches per held-out evaluation")->capture_default_str();
  c->add_flag("--report-memory", a->report_memory, "Print the measured step peak broken down by category");
  c->add_flag("--json", a->json, "End with one JSON line: tokens_per_s, final_loss, argument_bytes, temp_bytes, peak_bytes, ...");
  c->add_flag("--quiet", a->quiet, "No progress line");
  c->add_flag("--profile", a->o.profile,
              "Time every step by phase (matrix products, delta rule, attention, MoE dispatch, elementwise, loss, "
              "optimizer, communication, allocation, other): a \"profile\" object per metrics.jsonl line, a table at "
              "the end, and \"profile\" in --json (steady-state steps). Also HS_PROFILE=1");
  c->add_option("--save-every", a->o.save_every, "Write <out>/checkpoint-<step> every N steps (always at the end with --out)");
  auto* init = c->add_option("--init", a->o.init, "Start from the weights of a checkpoint (native or Hugging Face)")->check(CLI::ExistingDirectory);
  auto* resume = c->add_option("--resume", a->o.resume, "Continue a training checkpoint exactly (options, weights, optimizer, data order)")
                     ->check(CLI::ExistingDirectory);
  init->excludes(resume);
  c->add_option("--stop-after", a->o.stop_after, "Stop (and save) after N steps of the --steps schedule");
  c->add_option("--fsdp", a->fsdp, "Under mpirun: ranks per FSDP group (default: all; data parallel across groups)");
  c->add_option("--expert-parallel", a->o.step.expert_parallel,
                "Under mpirun: split the routed experts over E consecutive ranks of each FSDP group and exchange the "
                "tokens' rows with them (all-to-all); E divides the group and the experts")
      ->capture_default_str();
  c->add_flag("--prefetch", a->o.step.prefetch,
              "Sharded runs: gather the next sub-layer's weights while this one computes and reduce-scatter its "
              "gradients during the next backward (one more sub-layer's weights and gradients live)");
  c->add_option("--gather-piece-bytes", a->piece,
                "Routed experts are gathered and their gradients reduce-scattered in pieces of at most this size "
                "(compute dtype; 0: a whole layer)")
      ->capture_default_str();
  c->add_option("--vocab-piece-bytes", a->vocab_piece,
                "The LM head and the embedding are gathered (or cast) and their gradients reduce-scattered in "
                "vocabulary pieces of at most this size (compute dtype; 0: whole tensors); the LM head's log-sum-exp "
                "is then streamed over the pieces")
      ->capture_default_str();
  c->add_flag("--update-in-backward", a->o.update_in_backward,
              "Apply AdamW to each gradient shard as soon as the backward completes it (no gradient set lives across "
              "the step; the same parameters to the bit). Needs --clip 0: clipping needs the global norm before any "
              "update");
  c->callback([a, c] {
    TrainArgs& x = *a;
    x.o.step.gather_piece_bytes = parse_bytes(x.piece);
    x.o.step.pack_weights = x.packed_weights.empty() ? kernels::weight_packing_default() : x.packed_weights == "on";
    x.o.step.vocab_piece_bytes = parse_bytes(x.vocab_piece);
    x.o.step.delta_rule_bf16_products = x.delta_products == "bf16";
    // Under mpirun every rank runs this: MPI first, so that option errors stop every rank alike.
    std::unique_ptr<mpi::Runtime> rt;
    mpi::Groups groups;
    train::Distributed dist;
    if (mpi::launched_by_mpirun()) {
      rt = std::make_unique<mpi::Runtime>(nullptr, nullptr);
      try {
        groups = mpi::make_groups(*rt, x.fsdp, x.o.step.expert_parallel);
      } catch (const std::exception& e) {
        rt->abort(std::string("error: ") + e.what());
      }
      dist = {groups.world.get(), groups.fsdp.get(), groups.replicas.get(), groups.experts.get()};
      x.o.dist = &dist;
    } else if (x.fsdp > 1) {
      throw std::invalid_argument("--fsdp " + std::to_string(x.fsdp) + " needs that many processes: start with mpirun -np N");
    }
    const int64_t world = rt ? rt->world_size() : 1;
    const bool lead = !rt || rt->world_rank() == 0;
    x.o.model = !x.config.empty() ? x.config : (!x.preset.empty() ? x.preset : "small");
    x.o.weight_dtype = parse_dtype(x.weight_dtype);
    x.o.step.compute = parse_dtype(x.compute_dtype);
    x.o.opt.moment_dtype = parse_dtype(x.moment_dtype);
    if (x.remat == "auto") {
      if (x.budget.empty()) throw std::invalid_argument("--remat auto needs --memory-budget SIZE (e.g. 2GiB)");
      if (!x.o.resume.empty())
        throw std::invalid_argument("--remat auto chooses the policy of a new run; a resume continues the checkpoint's "
                                    "(leave --remat out)");
      // The planner's choice for exactly this run: the same schedule over shapes.
      planner::PlanRequest r;
      r.model = model::load_config(!x.o.resume.empty() || !x.o.init.empty() ? (!x.o.resume.empty() ? x.o.resume : x.o.init)
                                                                          : x.o.model);
      r.devices = world;
      r.fsdp = x.fsdp;
      r.batch_per_device = std::max<int64_t>(1, x.o.batch / world);
      r.step = x.o.step;
      r.seq = x.o.seq;
      r.weight_dtype = x.o.weight_dtype;
      r.moment_dtype = x.o.opt.moment_dtype;
      r.update_in_backward = x.o.update_in_backward;
      planner::PlanResult p = planner::plan_auto(r, parse_bytes(x.budget));
      x.o.step.remat = p.remat;
      if (lead) std::fprintf(stderr, "remat auto: %s (planned step peak %s, budget %s)%s\n", train::remat_name(p.remat).c_str(),
                   format_bytes(double(p.total_bytes)).c_str(), x.budget.c_str(),
                   p.fits ? "" : " -- does not fit: the smallest policy is used, expect to run out of memory");
    } else {
      x.o.step.remat = train::parse_remat(x.remat);
    }
    x.o.compute_given = c->get_option("--compute-dtype")->count() > 0;
    x.o.remat_given = x.remat != "auto" && c->get_option("--remat")->count() > 0;
    x.o.delta_products_given = c->get_option("--delta-rule-products")->count() > 0;
    x.o.progress = !x.quiet;
    // The default corpus is the CLI's (scripts/setup.sh renders it); a resume takes the checkpoint's back instead.
    if (x.o.text.empty() && x.o.data.empty() && !x.o.synthetic && x.o.resume.empty()) {
      if (!std::filesystem::exists(kDefaultCorpus))
        throw std::invalid_argument(std::string("no corpus: pass --data TOKENS or --text FILE, run scripts/setup.sh to "
                                                "install the default one (") + kDefaultCorpus +
                                    "), or use --synthetic for random tokens");
      x.o.text = kDefaultCorpus;
    }
    if (x.threads > 0) omp_set_num_threads(x.threads);
    if (lead && (x.o.step.compute == DType::BF16 || !x.o.resume.empty())) note_bf16_widening("train");
    train::TrainSummary s;
    if (rt) {
      // A rank's error ends the job: the other ranks would wait for it in their next collective.
      try {
        s = train::run_training(x.o, std::cerr);
      } catch (const std::exception& e) {
        rt->abort(std::string("error: ") + e.what());
      }
    } else {
      s = train::run_training(x.o, std::cerr);
    }
    // Every rank's step peak and exposed communication, for rank 0 to report.
    std::vector<double> peaks(static_cast<size_t>(world), 0.0), exposed(static_cast<size_t>(world), 0.0);
    const size_t me = rt ? static_cast<size_t>(rt->world_rank()) : 0;
    peaks[me] = double(s.peak_bytes);
    exposed[me] = s.comm_exposed_s;
    if (rt) {
      dist.world->all_reduce_sum(peaks.data(), world);
      dist.world->all_reduce_sum(exposed.data(), world);
    }
    if (!lead) return;
    if (x.report_memory) print_memory(s.peak);
    std::printf("trained %lld steps: final loss %.4f (ce %.4f), %.0f tokens/s%s\n", (long long)s.steps, s.final_loss,
                s.final_ce, s.tokens_per_s,
                s.eval_ce >= 0 ? (", held-out " + std::to_string(s.eval_ce) + " nats/token = " +
                                  std::to_string(s.eval_bits_per_byte) + " bits/byte").c_str()
                               : "");
    if (rt)
      std::printf("%lld ranks: rank 0 waited %.3f s for communication in %.3f s of steady-state steps\n",
                  (long long)world, s.comm_exposed_s, s.step_s);
    if (!s.profile.is_null() && !x.json) {
      const double step = s.profile["step_s"].get<double>();
      std::printf("phase time of the steady-state steps (%.3f s; the phases add up to %.3f s):\n", step,
                  s.profile["phase_sum_s"].get<double>());
      for (const auto& [name, sec] : s.profile["seconds"].items())
        std::printf("  %-14s %9.4f s %6.1f%%  %llu calls\n", name.c_str(), sec.get<double>(),
                    step > 0 ? 100.0 * sec.get<double>() / step : 0.0,
                    (unsigned long long)s.profile["calls"][name].get<uint64_t>());
    }
    if (x.json) {
      nlohmann::json j = {{"steps", s.steps},
                          {"tokens_per_s", s.tokens_per_s},
                          {"final_loss", s.final_loss},
                          {"final_ce", s.final_ce},
                          {"eval_ce", s.eval_ce},
                          {"eval_bits_per_byte", s.eval_bits_per_byte},
                          {"argument_bytes", s.argument_bytes},
                          {"temp_bytes", s.temp_bytes},
                          {"peak_bytes", s.peak_bytes},
                          {"peak_rss_bytes", peak_resident_bytes()},
                          {"ranks", world},
                          {"rank_peak_bytes", std::vector<size_t>(peaks.begin(), peaks.end())},
                          {"rank_comm_exposed_s", exposed},
                          {"step_s", s.step_s},
                          {"losses", s.losses},
                          {"temp_by_category", memory_json(s.peak)},
                          {"remat", x.remat},
                          {"weight_dtype", x.weight_dtype},
                          {"compute_dtype", x.compute_dtype}};
      if (!s.profile.is_null()) j["profile"] = s.profile;
      std::printf("%s\n", j.dump().c_str());
    }
  });
}

}  // namespace hs::cli
