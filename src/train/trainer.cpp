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

// Every rank must run the same command: rank 0's options and model are compared with each rank's before any step.
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

}  // namespace

EvalResult evaluate_tokens(const model::ParamSet& params, const dataset::TokenSource& tokens, int64_t seq,
                           int64_t batch, DType compute, MemoryAccountant& mem, int64_t max_batches,
                           Collectives* shards) {
  EvalResult r;
  double sum = 0;
  int64_t n = eval_batch_count(tokens.size(), seq, batch);
  if (max_batches >= 0) n = std::min(n, max_batches);
  for (int64_t i = 0; i < n; ++i) {
    const TokenBatch tb = eval_batch(tokens, seq, batch, i);
    Batch b{tb.inputs.data(), tb.targets.data(), tb.batch, tb.seq};
    StepResult s = forward_only(params, b, compute, mem, nullptr, shards);
    sum += s.ce_sum;
    r.count += s.count;
    for (int32_t t : tb.targets)
      if (t >= 0) r.text_bytes += tokens.text_bytes(t);
  }
  r.ce = r.count ? sum / static_cast<double>(r.count) : 0.0;
  r.bits_per_byte = r.text_bytes ? sum / std::log(2.0) / static_cast<double>(r.text_bytes) : 0.0;
  return r;
}

void write_svg_chart(const std::string& path, const std::string& title, const std::string& xlabel,
                     const std::string& ylabel, const std::vector<Series>& series) {
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const auto& s : series)
    for (auto [x, y] : s.points) {
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  if (x0 > x1) x0 = 0, x1 = 1, y0 = 0, y1 = 1;
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + 1;
  const double W = 720, Hh = 420, L = 70, R = 20, T = 40, B = 50;
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double y) { return T + (1 - (y - y0) / (y1 - y0)) * (Hh - T - B); };
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << Hh
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">" << title << "</text>\n";
  o << "<line x1=\"" << L << "\" y1=\"" << Hh - B << "\" x2=\"" << W - R << "\" y2=\"" << Hh - B << "\" stroke=\"black\"/>\n";
  o << "<line x1=\"" << L << "\" y1=\"" << T << "\" x2=\"" << L << "\" y2=\"" << Hh - B << "\" stroke=\"black\"/>\n";
  for (int i = 0; i <= 5; ++i) {
    double yv = y0 + (y1 - y0) * i / 5, xv = x0 + (x1 - x0) * i / 5;
    char b[64];
    std::snprintf(b, sizeof b, "%.3g", yv);
    o << "<text x=\"" << L - 6 << "\" y=\"" << py(yv) + 4 << "\" text-anchor=\"end\">" << b << "</text>\n";
    o << "<line x1=\"" << L << "\" y1=\"" << py(yv) << "\" x2=\"" << W - R << "\" y2=\"" << py(yv) << "\" stroke=\"#eee\"/>\n";
    std::snprintf(b, sizeof b, "%.0f", xv);
    o << "<text x=\"" << px(xv) << "\" y=\"" << Hh - B + 18 << "\" text-anchor=\"middle\">" << b << "</text>\n";
  }
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << Hh - 10 << "\" text-anchor=\"middle\">" << xlabel << "</text>\n";
  o << "<text x=\"16\" y=\"" << (T + Hh - B) / 2 << "\" text-anchor=\"middle\" transform=\"rotate(-90 16 " << (T + Hh - B) / 2
    << ")\">" << ylabel << "</text>\n";
  int li = 0;
  for (const auto& s : series) {
    o << "<polyline fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"1.5\" points=\"";
    for (auto [x, y] : s.points) o << px(x) << "," << py(y) << " ";
    o << "\"/>\n<text x=\"" << W - R - 150 << "\" y=\"" << T + 16 * (li + 1) << "\" fill=\"" << s.color << "\">" << s.name
      << "</text>\n";
    ++li;
  }
  o << "</svg>\n";
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << o.str();
    if (!f) throw std::runtime_error("cannot write '" + tmp + "'");
  }
  std::filesystem::rename(tmp, path);
}

