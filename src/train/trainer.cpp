#include "train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "checkpoint/convert.h"
#include "chat/chat_template.h"
#include "core/atomic_file.h"
#include "core/profile.h"
#include "model/params.h"
#include "train/chat_data.h"
#include "train/data.h"
#include "train/evaluate.h"
#include "train/loss_chart.h"
#include "train/step.h"

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
  if (!tb.positions.empty()) r.positions.assign(tb.positions.begin() + from, tb.positions.begin() + to);
  return r;
}

// The options of a run against its model and process groups, before any data is read.
void check_options(const TrainOptions& o, const model::ModelConfig& cfg, bool resumed) {
  if (o.batch < 1 || o.seq < 1 || o.steps < 0)
    throw std::invalid_argument("batch size " + std::to_string(o.batch) + ", sequence length " + std::to_string(o.seq) +
                                ", steps " + std::to_string(o.steps) +
                                ": the batch and the sequence must be positive, the steps not negative");
  check_grad_accum(o.grad_accum, o.update_in_backward);
  check_lr_schedule(o.opt);
  if (o.update_in_backward) {
    if (resumed && o.opt.clip > 0)
      throw std::invalid_argument(o.resume + " was trained with gradient clipping at " + std::to_string(o.opt.clip) +
                                  ", which a resume keeps; AdamW in the backward needs clipping off (resume with the "
                                  "usual update, or start a new run without clipping)");
    check_update_in_backward(o.opt);
  }
  const Distributed* dist = o.dist;
  if (dist) {
    check_same_run(o, cfg, *dist->world);
    if (o.batch % dist->world->size() != 0)
      throw std::invalid_argument("a global batch of " + std::to_string(o.batch) + " sequences must be a multiple of the " +
                                  std::to_string(dist->world->size()) + " ranks");
  }
  if (const int64_t ep = o.step.expert_parallel; ep != 1) {
    if (ep > 1 && (!dist || !dist->experts || dist->experts->size() != ep))
      throw std::invalid_argument("expert parallelism over " + std::to_string(ep) +
                                  " ranks needs that many processes of an FSDP group: start with mpirun -np N");
    if (!cfg.moe()) throw std::invalid_argument("expert parallelism needs a model with routed experts");
    check_expert_parallel(cfg, ep, dist ? dist->fsdp->size() : 1);
  }
}

// A profile::Totals as JSON: per-phase seconds and calls, and with `shapes` the product shapes and the labels.
nlohmann::json profile_json(const profile::Totals& t, double step_s, bool shapes) {
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
  if (!shapes) return j;
  // [M, N, K, trans_a, trans_b, accumulate, varying_rows, in dtype, out dtype (0 fp32, 1 bf16), calls, seconds]
  nlohmann::json v = nlohmann::json::array();
  for (const profile::MatmulShapeTotals& x : t.matmul_shapes) {
    const profile::MatmulShape& m = x.shape;
    v.push_back({m.M, m.N, m.K, m.trans_a, m.trans_b, m.accumulate, m.varying_rows, m.in_dtype, m.out_dtype, x.calls,
                 x.seconds});
  }
  j["matmul_shapes"] = v;
  // The finer split: {label: [phase, calls, seconds]}.
  nlohmann::json l = nlohmann::json::object();
  for (const profile::Totals::Label& x : t.labels)
    l[x.name] = {std::string(profile::phase_name(x.phase)), x.calls, x.seconds};
  j["labels"] = l;
  return j;
}

// What one step of the run measured.
struct StepRecord {
  StepOutcome outcome;
  double seconds = 0, comm_seconds = 0;
  MemorySnapshot peak;
  profile::Totals profile;
};

// A training run: its options, model, corpus, step and checkpoints; train() is the loop.
class Run {
 public:
  Run(const TrainOptions& o, std::ostream& log);
  TrainSummary train();

 private:
  void open_resume();
  void load_corpus();
  void make_full();
  void drop_full() { full_params_.reset(), full_m_.reset(), full_v_.reset(); }
  void initialise();
  void save(int64_t step);
  void log_setup();
  StepRecord take_step(int64_t step);
  bool record(int64_t step, const StepRecord& s);
  void show_progress(int64_t step, const StepRecord& s, bool evaluated);
  double comm_seconds() const;
  int64_t tokens_per_step() const { return o_.batch * o_.grad_accum * o_.seq; }
  TrainSummary finish();

