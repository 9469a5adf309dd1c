#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/step_options.h"
#include "cli/threads.h"
#include "core/memory.h"
#include "dataset/token_file.h"
#include "mpi/mpi_collectives.h"
#include "planner/plan.h"
#include "train/trainer.h"

namespace hs::cli {

namespace {

constexpr const char* kDefaultCorpus = "data/kjv.txt";  // train's corpus when none is named

struct TrainArgs {
  train::TrainOptions o;
  StepArgs step;
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

// --remat auto: the planner's choice for exactly this run, the same step over shapes.
void choose_remat(TrainArgs& x, int64_t world, bool lead) {
  if (x.step.memory_budget.empty()) throw std::invalid_argument("--remat auto needs --memory-budget SIZE (e.g. 2GiB)");
  if (!x.o.resume.empty())
    throw std::invalid_argument("--remat auto chooses the policy of a new run; a resume continues the checkpoint's "
                                "(leave --remat out)");
  const planner::PlanRequest r =
      step_plan_request(x.step, model::load_config(!x.o.init.empty() ? x.o.init : x.o.model), world,
                        std::max<int64_t>(1, x.o.batch / world), /*for_this_machine=*/true);
  const planner::PlanResult p = planner::plan_auto(r, parse_bytes(x.step.memory_budget));
  x.o.step.remat = p.remat;
  if (lead) std::fprintf(stderr, "remat auto: %s (planned step peak %s, budget %s)%s\n", train::remat_name(p.remat).c_str(),
               format_bytes(double(p.total_bytes)).c_str(), x.step.memory_budget.c_str(),
               p.fits ? "" : " -- does not fit: the smallest policy is used, expect to run out of memory");
}

// The default corpus is the CLI's (scripts/setup.sh renders it); a resume takes the checkpoint's back instead.
void take_default_corpus(train::TrainOptions& o) {
  if (o.text.empty() && o.data.empty() && !o.synthetic && o.resume.empty()) {
    if (!std::filesystem::exists(kDefaultCorpus))
      throw std::invalid_argument(std::string("no corpus: pass --data TOKENS or --text FILE, run scripts/setup.sh to "
                                              "install the default one (") + kDefaultCorpus +
                                  "), or use --synthetic for random tokens");
    o.text = kDefaultCorpus;
  }
}

// --packing auto: documents for a token file of several documents (what train::sample_batch would choose), so that
// a --remat auto plan counts the batch the run makes.
void resolve_packing(train::TrainOptions& o) {
  if (o.step.packing != train::Packing::Auto || o.data.empty() || !std::filesystem::exists(o.data)) return;
  const auto f = dataset::TokenFile::open(o.data);
  const bool documents = f->header().documents > 1 && f->header().end_of_text.has_value();
  o.step.packing = documents ? train::Packing::Documents : train::Packing::Stream;
}

// Rank 0's report: the summary line, the memory and phase tables, the JSON line.
void report(const TrainArgs& x, const train::TrainSummary& s, int64_t world, bool distributed,
            const std::vector<double>& peaks, const std::vector<double>& exposed) {
  if (x.report_memory) print_memory(s.peak);
  std::printf("trained %lld steps: final loss %.4f (ce %.4f), %.0f tokens/s%s\n", (long long)s.steps, s.final_loss,
              s.final_ce, s.tokens_per_s,
              s.eval_ce >= 0 ? (", held-out " + std::to_string(s.eval_ce) + " nats/token = " +
                                std::to_string(s.eval_bits_per_byte) + " bits/byte").c_str()
                             : "");
  if (distributed)
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
                        {"remat", x.step.remat},
                        {"weight_dtype", x.step.weight_dtype},
                        {"compute_dtype", x.step.compute_dtype}};
    if (!s.profile.is_null()) j["profile"] = s.profile;
    std::printf("%s\n", j.dump().c_str());
  }
}

void run_train(TrainArgs& x) {
  fill_train_options(x.step, x.o);
  resolve_packing(x.o);
  // Under mpirun every rank runs this: MPI first, so that option errors stop every rank alike.
  std::unique_ptr<mpi::Runtime> rt;
  mpi::Groups groups;
  train::Distributed dist;
  if (mpi::launched_by_mpirun()) {
    rt = std::make_unique<mpi::Runtime>(nullptr, nullptr);
    try {
      groups = mpi::make_groups(*rt, x.step.fsdp, x.o.step.expert_parallel);
    } catch (const std::exception& e) {
      rt->abort(std::string("error: ") + e.what());
    }
    dist = {groups.world.get(), groups.fsdp.get(), groups.replicas.get(), groups.experts.get()};
    x.o.dist = &dist;
  } else if (x.step.fsdp > 1) {
    throw std::invalid_argument("--fsdp " + std::to_string(x.step.fsdp) + " needs that many processes: start with mpirun -np N");
  }
  const int64_t world = rt ? rt->world_size() : 1;
  const bool lead = !rt || rt->world_rank() == 0;
  if (x.step.remat == "auto") choose_remat(x, world, lead);
  x.o.compute_given = x.step.compute_option->count() > 0;
  x.o.remat_given = x.step.remat != "auto" && x.step.remat_option->count() > 0;
  x.o.delta_products_given = x.step.delta_option->count() > 0;
  x.o.progress = !x.quiet;
  take_default_corpus(x.o);
  apply_threads(x.step.threads);
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
  if (lead) report(x, s, world, rt != nullptr, peaks, exposed);
}

}  // namespace

