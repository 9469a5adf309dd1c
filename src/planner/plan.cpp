#include "planner/plan.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>
#include <stdexcept>

#include "core/collectives.h"
#include "infer/decoder.h"
#include "infer/speculative.h"
#include "train/step.h"

namespace hs::planner {

size_t chip_hbm_bytes(const std::string& chip) {
  const double GiB = 1024.0 * 1024 * 1024;
  if (chip == "v5p") return static_cast<size_t>(95 * GiB);
  if (chip == "v6e") return static_cast<size_t>(32 * GiB);
  if (chip == "tpu7x") return static_cast<size_t>(192 * GiB);
  if (chip == "h100") return static_cast<size_t>(80e9);
  if (chip == "h200") return static_cast<size_t>(141e9);
  throw std::invalid_argument("unknown chip '" + chip + "' (known: v5p, v6e, tpu7x, h100, h200; or give the memory per device)");
}

PlanResult plan(const PlanRequest& r) {
  const auto t0 = std::chrono::steady_clock::now();
  r.model.validate();
  if (r.devices < 1 || r.batch_per_device < 1 || r.seq < 1)
    throw std::invalid_argument("devices, batch per device and sequence length must be positive (" +
                                std::to_string(r.devices) + ", " + std::to_string(r.batch_per_device) + ", " +
                                std::to_string(r.seq) + ")");
  const int64_t fsdp = r.fsdp > 0 ? r.fsdp : r.devices;
  if (r.devices % fsdp != 0)
    throw std::invalid_argument("an FSDP group of " + std::to_string(fsdp) + " must divide the " +
                                std::to_string(r.devices) + " devices");
  if (r.step.comm || r.step.batch_group || r.step.ep_group || r.step.update)
    throw std::invalid_argument("planner::plan: the plan's groups are its own (leave PlanRequest::step's null)");
  train::check_grad_accum(r.grad_accum, r.update_in_backward);
  MemoryAccountant mem(/*planning=*/true);
  VirtualCollectives group(fsdp);
  VirtualCollectives replicas(r.devices / fsdp);  // data parallel across FSDP groups: the gradients' all-reduce
  train::OptimizerConfig oc;
  oc.moment_dtype = r.moment_dtype;
  oc.clip = 0;  // what the plan counts does not depend on it; the update in the backward needs it off
  train::StepOptions schedule = r.step;
  schedule.comm = &group;
  // The training step itself, over shapes: this device's shards of the parameters and of both AdamW moments, its
  // micro-batches, each forward and backward, then the replicas' sum and the update (train::Step).
  train::Step step(r.model, r.weight_dtype, oc, schedule, r.update_in_backward, &replicas, mem);
  train::Batch shapes{nullptr, nullptr, r.batch_per_device, r.seq};
  shapes.documents = r.step.packing == train::Packing::Documents;
  const std::vector<train::Batch> micro(static_cast<size_t>(r.grad_accum), shapes);
  step.run(micro);

  PlanResult out;
  out.remat = r.step.remat;
  out.moment_dtype = r.moment_dtype;
  out.update_in_backward = r.update_in_backward;
  out.fsdp = fsdp;
  out.peak = mem.at_peak();
  out.argument_bytes = out.peak.argument();
  // The step returns the updated parameters and moments, written in place over the donated arguments.
  out.output_bytes = out.peak.bytes[size_t(MemCategory::Parameters)] + out.peak.bytes[size_t(MemCategory::OptimizerState)];
  out.alias_bytes = out.output_bytes;
  out.temp_bytes = out.peak.temp();
  out.total_bytes = out.argument_bytes + out.output_bytes + out.temp_bytes - out.alias_bytes;
  out.hbm_bytes = r.hbm_bytes;
  out.fits = r.hbm_bytes == 0 || out.total_bytes <= r.hbm_bytes;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

PlanResult plan_auto(PlanRequest r, size_t budget) {
  r.hbm_bytes = budget;
  r.step.remat = train::RematPolicy::None;
  PlanResult none = plan(r);
  if (none.fits) return none;
  r.step.remat = train::RematPolicy::Sublayer;
  return plan(r);
}

GeneratePlan plan_generate(const GeneratePlanRequest& r) {
  if (r.context <= 0 || r.batch <= 0) throw std::invalid_argument("generation plan: the context (" + std::to_string(r.context) + ") and the batch (" + std::to_string(r.batch) + ") must be positive");
  r.model.validate();
  MemoryAccountant mem(/*planning=*/true);
  model::ParamSet params(r.model, r.weight_dtype, mem, MemCategory::Parameters, false);
  GeneratePlan p;
  p.weights = mem.live_total();
  if (r.draft > 0) {  // infer::generate_speculative's own allocations, over shapes
    const int64_t prompt = std::min(2 * r.piece, r.context - 1);
    const infer::SpeculativeShapes s =
        infer::speculative_over_shapes(params, r.weight_dtype, r.batch, r.context, prompt, r.draft, r.piece, mem);
    p.kv_cache = s.kv_cache;
    p.recurrent_state = s.recurrent_state;
    p.mtp_kv_cache = s.mtp_kv_cache;
    p.total = mem.peak_total();
    p.workspace = p.total - p.weights - p.kv_cache - p.recurrent_state - p.mtp_kv_cache;
    return p;
  }
  // What infer::generate allocates, in its order: the decoder's caches, the logits of every sequence, then the
  // prefill of one piece and a step of all sequences.
  infer::Decoder dec(params, r.weight_dtype, r.batch, r.context, mem, r.piece);
  Buffer logits = mem.allocate_n<float>(static_cast<size_t>(r.batch * r.model.vocab), MemCategory::Workspace,
                                        "generate.logits");
  // Two pieces: the first attends with the flash kernel, later ones against the cache (workspace of its capacity).
  // (Room left for the step's position: a context of at most two pieces plans a prompt of context - 1 tokens; a
  // context of 1 has no step.)
  const std::vector<int32_t> prompt(static_cast<size_t>(std::max<int64_t>(1, std::min(2 * r.piece, r.context - 1))), 0);
  dec.prefill(0, prompt, nullptr);
  std::vector<int32_t> slots(static_cast<size_t>(r.batch)), ids(slots.size(), 0);
  std::iota(slots.begin(), slots.end(), 0);
  if (r.context > 1) dec.step(slots, ids, nullptr);
  p.kv_cache = dec.kv_cache_bytes();
  p.recurrent_state = dec.recurrent_state_bytes();
  p.total = mem.peak_total();
  p.workspace = p.total - p.weights - p.kv_cache - p.recurrent_state;
  return p;
}

QuantizedGeneratePlan plan_generate_gguf(const std::string& gguf_path, const GeneratePlanRequest& r) {
  if (r.context <= 0 || r.batch <= 0) throw std::invalid_argument("generation plan: the context (" + std::to_string(r.context) + ") and the batch (" + std::to_string(r.batch) + ") must be positive");
  MemoryAccountant mem(/*planning=*/true);
  const auto w = infer::load_gguf_weights(gguf_path, mem);
  const model::ModelConfig& c = w->params->config();
  QuantizedGeneratePlan q;
  q.converted_bytes = mem.live_total();
  q.quantized_bytes = w->quant->bytes;
  // As plan_generate, through the quantized decoder: two prefill pieces (the first attends with the flash kernel,
  // later ones against the cache), then a step of all sequences.
  infer::Decoder dec(*w->params, DType::F32, r.batch, r.context, mem, r.piece, w->quant.get());
  Buffer logits = mem.allocate_n<float>(static_cast<size_t>(r.batch * c.vocab), MemCategory::Workspace,
                                        "generate.logits");
  const std::vector<int32_t> prompt(static_cast<size_t>(std::max<int64_t>(1, std::min(2 * r.piece, r.context - 1))), 0);
  dec.prefill(0, prompt, nullptr);
  std::vector<int32_t> slots(static_cast<size_t>(r.batch)), ids(slots.size(), 0);
  std::iota(slots.begin(), slots.end(), 0);
  if (r.context > 1) dec.step(slots, ids, nullptr);
  GeneratePlan& p = q.plan;
  p.weights = q.converted_bytes + q.quantized_bytes;
  p.kv_cache = dec.kv_cache_bytes();
  p.recurrent_state = dec.recurrent_state_bytes();
  p.total = mem.peak_total() + q.quantized_bytes;
  p.workspace = p.total - p.weights - p.kv_cache - p.recurrent_state;
  return q;
}

ServePlan plan_serve(const ServePlanRequest& r) {
  if (r.context <= 0 || r.parallel <= 0)
    throw std::invalid_argument("server plan: the context (" + std::to_string(r.context) + ") and the slots (" +
                                std::to_string(r.parallel) + ") must be positive");
  if (!r.gguf_path.empty() && r.draft > 0)
    throw std::invalid_argument("a .gguf served from its quantized blocks has no speculative decoding (serve "
                                "--speculative runs it dequantized): plan it with --gguf-dequantize");
  MemoryAccountant mem(/*planning=*/true);
  std::unique_ptr<infer::InferenceWeights> file;  // gguf_path: the quantized model, as serve loads it
  std::unique_ptr<model::ParamSet> dense;
  if (!r.gguf_path.empty()) {
    file = infer::load_gguf_weights(r.gguf_path, mem);
  } else {
    r.model.validate();
    dense = std::make_unique<model::ParamSet>(r.model, r.weight_dtype, mem, MemCategory::Parameters, false);
  }
  const model::ParamSet& params = file ? *file->params : *dense;
  const model::ModelConfig& cfg = params.config();
  const DType compute = file ? DType::F32 : r.weight_dtype;
  const infer::QuantWeights* quant = file ? file->quant.get() : nullptr;
  ServePlan p;
  p.converted_bytes = mem.live_total();
  p.quantized_bytes = quant ? quant->bytes : 0;
  p.weights = p.converted_bytes + p.quantized_bytes;
  // In the order serve::Engine allocates: the decoder (64-token pieces: serve::PrefixCache::kChunk), the logits, then
  // the cache fills while prompts are prefilled and slots step.
  const int64_t chunk = 64, N = r.draft, P = r.parallel, V = cfg.vocab;
  if (N < 0 || N > infer::kMaxDraft)
    throw std::invalid_argument("--draft must be in [1, " + std::to_string(infer::kMaxDraft) + "] (got " +
                                std::to_string(N) + ")");
  if (N > 0 && cfg.mtp_layers < 1)
    throw std::invalid_argument("the model has no multi-token-prediction layer (mtp.*): --speculative mtp needs one "
                                "(a '+mtp' preset, or a config with num_nextn_predict_layers / mtp_num_hidden_layers)");
  infer::Decoder dec(params, compute, P, r.context + N, mem, chunk, quant, N);
  std::unique_ptr<infer::MtpDrafter> mtp;
  if (N > 0) mtp = std::make_unique<infer::MtpDrafter>(params, compute, P, r.context + N, mem, chunk);
  const size_t R = static_cast<size_t>(P * (N + 1)), hb = static_cast<size_t>(cfg.hidden * dtype_size(compute));
  Buffer logits = mem.allocate_n<float>(R * static_cast<size_t>(V), MemCategory::Workspace, "serve.logits");
  Buffer hidden, mlogits, mhidden, mh_in, phid, pending, dlogits, dhidden;  // (serve::Engine's, in its order)
  if (mtp) {
    hidden = mem.allocate(R * hb, MemCategory::Workspace, "serve.hidden");
    mlogits = mem.allocate_n<float>(R * static_cast<size_t>(V), MemCategory::Workspace, "serve.mtp_logits");
    mhidden = mem.allocate(R * hb, MemCategory::Workspace, "serve.mtp_hidden");
    mh_in = mem.allocate(R * hb, MemCategory::Workspace, "serve.mtp_hidden_in");
    phid = mem.allocate(static_cast<size_t>(chunk + 1) * hb, MemCategory::Workspace, "serve.prompt_hidden");
    pending = mem.allocate(static_cast<size_t>(P) * hb, MemCategory::Workspace, "serve.mtp_pending");
    dlogits = mem.allocate_n<float>(static_cast<size_t>(P * V), MemCategory::Workspace, "serve.draft_logits");
    dhidden = mem.allocate(static_cast<size_t>(P) * hb, MemCategory::Workspace, "serve.draft_hidden");
  }
  Buffer cache;
  if (r.cache_bytes > 0) cache = mem.allocate(r.cache_bytes, MemCategory::Activations, "prefix_cache");
  // (Room left for the step's position: a context of at most two pieces plans shorter ones.)
  const std::vector<int32_t> piece(static_cast<size_t>(std::min(chunk, r.context - 1)), 0);
  const int64_t m = static_cast<int64_t>(piece.size());
  // The MTP layer one position behind (serve::Engine::mtp_prefill): m - 1 rows after the first piece, m after a later.
  if (!piece.empty()) {
    dec.prefill(0, piece, nullptr, false, mtp ? phid.data() : nullptr);
    if (mtp && m > 1) mtp->prefill(0, 0, phid.data(), piece.data(), m - 1, nullptr, nullptr, false);
  }
  if (r.context > 2 * chunk) {
    dec.prefill(0, piece, nullptr, false, mtp ? phid.data() : nullptr);
    if (mtp) mtp->prefill(0, m - 1, phid.data(), piece.data(), m, nullptr, nullptr, false);
  }
  std::vector<int32_t> slots(static_cast<size_t>(P)), ids(slots.size(), 0);
  std::iota(slots.begin(), slots.end(), 0);
  if (!mtp) {
    dec.step(slots, ids, nullptr);
  } else {
    // The first draft's rows of the prompt's last position, then serve::Engine::speculative_step at its widest:
    // drafts 2..N, the verification of N + 1 positions of every slot, the catch-up on all of them.
    const int32_t first = 0;
    mtp->prefill(0, dec.length(0), phid.data(), &first, 1, ptr<float>(dlogits), dhidden.data(), true);
    std::vector<int32_t> pos(R), next(R, 0), rows(R);
    for (int64_t k = 1; k < N; ++k) {
      for (int64_t i = 0; i < P; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(dec.length(i) + k - 1);
      mtp->step(P, slots.data(), pos.data(), mh_in.data(), next.data(), ptr<float>(mlogits), mhidden.data());
    }
    ids.assign(R, 0);
    dec.verify(slots, N + 1, ids, ptr<float>(logits), hidden.data());
    for (int64_t i = 0; i < P; ++i) {
      const int64_t L = dec.length(i);
      dec.accept(i, N + 1);
      for (int64_t j = 0; j <= N; ++j) {
        rows[static_cast<size_t>(i * (N + 1) + j)] = static_cast<int32_t>(i);
        pos[static_cast<size_t>(i * (N + 1) + j)] = static_cast<int32_t>(L + j);
      }
    }
    mtp->step(static_cast<int64_t>(R), rows.data(), pos.data(), mh_in.data(), next.data(), ptr<float>(mlogits),
              mhidden.data());
    p.mtp_kv_cache = mtp->kv_cache_bytes();
  }
  p.kv_cache = dec.kv_cache_bytes();
  p.recurrent_state = dec.recurrent_state_bytes();
  p.prefix_cache = r.cache_bytes;
  p.total = mem.peak_total() + p.quantized_bytes;
  p.workspace = p.total - p.weights - p.kv_cache - p.recurrent_state - p.prefix_cache - p.mtp_kv_cache;
  return p;
}

namespace {
int recompute_rank(train::RematPolicy p) { return p == train::RematPolicy::None ? 0 : 1; }
std::string gb(size_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GB", double(b) / 1e9);
  return s;
}
}  // namespace

FitResult plan_fit(PlanRequest r, size_t budget) {
  r.hbm_bytes = budget;
  FitResult out;
  for (auto remat : {train::RematPolicy::None, train::RematPolicy::Sublayer, train::RematPolicy::Block})
    for (DType moments : {DType::F32, DType::BF16})
      for (bool update : {false, true}) {
        if (update && r.grad_accum > 1) continue;  // accumulation needs a gradient set across the micro-batches
        r.step.remat = remat;
        r.moment_dtype = moments;
        r.update_in_backward = update;
        out.candidates.push_back({plan(r), ""});
      }
  std::stable_sort(out.candidates.begin(), out.candidates.end(), [](const FitCandidate& a, const FitCandidate& b) {
    const int ra = recompute_rank(a.plan.remat), rb = recompute_rank(b.plan.remat);
    if (ra != rb) return ra < rb;
    if (a.plan.moment_dtype != b.plan.moment_dtype) return a.plan.moment_dtype == DType::F32;
    if (a.plan.update_in_backward != b.plan.update_in_backward) return !a.plan.update_in_backward;
    return a.plan.total_bytes < b.plan.total_bytes;
  });
  for (size_t i = 0; i < out.candidates.size(); ++i) {
    FitCandidate& c = out.candidates[i];
    if (!c.plan.fits) {
      c.why = "does not fit: " + gb(c.plan.total_bytes) + " > " + gb(budget);
    } else if (out.choice >= 0) {
      const PlanResult& k = out.candidates[static_cast<size_t>(out.choice)].plan;
      if (recompute_rank(c.plan.remat) > recompute_rank(k.remat)) c.why = "fits, but recomputes more than " + train::remat_name(k.remat);
      else if (c.plan.moment_dtype != k.moment_dtype) c.why = "fits, but rounds the moments to bf16";
      else if (c.plan.update_in_backward != k.update_in_backward) c.why = "fits, but updates in the backward (no clipping)";
      else c.why = "fits, but needs more memory";
    } else {
      out.choice = static_cast<int>(i);
    }
  }
  return out;
}

}  // namespace hs::planner