  TrainOptions o_;
  const Distributed* dist_;
  int64_t world_, rank_, shards_;
  bool lead_;  // only rank 0 reports and writes files
  std::ostream null_log_{nullptr};
  std::ostream& log_;
  std::optional<checkpoint::CheckpointDir> resume_;
  int64_t first_step_ = 0, last_step_ = 0, param_count_ = 0;
  model::ModelConfig cfg_;
  Tokens tokens_, eval_tokens_;  // eval_tokens_: --eval-data's
  Corpus corpus_;
  std::string carried_tokenizer_;  // the tokenizer the ids belong to, which checkpoints carry
  std::string carried_template_;   // the chat template chat data was rendered with, which checkpoints carry
  MemoryAccountant mem_;
  std::unique_ptr<Step> step_;
  // Sharded: initialisation and checkpoints go through a full set that lives only for that moment, outside the
  // step's accounting: each rank keeps its shards of it, and a save gathers it back, so the files are the same
  // whatever the rank count.
  MemoryAccountant full_mem_;
  std::unique_ptr<model::ParamSet> full_params_, full_m_, full_v_;
  nlohmann::json hf_origin_, source_config_;  // kept so that an export reproduces the source's layout and config.json
  std::ofstream metrics_;
  Series train_curve_{"train loss", "#1f77b4", {}}, eval_curve_{"held-out loss", "#d62728", {}};
  TrainSummary sum_;
  Clock::time_point t_start_;
  double step_seconds_ = 0, first_step_seconds_ = 0, first_step_comm_ = 0;
  bool profiling_ = false;
  profile::Totals prof_sum_, prof_first_;
};

Run::Run(const TrainOptions& o, std::ostream& log)
    : o_(o),
      dist_(o.dist),
      world_(dist_ ? dist_->world->size() : 1),
      rank_(dist_ ? dist_->world->rank() : 0),
      shards_(dist_ ? dist_->fsdp->size() : 1),
      lead_(rank_ == 0),
      log_(lead_ ? log : null_log_) {
  if (!lead_) o_.progress = false;
  open_resume();
  cfg_ = resume_ ? resume_->config
                 : (!o_.init.empty() ? checkpoint::open_checkpoint_dir(o_.init).config : model::load_config(o_.model));
  check_options(o_, cfg_, resume_.has_value());
  load_corpus();
  if (!o_.out.empty() && lead_) std::filesystem::create_directories(o_.out);
  OptimizerConfig oc = o_.opt;
  oc.total_steps = o_.steps;
  StepOptions schedule = o_.step;
  if (dist_) {
    schedule.comm = dist_->fsdp;
    schedule.batch_group = dist_->world;
    schedule.ep_group = dist_->experts;
  }
  step_ = std::make_unique<Step>(cfg_, o_.weight_dtype, oc, schedule, o_.update_in_backward,
                                 dist_ ? dist_->replicas : nullptr, mem_);
  initialise();
}

void Run::open_resume() {
  if (o_.resume.empty()) return;
  resume_ = checkpoint::open_checkpoint_dir(o_.resume);
  if (resume_->format != checkpoint::Format::Native || !resume_->native.contains("state"))
    throw std::invalid_argument(o_.resume + " is not a hybridscan training checkpoint (no training state): it can only give a new run its weights");
  const nlohmann::json& st = resume_->native["state"];
  options_from_json(st.value("options", nlohmann::json::object()), o_);
  first_step_ = st.value("step", int64_t(0));
  if (o_.steps <= first_step_)
    throw std::invalid_argument("a schedule of " + std::to_string(o_.steps) + " steps is not beyond the checkpoint's step " +
                                std::to_string(first_step_));
}