void register_train(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  CLI::App* c = app.add_subcommand("train", "Train a model on a text (byte tokens or a tokenizer's), a token file, or random tokens");
  add_step_options(c, a->step, {train::TrainOptions{}.batch, train::TrainOptions{}.seq});
  auto* text = c->add_option("--text", a->o.text,
                             "Training text: byte tokens, or encoded by --tokenizer (default: the tokenizer.json beside "
                             "the --init / --resume weights); the last 2% is held out (unless --eval-data)")
                   ->check(CLI::ExistingFile);
  c->add_option("--data", a->o.data, "Token file from 'hybridscan tokenize' (memory-mapped); the last 2% is held out (unless --eval-data)")
      ->check(CLI::ExistingFile)
      ->excludes(text);
  c->add_option("--tokenizer", a->o.tokenizer,
                "tokenizer.json (or a directory holding one) to encode --text with and to check --data against")
      ->check(CLI::ExistingPath);
  c->add_flag("--synthetic", a->o.synthetic, "Train on random tokens (for benchmarking)");
  c->add_option("--steps", a->o.steps, "Optimizer steps")->capture_default_str();
  c->add_option("--lr", a->o.opt.lr, "Peak learning rate (after the warmup)")->capture_default_str();
  c->add_option("--warmup", a->o.opt.warmup, "Warmup steps (the learning rate rises linearly to --lr)")->capture_default_str();
  c->add_option_function<std::string>(
       "--lr-schedule", [a](const std::string& v) { a->o.opt.schedule = train::parse_lr_schedule(v); },
       "After the warmup: constant (--lr) | cosine or linear (from --lr down to --min-lr over --decay-steps, default "
       "all the steps after the warmup) | wsd (warmup-stable-decay: --lr, then linearly down to --min-lr over the "
       "last --decay-steps, default --wsd-decay-fraction of the steps). Default: cosine")
      ->check(CLI::IsMember({"constant", "cosine", "linear", "wsd"}));
  c->add_option("--min-lr", a->o.opt.min_lr, "Where the decay ends (default: --lr / 10)");
  c->add_option("--decay-steps", a->o.opt.decay_steps, "Length of the decay (0: the schedule's default)")
      ->capture_default_str();
  c->add_option("--wsd-decay-fraction", a->o.opt.wsd_decay_fraction,
                "wsd without --decay-steps: the share of --steps that decay")
      ->capture_default_str();
  c->add_option("--weight-decay", a->o.opt.weight_decay, "AdamW weight decay (matrices and embeddings)")->capture_default_str();
  c->add_option("--clip", a->o.opt.clip, "Global gradient-norm clip (0: off)")->capture_default_str();
  c->add_option("--seed", a->o.seed, "Seed for initialisation and data order")->capture_default_str();
  c->add_option("--out", a->o.out, "Output directory (metrics.jsonl, loss.svg)");
  c->add_option("--eval-every", a->o.eval_every, "Held-out evaluation every N steps (0: never)")->capture_default_str();
  c->add_option("--eval-data", a->o.eval_data,
                "Held-out data evaluated every --eval-every steps instead of the last 2% of the training data: a token "
                "file from 'hybridscan tokenize' (of the training data's tokenizer) or a text (encoded as the training "
                "text is)")
      ->check(CLI::ExistingFile);
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
  c->callback([a] { run_train(*a); });
}

}  // namespace hs::cli
