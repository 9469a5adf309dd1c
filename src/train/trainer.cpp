#include "train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "checkpoint/convert.h"
#include "core/profile.h"
#include "model/params.h"
#include "train/data.h"
#include "train/evaluate.h"
#include "train/loss_chart.h"

namespace hs::train {

namespace {

using Clock = std::chrono::steady_clock;

std::string format_duration(double s) {
  char b[32];
  if (s >= 3600) std::snprintf(b, sizeof b, "%dh%02dm", int(s / 3600), int(std::fmod(s, 3600) / 60));
  else if (s >= 60) std::snprintf(b, sizeof b, "%dm%02ds", int(s / 60), int(std::fmod(s, 60)));
  else std::snprintf(b, sizeof b, "%.0fs", s);
  return b;
}

// Rows [first, first + count) of a batch: a rank's share of the global batch.
TokenBatch rows_of(const TokenBatch& tb, int64_t first, int64_t count) {
  TokenBatch r;
  r.batch = count;
  r.seq = tb.seq;
  const auto from = static_cast<ptrdiff_t>(first * tb.seq), to = static_cast<ptrdiff_t>((first + count) * tb.seq);
  r.inputs.assign(tb.inputs.begin() + from, tb.inputs.begin() + to);
  r.targets.assign(tb.targets.begin() + from, tb.targets.begin() + to);
  return r;
}

}  // namespace

TrainSummary run_training(const TrainOptions& o_in, std::ostream& log_in) {
  TrainOptions o = o_in;
  const Distributed* dist = o.dist;
  const int64_t world = dist ? dist->world->size() : 1, rank = dist ? dist->world->rank() : 0;
  const int64_t shards = dist ? dist->fsdp->size() : 1;
  // Only rank 0 reports and writes files.
  const bool lead = rank == 0;
  std::ostream null_log(nullptr);
  std::ostream& log = lead ? log_in : null_log;
  if (!lead) o.progress = false;
  std::optional<checkpoint::CheckpointDir> resume;
  int64_t first_step = 0;
  if (!o.resume.empty()) {
    resume = checkpoint::open_checkpoint_dir(o.resume);
    if (resume->format != checkpoint::Format::Native || !resume->native.contains("state"))
      throw std::invalid_argument(o.resume + " is not a hybridscan training checkpoint (no training state); use --init to start from its weights");
    const nlohmann::json& st = resume->native["state"];
    options_from_json(st.value("options", nlohmann::json::object()), o);
    first_step = st.value("step", int64_t(0));
    if (o.steps <= first_step)
      throw std::invalid_argument("--steps " + std::to_string(o.steps) + " is not beyond the checkpoint's step " + std::to_string(first_step));
  }
  const model::ModelConfig cfg = resume ? resume->config : (!o.init.empty() ? checkpoint::open_checkpoint_dir(o.init).config
                                                                             : model::load_config(o.model));
  if (o.batch < 1 || o.seq < 1 || o.steps < 0) throw std::invalid_argument("--batch and --seq must be >= 1, --steps >= 0");
  if (o.update_in_backward) {
    if (resume && o.opt.clip > 0)
      throw std::invalid_argument(o.resume + " was trained with --clip " + std::to_string(o.opt.clip) +
                                  ", which a resume keeps; --update-in-backward needs --clip 0 (resume without "
                                  "--update-in-backward, or start a new run with --clip 0)");
    check_update_in_backward(o.opt);
  }
  if (dist) {
    check_same_run(o, cfg, *dist->world);
    if (o.batch % world != 0)
      throw std::invalid_argument("--batch " + std::to_string(o.batch) + " (the global batch) must be a multiple of the " +
                                  std::to_string(world) + " ranks");
  }
  if (o.step.expert_parallel != 1) {
    const int64_t ep = o.step.expert_parallel;
    if (ep < 1) throw std::invalid_argument("--expert-parallel must be >= 1");
    if (!dist || !dist->experts || dist->experts->size() != ep)
      throw std::invalid_argument("--expert-parallel " + std::to_string(ep) +
                                  " needs that many processes of an FSDP group: start with mpirun -np N");
    if (!cfg.moe()) throw std::invalid_argument("--expert-parallel needs a model with routed experts");
    if (cfg.experts % ep != 0)
      throw std::invalid_argument("--expert-parallel " + std::to_string(ep) + " must divide the number of experts (" +
                                  std::to_string(cfg.experts) + ")");
  }
  const ModelVocabulary vocab{cfg.vocab, checkpoint_tokenizer(!o.resume.empty() ? o.resume : o.init)};
  Tokens tokens;
  Corpus corpus;
  if (!o.synthetic) {
    if (o.text.empty() && o.data.empty())
      throw std::invalid_argument("no corpus: neither a token file nor a text was given, and no synthetic tokens asked for");
    tokens = load_tokens({o.data, o.text, o.tokenizer}, vocab);
    corpus = split_heldout(tokens.tokens, o.heldout_fraction, o.seq, tokens.description);
  }
  // Checkpoints carry the tokenizer their ids belong to, so that eval, a resume and an export use it by default.
  const std::string carried_tokenizer = !tokens.tokenizer.empty() ? tokens.tokenizer : vocab.tokenizer;
  if (!o.out.empty() && lead) std::filesystem::create_directories(o.out);

  MemoryAccountant mem;
  model::ParamSet params(cfg, o.weight_dtype, mem, MemCategory::Parameters, false, shards);
  OptimizerConfig oc = o.opt;
  oc.total_steps = o.steps;
  AdamWOptimizer opt(params, oc, mem);
  // Sharded: initialisation and checkpoints go through a full set that lives only for that moment, outside the
  // step's accounting: each rank keeps its shards of it, and a save gathers it back, so the files are the same
  // whatever the rank count.
  MemoryAccountant full_mem;
  std::unique_ptr<model::ParamSet> full_params, full_m, full_v;
  auto make_full = [&] {
    full_params = std::make_unique<model::ParamSet>(cfg, o.weight_dtype, full_mem, MemCategory::Parameters, false);
    full_m = std::make_unique<model::ParamSet>(cfg, o.opt.moment_dtype, full_mem, MemCategory::OptimizerState, true);
    full_v = std::make_unique<model::ParamSet>(cfg, o.opt.moment_dtype, full_mem, MemCategory::OptimizerState, true);
  };
  auto drop_full = [&] { full_params.reset(), full_m.reset(), full_v.reset(); };
  if (shards > 1) make_full();
  const int64_t param_count = shards > 1 ? full_params->numel() : params.numel();
  model::ParamSet& whole = shards > 1 ? *full_params : params;  // what initialisation and loading fill
  nlohmann::json hf_origin, source_config;  // kept so that an export reproduces the source's layout and config.json
  if (resume) {
    source_config = resume->config_json;
    checkpoint::load_parameters(*resume, whole);
    checkpoint::load_optimizer_state(*resume, shards > 1 ? *full_m : opt.first_moment(),
                                     shards > 1 ? *full_v : opt.second_moment());
    opt.set_steps_taken(first_step);
    if (resume->native.contains("hf")) hf_origin = resume->native["hf"];
    log << "resumed " << o.resume << " at step " << first_step << "\n";
  } else if (!o.init.empty()) {
    checkpoint::CheckpointDir init = checkpoint::open_checkpoint_dir(o.init);
    source_config = init.config_json;
    for (const auto& n : checkpoint::load_parameters(init, whole)) log << "init: " << n << "\n";
    hf_origin = {{"prefix", init.hf.prefix},
                 {"experts", init.hf.experts == checkpoint::ExpertLayout::Fused ? "fused" : "per_expert"},
                 {"metadata", init.hf_metadata}};
    log << "initialised from " << o.init << "\n";
  } else {
    model::init_params(whole, o.seed);
  }
  if (shards > 1) {
    const int64_t r = dist->fsdp->rank();
    copy_shard(*full_params, params, r);
    copy_shard(*full_m, opt.first_moment(), r);
    copy_shard(*full_v, opt.second_moment(), r);
    drop_full();
  }
  // Sharded: the first FSDP group gathers the full state and rank 0 writes it (one writer: the atomic rename of one
  // directory is what makes a checkpoint complete or absent, whatever happens to the other ranks). Every rank learns
  // whether the write succeeded, so a failed save stops them all.
  auto save = [&](int64_t step) {
    if (o.out.empty()) return;
    const std::string dir = o.out + "/checkpoint-" + std::to_string(step);
    nlohmann::json state = {{"step", step}, {"options", options_to_json(o)}};
    if (!hf_origin.is_null()) state["hf"] = hf_origin;
    if (!source_config.is_null()) state["config_json"] = source_config;
    std::string error;
    try {
      if (shards > 1 && rank < shards) {
        make_full();
        gather_full(params, *full_params, *dist->fsdp);
        gather_full(opt.first_moment(), *full_m, *dist->fsdp);
        gather_full(opt.second_moment(), *full_v, *dist->fsdp);
      }
      if (lead) {
        const bool full = shards > 1;
        checkpoint::save_native(dir, {full ? full_params.get() : &params, full ? full_m.get() : &opt.first_moment(),
                                      full ? full_v.get() : &opt.second_moment(), state,
                                      carried_tokenizer});
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    drop_full();
    if (dist && dist->world->all_reduce_sum(error.empty() ? 0.0 : 1.0) > 0)
      throw std::runtime_error("saving " + dir + " failed" + (error.empty() ? " on another rank" : ": " + error));
    if (!error.empty()) throw std::runtime_error(error);
    log << "saved " << dir << "\n";
  };
  log << "model: " << model::describe(cfg) << "\n"
      << "params " << param_count << " ("
      << format_bytes(double(params.nbytes())) << " " << dtype_name(o.weight_dtype) << (shards > 1 ? " per rank" : "")
      << "), remat " << remat_name(o.step.remat) << ", compute " << dtype_name(o.step.compute) << ", batch " << o.batch
      << " x seq " << o.seq << ", " << o.steps << " steps";
  if (!o.synthetic)
    log << ", corpus " << tokens.description << ": " << corpus.train.size() << " train / " << corpus.heldout.size()
        << " held-out tokens";
  log << "\n";
  if (dist)
    log << world << " ranks: FSDP groups of " << shards << " (" << world / shards << " data-parallel replicas), "
        << o.batch / world << " sequences per rank" << (o.step.prefetch ? ", prefetching" : "");
  if (dist && o.step.expert_parallel > 1)
    log << ", routed experts split over " << o.step.expert_parallel << " ranks ("
        << cfg.experts / o.step.expert_parallel << " each)";
  if (dist) log << "\n";
  if (o.update_in_backward) log << "AdamW applied to each gradient shard in the backward (no clipping)\n";

  std::ofstream metrics;
  if (!o.out.empty() && lead) metrics.open(o.out + "/metrics.jsonl", resume ? std::ios::app : std::ios::trunc);
  Series train_curve{"train loss", "#1f77b4", {}}, eval_curve{"held-out loss", "#d62728", {}};
  TrainSummary sum;
  const bool tty = o.progress && isatty(STDERR_FILENO);
  const auto t_start = Clock::now();
  double step_seconds = 0, first_step_seconds = 0;
  const int64_t last_step = o.stop_after >= 0 ? std::min(o.steps, first_step + o.stop_after) : o.steps;
  // One gradient set for the whole run: the optimizer step zeroes it as it reads it, so no step clears it.
  std::unique_ptr<model::ParamSet> grads;
  StepOptions step_opt = o.step;
  if (dist) {
    step_opt.comm = dist->fsdp;
    step_opt.batch_group = dist->world;
    step_opt.ep_group = dist->experts;
  }
  auto comm_seconds = [&] {
    return dist ? dist->world->exposed_seconds() + dist->fsdp->exposed_seconds() + dist->replicas->exposed_seconds() +
                      (dist->experts ? dist->experts->exposed_seconds() : 0)
                : 0;
  };
  double first_step_comm = 0;
  const bool profiling = o.profile || profile::enabled_by_env();
  profile::Totals prof_sum, prof_first;
  auto profile_json = [](const profile::Totals& t, double step_s, bool shapes) {
    nlohmann::json sec = nlohmann::json::object(), calls = nlohmann::json::object();
    for (size_t i = 0; i < profile::kNumPhases; ++i) {
      const std::string name(profile::phase_name(static_cast<profile::Phase>(i)));
      sec[name] = t.seconds[i];
      calls[name] = t.calls[i];
    }
    nlohmann::json j{{"seconds", sec},         {"calls", calls},
                     {"phase_sum_s", t.sum_seconds()}, {"step_s", step_s},
                     {"matmul_flops", t.matmul_flops}, {"minor_faults", t.minor_faults},
                     {"major_faults", t.major_faults}};
    if (shapes) {
      // [M, N, K, trans_a, trans_b, accumulate, varying_rows, in dtype, out dtype (0 fp32, 1 bf16), calls, seconds]
      nlohmann::json v = nlohmann::json::array();
      for (const profile::MatmulShapeTotals& x : t.matmul_shapes) {
        const profile::MatmulShape& m = x.shape;
        v.push_back({m.M, m.N, m.K, m.trans_a, m.trans_b, m.accumulate, m.varying_rows, m.in_dtype, m.out_dtype,
                     x.calls, x.seconds});
      }
      j["matmul_shapes"] = v;
      // The finer split: {label: [phase, calls, seconds]}.
      nlohmann::json l = nlohmann::json::object();
      for (const profile::Totals::Label& x : t.labels)
        l[x.name] = {std::string(profile::phase_name(x.phase)), x.calls, x.seconds};
      j["labels"] = l;
    }
    return j;
  };
  for (int64_t step = first_step; step < last_step; ++step) {
    TokenBatch tb = o.synthetic ? synthetic_batch(cfg.vocab, o.batch, o.seq, o.seed, step)
                                : sample_batch(corpus.train, o.batch, o.seq, o.seed, step);
    if (dist) tb = rows_of(tb, rank * (o.batch / world), o.batch / world);
    Buffer batch_mem = mem.allocate(2 * tb.inputs.size() * sizeof(int32_t), MemCategory::Batch, "batch");
    mem.reset_peak();
    std::optional<profile::Session> prof;
    if (profiling) prof.emplace();
    const auto t0 = Clock::now();
    const double c0 = comm_seconds();
    Batch b{tb.inputs.data(), tb.targets.data(), tb.batch, tb.seq};
    const double lr = lr_at(oc, step);
    StepResult r;
    double gnorm;
    if (o.update_in_backward) {
      InBackwardAdamW update(opt, params, dist ? dist->fsdp : nullptr, dist ? dist->replicas : nullptr, &mem);
      StepOptions so = step_opt;
      so.update = &update;
      r = forward_backward(params, b, so, mem, nullptr);
      gnorm = update.finish();
    } else {
      r = forward_backward(params, b, step_opt, mem, &grads);
      if (dist) sum_over_replicas(*grads, *dist->replicas, mem);
      gnorm = opt.step(params, *grads, dist ? dist->fsdp : nullptr);  // leaves grads zeroed
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    profile::Totals pt;
    if (prof) {
      pt = prof->totals();
      prof.reset();
      profile::accumulate(prof_sum, pt);
      if (step == first_step) prof_first = pt;
    }
    const double comm_dt = comm_seconds() - c0;
    sum.comm_exposed_s += comm_dt;
    if (step == first_step) first_step_comm = comm_dt;
    MemorySnapshot peak = mem.at_peak();
    if (peak.total() > sum.peak.total()) sum.peak = peak;
    step_seconds += dt;
    if (step == first_step) first_step_seconds = dt;
    sum.steps = step + 1;
    sum.tokens += o.batch * o.seq;
    sum.losses.push_back(r.loss);
    sum.final_loss = r.loss;
    sum.final_ce = r.ce;
    train_curve.points.emplace_back(double(step + 1), r.ce);
    const double tps = double(sum.tokens) / step_seconds;
    nlohmann::json m = {{"step", step + 1}, {"loss", r.loss}, {"ce", r.ce}, {"aux", r.aux}, {"lr", lr},
                        {"grad_norm", gnorm}, {"tokens_per_s", double(o.batch * o.seq) / dt},
                        {"peak_bytes", peak.total()}};
    if (dist) m["comm_exposed_s"] = comm_dt;
    if (profiling) m["profile"] = profile_json(pt, dt, false);
    const bool do_eval = !o.synthetic && o.eval_every > 0 && ((step + 1) % o.eval_every == 0 || step + 1 == o.steps);
    if (do_eval) {
      EvalResult e = evaluate_tokens(params, corpus.heldout, o.seq, o.batch, o.step.compute, mem, o.eval_batches,
                                     dist ? dist->fsdp : nullptr);
      sum.eval_ce = e.ce;
      sum.eval_bits_per_byte = e.bits_per_byte;
      eval_curve.points.emplace_back(double(step + 1), e.ce);
      m["eval_ce"] = e.ce;
      m["eval_bits_per_byte"] = e.bits_per_byte;
    }
    if (metrics.is_open()) metrics << m.dump() << "\n" << std::flush;
    if (o.progress) {
      const double eta = step_seconds / double(step + 1 - first_step) * double(last_step - step - 1);
      char line[256];
      std::snprintf(line, sizeof line, "step %lld/%lld | loss %.4f | %.0f tok/s | peak %s | lr %.2e | ETA %s",
                    (long long)(step + 1), (long long)last_step, r.loss, tps, format_bytes(double(peak.total())).c_str(), lr,
                    format_duration(eta).c_str());
      std::string s = line;
      if (do_eval) {
        std::snprintf(line, sizeof line, " | held-out %.4f (%.3f bits/byte)", sum.eval_ce, sum.eval_bits_per_byte);
        s += line;
      }
      if (tty) std::fprintf(stderr, "\r\033[K%s%s", s.c_str(), do_eval || step + 1 == last_step ? "\n" : "");
      else if (do_eval || step == first_step || (step + 1) % 10 == 0 || step + 1 == last_step) std::fprintf(stderr, "%s\n", s.c_str());
    }
    if (o.save_every > 0 && (step + 1) % o.save_every == 0 && step + 1 != last_step) save(step + 1);
  }
  if (sum.steps > first_step) save(sum.steps);
  sum.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  // Steady state: the first step also creates the oneDNN primitives and faults in fresh memory.
  const int64_t run = sum.steps - first_step;
  sum.tokens_per_s = run > 1 ? double((run - 1) * o.batch * o.seq) / (step_seconds - first_step_seconds)
                             : (step_seconds > 0 ? double(sum.tokens) / step_seconds : 0);
  sum.step_s = run > 1 ? step_seconds - first_step_seconds : step_seconds;
  if (run > 1) sum.comm_exposed_s -= first_step_comm;
  if (profiling) {
    if (run > 1) profile::accumulate(prof_sum, prof_first, /*subtract=*/true);
    sum.profile = profile_json(prof_sum, sum.step_s, true);
  }
  sum.peak_bytes = sum.peak.total();
  sum.argument_bytes = sum.peak.argument();
  sum.temp_bytes = sum.peak.temp();
  if (!o.out.empty() && lead && !train_curve.points.empty()) {
    std::vector<Series> s{train_curve};
    if (!eval_curve.points.empty()) s.push_back(eval_curve);
    write_svg_chart(o.out + "/loss.svg", "hybridscan: " + cfg.name + " training loss", "step", "cross-entropy (nats)", s);
  }
  return sum;
}

}  // namespace hs::train