// A chat file's tokens (train --chat, --eval-data FILE.jsonl): rendered with --chat-template, else the template the
// run's checkpoint (--resume / --init) carries; tokenized by the run's tokenizer.
Tokens chat_tokens(const TrainOptions& o, const std::string& path, const ModelVocabulary& vocab) {
  ChatDataOptions c;
  c.chat = path;
  c.tokenizer = !o.tokenizer.empty() ? o.tokenizer : vocab.tokenizer;
  if (c.tokenizer.empty())
    throw std::invalid_argument("chat file " + path + ": no tokenizer to encode it with: " +
                                (o.init.empty() && o.resume.empty() ? std::string("pass --tokenizer")
                                                                    : "the checkpoint carries no tokenizer.json; pass --tokenizer"));
  const std::string& ckpt = !o.resume.empty() ? o.resume : o.init;
  c.chat_template = o.chat_template;
  if (c.chat_template.empty()) {
    if (ckpt.empty())
      throw std::invalid_argument("chat file " + path + ": no chat template to render it with: a model without a "
                                  "checkpoint has none; pass --chat-template FILE (a .jinja file or tokenizer_config.json)");
    c.chat_template = ckpt;  // ChatTemplate::load says so when the directory holds none
  }
  c.loss_on = chat::parse_loss_on(o.loss_on);
  c.skip_bad_lines = o.skip_bad_lines;
  c.max_tokens = o.seq;
  return load_chat_tokens(c, vocab);
}

void Run::load_corpus() {
  const ModelVocabulary vocab{cfg_.vocab, checkpoint_tokenizer(!o_.resume.empty() ? o_.resume : o_.init)};
  // The template a chat file renders with, recorded with the options so that a resume renders with it again.
  if (o_.chat_template.empty() && o_.resume.empty() && (!o_.chat.empty() || is_chat_file(o_.eval_data)))
    o_.chat_template = o_.init;
  if (!o_.synthetic) {
    if (o_.text.empty() && o_.data.empty() && o_.chat.empty())
      throw std::invalid_argument("no corpus: neither a token file nor a text was given, and no synthetic tokens asked for");
    tokens_ = !o_.chat.empty() ? chat_tokens(o_, o_.chat, vocab) : load_tokens({o_.data, o_.text, o_.tokenizer}, vocab);
    // With --eval-data every training token trains (a fraction of 0 splits nothing off).
    corpus_ = split_heldout(tokens_.tokens, o_.eval_data.empty() ? o_.heldout_fraction : 0.0, o_.seq,
                            tokens_.description);
  }
  if (!o_.eval_data.empty()) {
    const std::string tokenizer = !o_.tokenizer.empty() ? o_.tokenizer : vocab.tokenizer;
    const bool bytes = !o_.synthetic && o_.data.empty() && tokenizer.empty();
    if (is_chat_file(o_.eval_data)) {
      if (bytes || tokenizer.empty())
        throw std::invalid_argument("--eval-data " + o_.eval_data + " is a chat file, but the run has no tokenizer: pass "
                                    "--tokenizer (the training data's)");
      eval_tokens_ = chat_tokens(o_, o_.eval_data, vocab);
    } else {
      eval_tokens_ = load_eval_tokens(o_.eval_data, o_.synthetic ? "" : o_.data, tokenizer, bytes, vocab);
    }
    corpus_.heldout = eval_tokens_.tokens;
  }
  // Checkpoints carry the template chat data was rendered with (chat_template.jinja, which convert --format hf
  // copies), so that tokenize --chat --checkpoint, generate --chat and an export render as training did.
  if ((!o_.chat.empty() || is_chat_file(o_.eval_data)) && !o_.chat_template.empty())
    carried_template_ = chat::ChatTemplate::load(o_.chat_template).source();
  // Checkpoints carry the tokenizer their ids belong to, so that eval, a resume and an export use it by default.
  carried_tokenizer_ = !tokens_.tokenizer.empty() ? tokens_.tokenizer : vocab.tokenizer;
}

void Run::make_full() {
  full_params_ = std::make_unique<model::ParamSet>(cfg_, o_.weight_dtype, full_mem_, MemCategory::Parameters, false);
  full_m_ = std::make_unique<model::ParamSet>(cfg_, o_.opt.moment_dtype, full_mem_, MemCategory::OptimizerState, true);
  full_v_ = std::make_unique<model::ParamSet>(cfg_, o_.opt.moment_dtype, full_mem_, MemCategory::OptimizerState, true);
}