nlohmann::json options_to_json(const TrainOptions& o) {
  return {{"model", o.model}, {"text", o.text}, {"data", o.data}, {"synthetic", o.synthetic}, {"steps", o.steps},
          {"batch", o.batch}, {"seq", o.seq}, {"seed", o.seed}, {"lr", o.opt.lr}, {"min_lr_ratio", o.opt.min_lr_ratio},
          {"warmup", o.opt.warmup}, {"beta1", o.opt.beta1}, {"beta2", o.opt.beta2}, {"eps", o.opt.eps},
          {"weight_decay", o.opt.weight_decay}, {"clip", o.opt.clip}, {"remat", remat_name(o.step.remat)},
          {"compute_dtype", std::string(dtype_name(o.step.compute))}, {"weight_dtype", std::string(dtype_name(o.weight_dtype))},
          {"moment_dtype", std::string(dtype_name(o.opt.moment_dtype))},
          {"delta_rule_products", o.step.delta_rule_bf16_products ? "bf16" : "fp32"},
          {"eval_every", o.eval_every}, {"eval_batches", o.eval_batches}, {"heldout_fraction", o.heldout_fraction}};
}

void options_from_json(const nlohmann::json& j, TrainOptions& o) {
  // The tokenizer is not taken back: the checkpoint carries its own copy, which a resume uses.
  o.text = j.value("text", o.text);
  o.data = j.value("data", o.data);
  o.synthetic = j.value("synthetic", o.synthetic);
  o.batch = j.value("batch", o.batch);
  o.seq = j.value("seq", o.seq);
  o.seed = j.value("seed", o.seed);
  o.opt.lr = j.value("lr", o.opt.lr);
  o.opt.min_lr_ratio = j.value("min_lr_ratio", o.opt.min_lr_ratio);
  o.opt.warmup = j.value("warmup", o.opt.warmup);
  o.opt.beta1 = j.value("beta1", o.opt.beta1);
  o.opt.beta2 = j.value("beta2", o.opt.beta2);
  o.opt.eps = j.value("eps", o.opt.eps);
  o.opt.weight_decay = j.value("weight_decay", o.opt.weight_decay);
  o.opt.clip = j.value("clip", o.opt.clip);
  o.weight_dtype = parse_dtype(j.value("weight_dtype", std::string(dtype_name(o.weight_dtype))));
  o.opt.moment_dtype = parse_dtype(j.value("moment_dtype", std::string(dtype_name(o.opt.moment_dtype))));
  o.heldout_fraction = j.value("heldout_fraction", o.heldout_fraction);
  // The step's arithmetic: a resume without them would silently compute another curve, so they come back too, and a
  // command line that names other ones is refused.
  if (j.contains("compute_dtype")) {
    const DType c = parse_dtype(j["compute_dtype"].get<std::string>());
    if (o.compute_given && c != o.step.compute)
      throw std::invalid_argument("--compute-dtype " + std::string(dtype_name(o.step.compute)) +
                                  " differs from the checkpoint's " + std::string(dtype_name(c)) +
                                  " (a resume continues the same arithmetic; leave the option out)");
    o.step.compute = c;
  }
  if (j.contains("remat")) {
    const RematPolicy r = parse_remat(j["remat"].get<std::string>());
    if (o.remat_given && r != o.step.remat)
      throw std::invalid_argument("--remat " + remat_name(o.step.remat) + " differs from the checkpoint's " +
                                  remat_name(r) + " (a resume continues the same schedule; leave the option out)");
    o.step.remat = r;
  }
  if (j.contains("delta_rule_products")) {
    const bool bf16 = j["delta_rule_products"].get<std::string>() == "bf16";
    if (o.delta_products_given && bf16 != o.step.delta_rule_bf16_products)
      throw std::invalid_argument(std::string("--delta-rule-products ") + (bf16 ? "fp32" : "bf16") +
                                  " differs from the checkpoint's " + (bf16 ? "bf16" : "fp32") +
                                  " (a resume continues the same arithmetic; leave the option out)");
    o.step.delta_rule_bf16_products = bf16;
  }
}

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
    if (o.text.empty() && o.data.empty() && std::filesystem::exists("data/kjv.txt")) o.text = "data/kjv.txt";
    if (o.text.empty() && o.data.empty())
      throw std::invalid_argument("no corpus: pass --data TOKENS or --text FILE, run scripts/setup.sh to install the "
                                  "default one (data/kjv.txt), or use --synthetic for random tokens");
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