// The parameters and moments a run starts from: a --resume checkpoint's, an --init checkpoint's weights, or random.
void Run::initialise() {
  AdamWOptimizer& opt = step_->optimizer();
  if (shards_ > 1) make_full();
  param_count_ = shards_ > 1 ? full_params_->numel() : step_->params().numel();
  model::ParamSet& whole = shards_ > 1 ? *full_params_ : step_->params();  // what initialisation and loading fill
  if (resume_) {
    source_config_ = resume_->config_json;
    checkpoint::load_parameters(*resume_, whole);
    checkpoint::load_optimizer_state(*resume_, shards_ > 1 ? *full_m_ : opt.first_moment(),
                                     shards_ > 1 ? *full_v_ : opt.second_moment());
    opt.set_steps_taken(first_step_);
    if (resume_->native.contains("hf")) hf_origin_ = resume_->native["hf"];
    log_ << "resumed " << o_.resume << " at step " << first_step_ << "\n";
  } else if (!o_.init.empty()) {
    checkpoint::CheckpointDir init = checkpoint::open_checkpoint_dir(o_.init);
    source_config_ = init.config_json;
    for (const auto& n : checkpoint::load_parameters(init, whole)) log_ << "init: " << n << "\n";
    hf_origin_ = {{"prefix", init.hf.prefix},
                  {"experts", init.hf.experts == checkpoint::ExpertLayout::Fused ? "fused" : "per_expert"},
                  {"metadata", init.hf_metadata}};
    log_ << "initialised from " << o_.init << "\n";
  } else {
    model::init_params(whole, o_.seed);
  }
  if (shards_ > 1) {
    const int64_t r = dist_->fsdp->rank();
    copy_shard(*full_params_, step_->params(), r);
    copy_shard(*full_m_, opt.first_moment(), r);
    copy_shard(*full_v_, opt.second_moment(), r);
    drop_full();
  }
}

// Sharded: the first FSDP group gathers the full state and rank 0 writes it (one writer: the atomic rename of one
// directory is what makes a checkpoint complete or absent, whatever happens to the other ranks). Every rank learns
// whether the write succeeded, so a failed save stops them all.
void Run::save(int64_t step) {
  if (o_.out.empty()) return;
  const std::string dir = o_.out + "/checkpoint-" + std::to_string(step);
  nlohmann::json state = {{"step", step}, {"options", options_to_json(o_)}};
  if (!hf_origin_.is_null()) state["hf"] = hf_origin_;
  if (!source_config_.is_null()) state["config_json"] = source_config_;
  model::ParamSet& params = step_->params();
  AdamWOptimizer& opt = step_->optimizer();
  std::string error;
  try {
    if (shards_ > 1 && rank_ < shards_) {
      make_full();
      gather_full(params, *full_params_, *dist_->fsdp);
      gather_full(opt.first_moment(), *full_m_, *dist_->fsdp);
      gather_full(opt.second_moment(), *full_v_, *dist_->fsdp);
    }
    if (lead_) {
      const bool full = shards_ > 1;
      checkpoint::save_native(dir, {full ? full_params_.get() : &params, full ? full_m_.get() : &opt.first_moment(),
                                    full ? full_v_.get() : &opt.second_moment(), state, carried_tokenizer_});
      if (!carried_template_.empty()) {
        AtomicFile t(std::filesystem::path(dir) / "chat_template.jinja");
        t.write(carried_template_);
        t.commit();
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  drop_full();
  if (dist_ && dist_->world->all_reduce_sum(error.empty() ? 0.0 : 1.0) > 0)
    throw std::runtime_error("saving " + dir + " failed" + (error.empty() ? " on another rank" : ": " + error));
  if (!error.empty()) throw std::runtime_error(error);
  log_ << "saved " << dir << "\n";
}

void Run::log_setup() {
  const model::ParamSet& params = step_->params();
  log_ << "model: " << model::describe(cfg_) << "\n"
       << "params " << param_count_ << " (" << format_bytes(double(params.nbytes())) << " " << dtype_name(o_.weight_dtype)
       << (shards_ > 1 ? " per rank" : "") << "), remat " << remat_name(o_.step.remat) << ", compute "
       << dtype_name(o_.step.compute) << ", batch " << o_.batch << " x seq " << o_.seq;
  if (o_.grad_accum > 1)
    log_ << " x " << o_.grad_accum << " micro-batches an update (" << o_.batch * o_.grad_accum << " sequences)";
  log_ << ", " << o_.steps << " steps";
  if (!o_.synthetic)
    log_ << ", corpus " << tokens_.description << ": " << corpus_.train.size() << " train / " << corpus_.heldout.size()
         << " held-out tokens";
  if (!o_.eval_data.empty()) log_ << ", held out: " << eval_tokens_.description;
  log_ << "\n";
  if (dist_)
    log_ << world_ << " ranks: FSDP groups of " << shards_ << " (" << world_ / shards_ << " data-parallel replicas), "
         << o_.batch / world_ << " sequences per rank" << (o_.step.prefetch ? ", prefetching" : "");
  if (dist_ && o_.step.expert_parallel > 1)
    log_ << ", routed experts split over " << o_.step.expert_parallel << " ranks ("
         << cfg_.experts / o_.step.expert_parallel << " each)";
  if (dist_) log_ << "\n";
  OptimizerConfig oc = o_.opt;
  oc.total_steps = o_.steps;
  log_ << "learning rate: " << describe_lr_schedule(oc) << "\n";
  if (o_.update_in_backward) log_ << "AdamW applied to each gradient shard in the backward (no clipping)\n";
}

double Run::comm_seconds() const {
  if (!dist_) return 0;
  return dist_->world->exposed_seconds() + dist_->fsdp->exposed_seconds() + dist_->replicas->exposed_seconds() +
         (dist_->experts ? dist_->experts->exposed_seconds() : 0);
}

StepRecord Run::take_step(int64_t step) {
  // The update's batch * grad_accum rows, drawn as one batch: micro-batch k is rows [k batch, (k + 1) batch), each
  // rank its share of those, so the update is that of one batch of all the rows.
  const int64_t rows = o_.batch * o_.grad_accum;
  TokenBatch all = o_.synthetic ? synthetic_batch(cfg_.vocab, rows, o_.seq, o_.seed, step)
                                : sample_batch(corpus_.train, rows, o_.seq, o_.seed, step, o_.step.packing);
  const int64_t mine = o_.batch / world_;
  std::vector<TokenBatch> micro;
  if (!dist_ && o_.grad_accum == 1) micro.push_back(std::move(all));
  else
    for (int64_t k = 0; k < o_.grad_accum; ++k) micro.push_back(rows_of(all, k * o_.batch + rank_ * mine, mine));
  std::vector<Batch> batches;
  for (const TokenBatch& tb : micro) batches.push_back(Batch{tb.inputs.data(), tb.targets.data(), tb.batch, tb.seq, tb.positions_or_null()});
  StepRecord s;
  std::optional<profile::Session> prof;
  if (profiling_) prof.emplace();
  const auto t0 = Clock::now();
  const double c0 = comm_seconds();
  s.outcome = step_->run(batches);
  s.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (prof) {
    s.profile = prof->totals();
    prof.reset();
    profile::accumulate(prof_sum_, s.profile);
    if (step == first_step_) prof_first_ = s.profile;
  }
  s.comm_seconds = comm_seconds() - c0;
  s.peak = mem_.at_peak();
  return s;
}

// Adds a step to the summary, the metrics and the curve, and evaluates on the held-out tokens when it is time;
// returns whether it did.
bool Run::record(int64_t step, const StepRecord& s) {
  const StepResult& r = s.outcome.result;
  sum_.comm_exposed_s += s.comm_seconds;
  if (step == first_step_) first_step_comm_ = s.comm_seconds, first_step_seconds_ = s.seconds;
  if (s.peak.total() > sum_.peak.total()) sum_.peak = s.peak;
  step_seconds_ += s.seconds;
  sum_.steps = step + 1;
  sum_.tokens += tokens_per_step();
  sum_.losses.push_back(r.loss);
  sum_.final_loss = r.loss;
  sum_.final_ce = r.ce;
  train_curve_.points.emplace_back(double(step + 1), r.ce);
  nlohmann::json m = {{"step", step + 1}, {"loss", r.loss}, {"ce", r.ce}, {"aux", r.aux}, {"lr", s.outcome.lr},
                      {"grad_norm", s.outcome.grad_norm}, {"tokens_per_s", double(tokens_per_step()) / s.seconds},
                      {"peak_bytes", s.peak.total()}};
  if (dist_) m["comm_exposed_s"] = s.comm_seconds;
  if (o_.step.mtp_weight > 0) m["mtp_ce"] = r.mtp_ce;
  if (profiling_) m["profile"] = profile_json(s.profile, s.seconds, false);
  const bool evaluate = (!o_.synthetic || !o_.eval_data.empty()) && o_.eval_every > 0 && ((step + 1) % o_.eval_every == 0 || step + 1 == o_.steps);
  if (evaluate) {
    const EvalResult e = evaluate_tokens(step_->params(), corpus_.heldout, o_.seq, o_.batch, o_.step.compute, mem_,
                                         o_.eval_batches, dist_ ? dist_->fsdp : nullptr, o_.step.packing);
    sum_.eval_ce = e.ce;
    sum_.eval_bits_per_byte = e.bits_per_byte;
    eval_curve_.points.emplace_back(double(step + 1), e.ce);
    m["eval_ce"] = e.ce;
    m["eval_bits_per_byte"] = e.bits_per_byte;
  }
  if (metrics_.is_open()) metrics_ << m.dump() << "\n" << std::flush;
  return evaluate;
}

// The progress line on stderr: rewritten in place on a terminal, every 10th step (and evaluations) otherwise.
void Run::show_progress(int64_t step, const StepRecord& s, bool evaluated) {
  if (!o_.progress) return;
  const double eta = step_seconds_ / double(step + 1 - first_step_) * double(last_step_ - step - 1);
  char line[256];
  std::snprintf(line, sizeof line, "step %lld/%lld | loss %.4f | %.0f tok/s | peak %s | lr %.2e | ETA %s",
                (long long)(step + 1), (long long)last_step_, s.outcome.result.loss, double(sum_.tokens) / step_seconds_,
                format_bytes(double(s.peak.total())).c_str(), s.outcome.lr, format_duration(eta).c_str());
  std::string text = line;
  if (evaluated) {
    std::snprintf(line, sizeof line, " | held-out %.4f (%.3f bits/byte)", sum_.eval_ce, sum_.eval_bits_per_byte);
    text += line;
  }
  const bool last = step + 1 == last_step_;
  if (isatty(STDERR_FILENO)) std::fprintf(stderr, "\r\033[K%s%s", text.c_str(), evaluated || last ? "\n" : "");
  else if (evaluated || step == first_step_ || (step + 1) % 10 == 0 || last) std::fprintf(stderr, "%s\n", text.c_str());
}

// The summary's steady-state figures (the first step also creates the oneDNN primitives and faults in fresh memory),
// and the loss chart.
TrainSummary Run::finish() {
  sum_.seconds = std::chrono::duration<double>(Clock::now() - t_start_).count();
  const int64_t run = sum_.steps - first_step_;
  sum_.tokens_per_s = run > 1 ? double((run - 1) * tokens_per_step()) / (step_seconds_ - first_step_seconds_)
                              : (step_seconds_ > 0 ? double(sum_.tokens) / step_seconds_ : 0);
  sum_.step_s = run > 1 ? step_seconds_ - first_step_seconds_ : step_seconds_;
  if (run > 1) sum_.comm_exposed_s -= first_step_comm_;
  if (profiling_) {
    if (run > 1) profile::accumulate(prof_sum_, prof_first_, /*subtract=*/true);
    sum_.profile = profile_json(prof_sum_, sum_.step_s, true);
  }
  sum_.peak_bytes = sum_.peak.total();
  sum_.argument_bytes = sum_.peak.argument();
  sum_.temp_bytes = sum_.peak.temp();
  if (!o_.out.empty() && lead_ && !train_curve_.points.empty()) {
    std::vector<Series> s{train_curve_};
    if (!eval_curve_.points.empty()) s.push_back(eval_curve_);
    write_svg_chart(o_.out + "/loss.svg", "hybridscan: " + cfg_.name + " training loss", "step", "cross-entropy (nats)", s);
  }
  return sum_;
}

TrainSummary Run::train() {
  log_setup();
  if (!o_.out.empty() && lead_) metrics_.open(o_.out + "/metrics.jsonl", resume_ ? std::ios::app : std::ios::trunc);
  t_start_ = Clock::now();
  last_step_ = o_.stop_after >= 0 ? std::min(o_.steps, first_step_ + o_.stop_after) : o_.steps;
  profiling_ = o_.profile || profile::enabled_by_env();
  for (int64_t step = first_step_; step < last_step_; ++step) {
    const StepRecord s = take_step(step);
    const bool evaluated = record(step, s);
    show_progress(step, s, evaluated);
    if (o_.save_every > 0 && (step + 1) % o_.save_every == 0 && step + 1 != last_step_) save(step + 1);
  }
  if (sum_.steps > first_step_) save(sum_.steps);
  return finish();
}

}  // namespace

TrainSummary run_training(const TrainOptions& o, std::ostream& log) { return Run(o, log).train(); }

}  // namespace hs::train
