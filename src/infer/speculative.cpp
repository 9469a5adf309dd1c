#include "infer/speculative.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "infer/decoder.h"
#include "infer/fused_step.h"
#include "kernels/embedding.h"
#include "kernels/gemv.h"
#include "kernels/matmul.h"
#include "kernels/norms.h"
#include "model/layer.h"
#include "model/linear.h"
#include "model/mtp.h"

namespace hs::infer {

namespace {
const TensorView& mtp_view(const model::ParamSet& ps, model::g::Mtp which) {
  return ps.all()[ps.mtp_index(which)].tensor.view();
}
}  // namespace

struct MtpDrafter::Impl {
  const model::ParamSet& params;
  const model::ModelConfig& cfg;
  DType compute;
  int64_t capacity, piece;
  MemoryAccountant& mem;
  std::vector<model::LayerSlot> order{model::LayerSlot{model::StackGroup::Mtp, 0, 0}};
  std::vector<model::LayerCache> caches;
  model::Converted<float> w_e, w_h, w_norm;
  std::unique_ptr<FusedStep<float>> f32;
  std::unique_ptr<FusedStep<bf16>> f16;

  Impl(const model::ParamSet& ps, DType c, int64_t slots, int64_t cap, MemoryAccountant& m, int64_t pc)
      : params(ps), cfg(ps.config()), compute(c), capacity(cap), piece(pc), mem(m) {
    if (cfg.mtp_layers < 1)
      throw std::invalid_argument("the checkpoint has no multi-token-prediction layer (mtp.*): speculative decoding "
                                  "with --speculative mtp needs one (a model trained from a '+mtp' preset, or a "
                                  "released Qwen3-Next / Qwen3.5 checkpoint converted with its mtp.* tensors)");
    if (compute != DType::F32 && compute != DType::BF16) throw std::invalid_argument("mtp drafter: compute fp32 or bf16");
    // The steps run fused: every matrix of the layer, fc and the LM head in the compute dtype.
    const model::LayerWeights lw = params.layer(order[0]);
    const auto specs = model::layer_specs(cfg, order[0].kind());
    bool ok = params.global(model::g::kLmHead).dtype == compute && mtp_view(params, model::g::kMtpFc).dtype == compute;
    for (size_t j = 0; j < specs.size(); ++j) ok = ok && (!specs[j].is_matrix || lw[j].dtype == compute);
    if (!ok)
      throw std::invalid_argument("--speculative mtp: the MTP layer's matrices and the LM head must be stored in the "
                                  "compute dtype (give --weight-dtype to convert them)");
    model::LayerCache cache;
    cache.capacity = cap;
    const size_t n = static_cast<size_t>(slots * cfg.kv_heads * cap * cfg.head_dim * dtype_size(c));
    cache.k = mem.allocate(n, MemCategory::Activations, "cache.mtp_keys");
    cache.v = mem.allocate(n, MemCategory::Activations, "cache.mtp_values");
    caches.push_back(std::move(cache));
    w_e = model::as_type<float>(mtp_view(params, model::g::kMtpNormEmbedding), mem, MemCategory::WeightCasts, "weight_cast");
    w_h = model::as_type<float>(mtp_view(params, model::g::kMtpNormHidden), mem, MemCategory::WeightCasts, "weight_cast");
    const TensorView& norm = mtp_view(params, model::g::kMtpNorm);
    if (compute == DType::F32) f32 = std::make_unique<FusedStep<float>>(params, order, caches, mem, nullptr, &norm);
    else f16 = std::make_unique<FusedStep<bf16>>(params, order, caches, mem, nullptr, &norm);
    w_norm = model::as_type<float>(norm, mem, MemCategory::WeightCasts, "weight_cast");
  }

  // m [n, H] = fc([norm(embed(next_ids)); norm(h)]) (model::mtp_input_forward).
  template <typename T> void input(const T* h, const int32_t* next_ids, int64_t n, T* m) {
    const int64_t H = cfg.hidden, V = cfg.vocab;
    Buffer e = mem.allocate_n<T>(static_cast<size_t>(n * H), MemCategory::Workspace, "mtp.embed");
    const TensorView& table = params.global(model::g::kEmbed);
    if (!mem.planning()) {
      if (table.dtype == DType::F32) kernels::embedding_forward(next_ids, n, static_cast<const float*>(table.data), V, H, ptr<T>(e));
      else kernels::embedding_forward(next_ids, n, static_cast<const bf16*>(table.data), V, H, ptr<T>(e));
    }
    model::MtpInputSaved saved;
    model::mtp_input_forward<T>(mem, ptr<T>(e), h, w_e.ptr, w_h.ptr,
                                static_cast<const T*>(mtp_view(params, model::g::kMtpFc).data), m, n, H,
                                static_cast<float>(cfg.rms_eps), saved);
  }

  template <typename T>
  void prefill(int64_t slot, int64_t start, const T* h, const int32_t* next_ids, int64_t n, float* logits,
               T* hidden_last, bool head) {
    const int64_t H = cfg.hidden, V = cfg.vocab;
    if (n < 1 || start < 0 || start + n > capacity)
      throw std::out_of_range("mtp drafter: positions [" + std::to_string(start) + ", " + std::to_string(start + n) +
                              ") outside the capacity " + std::to_string(capacity));
    const kernels::SmallRowProducts small_rows;
    const int32_t s = static_cast<int32_t>(slot);
    std::vector<int32_t> positions(static_cast<size_t>(std::min(n, piece)));
    Buffer out;
    for (int64_t off = 0; off < n; off += piece) {
      const int64_t k = std::min(piece, n - off);
      for (int64_t i = 0; i < k; ++i) positions[static_cast<size_t>(i)] = static_cast<int32_t>(start + off + i);
      Buffer m = mem.allocate_n<T>(static_cast<size_t>(k * H), MemCategory::Workspace, "mtp.in");
      input<T>(h + off * H, next_ids + off, k, ptr<T>(m));
      out = mem.allocate_n<T>(static_cast<size_t>(k * H), MemCategory::Workspace, "mtp.out");
      model::LayerContext ctx{cfg, mem, 1, k, positions.data(), nullptr, 1, false, &caches[0], &s};
      model::layer_forward<T>(ctx, params.layer(order[0]), ptr<T>(m), ptr<T>(out), nullptr);
      if (off + k == n && head) {  // (the head's row is allocated in planning mode too: the plan counts it)
        Buffer xf = mem.allocate_n<T>(static_cast<size_t>(H), MemCategory::Workspace, "mtp.norm_out");
        if (mem.planning()) continue;
        const T* last = ptr<T>(out) + (k - 1) * H;
        float rstd;
        kernels::rmsnorm_forward(last, w_norm.ptr, ptr<T>(xf), &rstd, 1, H, float(cfg.rms_eps));
        if (hidden_last) std::copy_n(ptr<T>(xf), H, hidden_last);
        kernels::gemv(ptr<T>(xf), static_cast<const T*>(params.global(model::g::kLmHead).data), logits, 1, V, H);
      }
    }
  }

  template <typename T>
  void step(int64_t R, const int32_t* slots, const int32_t* positions, const T* h, const int32_t* next_ids,
            float* logits, T* hidden, FusedStep<T>& f) {
    const int64_t H = cfg.hidden, V = cfg.vocab;
    for (int64_t r = 0; r < R; ++r)
      if (positions[r] < 0 || positions[r] >= capacity)
        throw std::out_of_range("mtp drafter: position " + std::to_string(positions[r]) + " outside the capacity");
    const kernels::SmallRowProducts small_rows;
    for (int64_t r0 = 0; r0 < R; r0 += kernels::kGemvMaxRows) {  // groups in order: a row's earlier positions first
      const int64_t k = std::min(kernels::kGemvMaxRows, R - r0);
      Buffer m = mem.allocate_n<T>(static_cast<size_t>(k * H), MemCategory::Workspace, "mtp.in");
      input<T>(h + r0 * H, next_ids + r0, k, ptr<T>(m));
      StepExtras ex;
      ex.input = ptr<T>(m);
      ex.hidden = hidden ? hidden + r0 * H : nullptr;
      f.run(k, slots + r0, positions + r0, next_ids + r0, logits + r0 * V, &ex);
    }
  }
};

MtpDrafter::MtpDrafter(const model::ParamSet& params, DType compute, int64_t slots, int64_t capacity,
                       MemoryAccountant& mem, int64_t piece)
    : impl_(std::make_unique<Impl>(params, compute, slots, capacity, mem, piece)) {}
MtpDrafter::~MtpDrafter() = default;

void MtpDrafter::prefill(int64_t slot, int64_t start, const void* h, const int32_t* next_ids, int64_t n,
                         float* logits, void* hidden_last, bool head) {
  if (impl_->f32)
    impl_->prefill<float>(slot, start, static_cast<const float*>(h), next_ids, n, logits,
                          static_cast<float*>(hidden_last), head);
  else
    impl_->prefill<bf16>(slot, start, static_cast<const bf16*>(h), next_ids, n, logits, static_cast<bf16*>(hidden_last),
                         head);
}

size_t MtpDrafter::kv_cache_bytes() const { return impl_->caches[0].k.bytes() + impl_->caches[0].v.bytes(); }

size_t MtpDrafter::kv_bytes_per_position() const {
  return static_cast<size_t>(2 * impl_->cfg.kv_heads * impl_->cfg.head_dim * dtype_size(impl_->compute));
}

// One layer's keys then values, head by head: the rows of [from, to) are contiguous within a head.
void MtpDrafter::save_kv(int64_t slot, int64_t from, int64_t to, void* out) const {
  const Impl& m = *impl_;
  if (slot < 0 || from < 0 || to < from || to > m.capacity)
    throw std::out_of_range("mtp drafter: positions [" + std::to_string(from) + ", " + std::to_string(to) +
                            ") outside the capacity " + std::to_string(m.capacity));
  const size_t row = static_cast<size_t>(m.cfg.head_dim * dtype_size(m.compute)), n = static_cast<size_t>(to - from) * row;
  char* o = static_cast<char*>(out);
  for (const Buffer* b : {&m.caches[0].k, &m.caches[0].v})
    for (int64_t h = 0; h < m.cfg.kv_heads; ++h) {
      const size_t at = static_cast<size_t>((slot * m.cfg.kv_heads + h) * m.capacity + from) * row;
      if (at + n > b->bytes()) throw std::out_of_range("mtp drafter: slot " + std::to_string(slot) + " does not exist");
      std::memcpy(o, static_cast<const char*>(b->data()) + at, n);
      o += n;
    }
}

void MtpDrafter::load_kv(int64_t slot, int64_t from, int64_t to, const void* in) {
  Impl& m = *impl_;
  if (slot < 0 || from < 0 || to < from || to > m.capacity)
    throw std::out_of_range("mtp drafter: positions [" + std::to_string(from) + ", " + std::to_string(to) +
                            ") outside the capacity " + std::to_string(m.capacity));
  const size_t row = static_cast<size_t>(m.cfg.head_dim * dtype_size(m.compute)), n = static_cast<size_t>(to - from) * row;
  const char* p = static_cast<const char*>(in);
  for (Buffer* b : {&m.caches[0].k, &m.caches[0].v})
    for (int64_t h = 0; h < m.cfg.kv_heads; ++h) {
      const size_t at = static_cast<size_t>((slot * m.cfg.kv_heads + h) * m.capacity + from) * row;
      if (at + n > b->bytes()) throw std::out_of_range("mtp drafter: slot " + std::to_string(slot) + " does not exist");
      std::memcpy(static_cast<char*>(b->data()) + at, p, n);
      p += n;
    }
}

void MtpDrafter::step(int64_t R, const int32_t* slots, const int32_t* positions, const void* h,
                      const int32_t* next_ids, float* logits, void* hidden) {
  if (impl_->f32)
    impl_->step<float>(R, slots, positions, static_cast<const float*>(h), next_ids, logits, static_cast<float*>(hidden),
                       *impl_->f32);
  else
    impl_->step<bf16>(R, slots, positions, static_cast<const bf16*>(h), next_ids, logits, static_cast<bf16*>(hidden),
                      *impl_->f16);
}

void sampling_probs(const float* logits, int64_t vocab, const Sampling& s, std::vector<double>& probs) {
  probs.assign(static_cast<size_t>(vocab), 0.0);
  if (s.temperature <= 0) {  // greedy: all mass on sample_token's choice
    std::mt19937_64 unused;
    std::vector<std::pair<float, int32_t>> scratch;
    probs[static_cast<size_t>(sample_token(logits, vocab, s, unused, scratch))] = 1;
    return;
  }
  int64_t best = -1;
  for (int64_t i = 0; i < vocab; ++i)
    if (!std::isnan(logits[i]) && (best < 0 || logits[i] > logits[best])) best = i;
  if (best < 0 || !std::isfinite(logits[best])) {  // as sample_token: no distribution, its one answer
    probs[static_cast<size_t>(best < 0 ? 0 : best)] = 1;
    return;
  }
  const double mx = logits[best], inv_t = 1.0 / s.temperature;
  if (s.top_k <= 0 && s.top_p >= 1) {  // the whole vocabulary: no order needed
    double total = 0;
    for (int64_t i = 0; i < vocab; ++i)
      if (!std::isnan(logits[i])) total += probs[static_cast<size_t>(i)] = std::exp((double(logits[i]) - mx) * inv_t);
    for (double& x : probs) x /= total;
    return;
  }
  // Candidates: the ids sample_token can draw (weights below 2^-54 of the largest never change its draw).
  const double floor = std::log(0x1p-54);
  std::vector<std::pair<double, int32_t>> c;  // (weight, id), most likely first, the lower id first on a tie
  for (int64_t i = 0; i < vocab; ++i)
    if (!std::isnan(logits[i]) && (double(logits[i]) - mx) * inv_t >= floor)
      c.emplace_back(std::exp((double(logits[i]) - mx) * inv_t), static_cast<int32_t>(i));
  auto more = [](const std::pair<double, int32_t>& a, const std::pair<double, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const size_t K = s.top_k > 0 ? std::min<size_t>(static_cast<size_t>(s.top_k), c.size()) : c.size();
  std::partial_sort(c.begin(), c.begin() + static_cast<std::ptrdiff_t>(K), c.end(), more);
  c.resize(K);
  double total = 0;
  for (const auto& x : c) total += x.first;
  size_t n = c.size();
  if (s.top_p < 1) {
    double acc = 0;
    for (n = 0; n < c.size();) {
      acc += c[n++].first;
      if (acc >= s.top_p * total) break;
    }
    total = acc;
  }
  for (size_t i = 0; i < n; ++i) probs[static_cast<size_t>(c[i].second)] = c[i].first / total;
}

int32_t draw(const std::vector<double>& w, std::mt19937_64& rng) {
  double total = 0;
  for (double x : w) total += x;
  const double u = std::uniform_real_distribution<double>(0, total)(rng);
  double acc = 0;
  int32_t last = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    if (w[i] <= 0) continue;
    acc += w[i];
    last = static_cast<int32_t>(i);
    if (u < acc) return last;
  }
  return last;
}

int64_t accept_drafts(const float* rows, int64_t vocab, const int32_t* drafts, int64_t n, const Sampling& s,
                      std::mt19937_64& rng, const std::vector<std::vector<double>>& q,
                      std::vector<std::vector<double>>& p, std::vector<std::pair<float, int32_t>>& scratch,
                      std::vector<int32_t>& emitted) {
  emitted.clear();
  if (s.temperature > 0) {
    p.resize(static_cast<size_t>(n + 1));
    for (int64_t k = 0; k <= n; ++k) sampling_probs(rows + k * vocab, vocab, s, p[static_cast<size_t>(k)]);
    return speculative_accept(p, q, drafts, n, rng, emitted);
  }
  int64_t acc = 0;
  for (; acc < n; ++acc) {
    const int32_t t = sample_token(rows + acc * vocab, vocab, s, rng, scratch);
    if (t != drafts[acc]) break;
    emitted.push_back(t);
  }
  emitted.push_back(sample_token(rows + acc * vocab, vocab, s, rng, scratch));
  return acc;
}

int64_t speculative_accept(const std::vector<std::vector<double>>& p, const std::vector<std::vector<double>>& q,
                           const int32_t* drafts, int64_t n, std::mt19937_64& rng, std::vector<int32_t>& out,
                           bool resample_residual) {
  std::vector<double> residual;
  for (int64_t j = 0; j < n; ++j) {
    const std::vector<double>& pj = p[static_cast<size_t>(j)];
    const std::vector<double>& qj = q[static_cast<size_t>(j)];
    const size_t d = static_cast<size_t>(drafts[j]);
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    if (qj[d] > 0 && u * qj[d] < pj[d]) {  // kept with probability min(1, p(d) / q(d))
      out.push_back(drafts[j]);
      continue;
    }
    residual.resize(pj.size());
    double sum = 0;
    for (size_t i = 0; i < pj.size(); ++i) sum += residual[i] = std::max(0.0, pj[i] - qj[i]);
    out.push_back(resample_residual && sum > 0 ? draw(residual, rng) : draw(pj, rng));
    return j;
  }
  out.push_back(draw(p[static_cast<size_t>(n)], rng));
  return n;
}

namespace {
// The drafter is made only once the decoder's fused step is known to run (verification needs it).
const model::ParamSet& fused_or_throw(const Decoder& dec, const model::ParamSet& params) {
  if (!dec.fused())
    throw std::invalid_argument("--speculative mtp verifies on the fused decode step, which these weights do not "
                                "allow (matrices and LM head stored in the compute dtype, HS_DECODE_FUSED not 0)");
  return params;
}
}  // namespace

SpeculativeRun::SpeculativeRun(const model::ParamSet& params, DType compute, int64_t batch, int64_t capacity,
                               int64_t draft_, int64_t piece_, int64_t longest, MemoryAccountant& mem)
    : draft(draft_),
      piece(piece_),
      hidden_row_bytes(static_cast<size_t>(params.config().hidden * dtype_size(compute))),
      dec(params, compute, batch, capacity, mem, piece_, nullptr, draft_),
      mtp(fused_or_throw(dec, params), compute, batch, capacity, mem, piece_) {
  const int64_t R = batch * (draft + 1), V = params.config().vocab;
  const size_t hb = hidden_row_bytes;
  logits = mem.allocate_n<float>(static_cast<size_t>(R * V), MemCategory::Workspace, "generate.logits");
  mlogits = mem.allocate_n<float>(static_cast<size_t>(R * V), MemCategory::Workspace, "generate.mtp_logits");
  hidden = mem.allocate(static_cast<size_t>(R) * hb, MemCategory::Workspace, "generate.hidden");
  mhidden = mem.allocate(static_cast<size_t>(R) * hb, MemCategory::Workspace, "generate.mtp_hidden");
  mh_in = mem.allocate(static_cast<size_t>(R) * hb, MemCategory::Workspace, "generate.mtp_hidden_in");
  phid = mem.allocate(static_cast<size_t>(std::min(longest, piece)) * hb, MemCategory::Workspace,
                      "generate.prompt_hidden");
}

bool SpeculativeRun::prefill(int64_t slot, std::span<const int32_t> p,
                             const std::function<bool(const float*, int32_t&)>& first) {
  const int64_t P = static_cast<int64_t>(p.size()), V = dec.config().vocab;
  std::vector<int32_t> next;
  for (int64_t off = 0; off < P; off += piece) {
    const int64_t k = std::min(piece, P - off);
    const bool last = off + k == P;
    dec.prefill(slot, p.subspan(static_cast<size_t>(off), static_cast<size_t>(k)), last ? ptr<float>(logits) : nullptr,
                false, phid.data());
    // The MTP layer's position t reads the target's h_t and x_{t+1}: the prompt's next id, past its end the first
    // new token.
    next.assign(p.begin() + off + 1, p.begin() + off + k);
    if (last) {
      int32_t id = 0;
      if (!first(ptr<float>(logits), id)) return false;
      next.push_back(id);
    } else {
      next.push_back(p[static_cast<size_t>(off + k)]);
    }
    mtp.prefill(slot, off, phid.data(), next.data(), k, last ? ptr<float>(mlogits) + slot * V : nullptr,
                last ? static_cast<char*>(mhidden.data()) + static_cast<size_t>(slot) * hidden_row_bytes : nullptr, last);
  }
  return true;
}

SpeculativeShapes speculative_over_shapes(const model::ParamSet& params, DType compute, int64_t batch, int64_t context,
                                          int64_t prompt, int64_t draft, int64_t piece, MemoryAccountant& mem) {
  if (!mem.planning()) throw std::logic_error("speculative_over_shapes: the accountant must be in planning mode");
  if (draft < 1 || draft > kMaxDraft)
    throw std::invalid_argument("--draft must be in [1, " + std::to_string(kMaxDraft) + "] (got " +
                                std::to_string(draft) + ")");
  if (params.config().mtp_layers < 1)
    throw std::invalid_argument("the model has no multi-token-prediction layer (mtp.*): --speculative mtp needs one "
                                "(a '+mtp' preset, or a config with num_nextn_predict_layers / mtp_num_hidden_layers)");
  if (batch < 1 || context < 2 || prompt < 1 || prompt > context - 1)
    throw std::invalid_argument("speculative plan: batch " + std::to_string(batch) + ", context " +
                                std::to_string(context) + ", prompt " + std::to_string(prompt) +
                                " (a prompt of 1 to context - 1 tokens: at least one decode step)");
  const int64_t N = draft;
  SpeculativeRun run(params, compute, batch, context + N, N, piece, prompt, mem);
  SpeculativeShapes out;
  out.kv_cache = run.dec.kv_cache_bytes();
  out.recurrent_state = run.dec.recurrent_state_bytes();
  out.mtp_kv_cache = run.mtp.kv_cache_bytes();
  const std::vector<int32_t> p(static_cast<size_t>(prompt), 0);
  std::vector<int32_t> slots(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) {
    slots[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    run.prefill(i, p, [](const float*, int32_t& id) {
      id = 0;
      return true;
    });
  }
  // The widest step, as generate_speculative runs it: drafts 2..N, the verification, the catch-up on every position.
  std::vector<int32_t> pos(static_cast<size_t>(batch * (N + 1))), ids(pos.size(), 0), rows(pos.size());
  for (int64_t k = 1; k < N; ++k) {
    for (int64_t i = 0; i < batch; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(prompt + k - 1);
    run.mtp.step(batch, slots.data(), pos.data(), run.mh_in.data(), ids.data(), ptr<float>(run.mlogits),
                 run.mhidden.data());
  }
  run.dec.verify(slots, N + 1, ids, ptr<float>(run.logits), run.hidden.data());
  for (int64_t i = 0; i < batch; ++i) {
    run.dec.accept(i, N + 1);
    for (int64_t j = 0; j <= N; ++j) {
      rows[static_cast<size_t>(i * (N + 1) + j)] = static_cast<int32_t>(i);
      pos[static_cast<size_t>(i * (N + 1) + j)] = static_cast<int32_t>(prompt + j);
    }
  }
  run.mtp.step(batch * (N + 1), rows.data(), pos.data(), run.mh_in.data(), ids.data(), ptr<float>(run.mlogits),
               run.mhidden.data());
  return out;
}

GenerateResult generate_speculative(const model::ParamSet& params, const std::vector<std::vector<int32_t>>& prompts,
                                    const GenerateOptions& opt, int64_t draft, MemoryAccountant& mem,
                                    const std::function<bool(size_t, int32_t)>& on_token, SpeculativeStats* stats) {
  using Clock = std::chrono::steady_clock;
  const model::ModelConfig& cfg = params.config();
  if (draft < 1 || draft > kMaxDraft)
    throw std::invalid_argument("--draft must be in [1, " + std::to_string(kMaxDraft) + "] (got " +
                                std::to_string(draft) + ")");
  if (cfg.mtp_layers < 1)
    throw std::invalid_argument("the checkpoint has no multi-token-prediction layer (mtp.*): --speculative mtp needs "
                                "one (a model trained from a '+mtp' preset, or a released Qwen3-Next / Qwen3.5 "
                                "checkpoint with its mtp.* tensors)");
  if (opt.quant) throw std::invalid_argument("--speculative mtp does not run on quantized (--gguf-blocks) weights");
  const int64_t longest = longest_prompt(prompts, opt.max_new_tokens);
  const int64_t B = static_cast<int64_t>(prompts.size()), V = cfg.vocab, N = draft;
  mem.reset_peak();
  // Verification writes up to N positions past the last one plain decoding would reach.
  const int64_t capacity = longest + opt.max_new_tokens - 1 + N;
  SpeculativeRun run(params, opt.compute, B, capacity, N, opt.piece, longest, mem);
  Decoder& dec = run.dec;
  MtpDrafter& mtp = run.mtp;
  const size_t hb = run.hidden_row_bytes;
  GenerateResult r;
  r.kv_cache_bytes = dec.kv_cache_bytes();
  r.recurrent_state_bytes = dec.recurrent_state_bytes();
  r.tokens.resize(static_cast<size_t>(B));
  SpeculativeStats st;
  st.draft = N;
  st.accepted.assign(static_cast<size_t>(N), 0);

  Buffer& logits = run.logits;
  Buffer& mlogits = run.mlogits;
  char* hid = static_cast<char*>(run.hidden.data());
  char* mhid = static_cast<char*>(run.mhidden.data());
  char* mhin = static_cast<char*>(run.mh_in.data());
  std::vector<std::mt19937_64> rngs;
  for (int64_t i = 0; i < B; ++i) rngs.emplace_back(opt.sampling.seed + static_cast<uint64_t>(i));
  std::vector<std::pair<float, int32_t>> scratch;
  const bool greedy = opt.sampling.temperature <= 0;

  auto take = [&](int64_t i, int32_t id) {
    auto& out = r.tokens[static_cast<size_t>(i)];
    out.push_back(id);
    const bool go_on = on_token ? on_token(static_cast<size_t>(i), id) : true;
    return go_on && static_cast<int64_t>(out.size()) < opt.max_new_tokens &&
           std::find(opt.stop_ids.begin(), opt.stop_ids.end(), id) == opt.stop_ids.end();
  };

  // Per sequence: the MTP logits / output row that the next draft comes from (row i of mlogits / mhidden).
  std::vector<int32_t> active;
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < B; ++i) {
    const auto& p = prompts[static_cast<size_t>(i)];
    r.prefill_tokens += static_cast<int64_t>(p.size());
    const bool go_on = run.prefill(i, p, [&](const float* row, int32_t& id) {
      id = sample_token(row, V, opt.sampling, rngs[static_cast<size_t>(i)], scratch);
      return take(i, id);
    });
    if (go_on) active.push_back(static_cast<int32_t>(i));
  }
  const auto t1 = Clock::now();

  std::vector<int32_t> ids, mslots, mpos, mnext, emitted;
  std::vector<std::vector<int32_t>> drafts(static_cast<size_t>(B), std::vector<int32_t>(static_cast<size_t>(N)));
  // Sampling: the draft distributions q[i][k] and the target's p[k].
  std::vector<std::vector<std::vector<double>>> q(static_cast<size_t>(B));
  std::vector<std::vector<double>> pdist(static_cast<size_t>(N + 1));
  std::vector<int64_t> row_of(static_cast<size_t>(B));  // the MTP row each active sequence drafts from next
  for (int32_t i : active) row_of[static_cast<size_t>(i)] = i;
  auto choose = [&](int32_t i, int64_t k, const float* row) {  // draft k of sequence i from MTP logits
    if (greedy) return sample_token(row, V, opt.sampling, rngs[static_cast<size_t>(i)], scratch);
    auto& qi = q[static_cast<size_t>(i)];
    qi.resize(static_cast<size_t>(N));
    sampling_probs(row, V, opt.sampling, qi[static_cast<size_t>(k)]);
    return draw(qi[static_cast<size_t>(k)], rngs[static_cast<size_t>(i)]);
  };
  while (!active.empty()) {
    const int64_t A = static_cast<int64_t>(active.size());
    const auto d0 = Clock::now();
    // Draft 1 from the rows left by the prefill or the last catch-up; drafts 2..N from the MTP layer's own output.
    for (int32_t i : active)
      drafts[static_cast<size_t>(i)][0] = choose(i, 0, ptr<float>(mlogits) + row_of[static_cast<size_t>(i)] * V);
    for (int64_t k = 1; k < N; ++k) {
      mslots.clear();
      mpos.clear();
      mnext.clear();
      for (int64_t a = 0; a < A; ++a) {
        const int32_t i = active[static_cast<size_t>(a)];
        mslots.push_back(i);
        mpos.push_back(static_cast<int32_t>(dec.length(i) + k - 1));
        mnext.push_back(drafts[static_cast<size_t>(i)][static_cast<size_t>(k - 1)]);
        std::memcpy(mhin + static_cast<size_t>(a) * hb, mhid + static_cast<size_t>(row_of[static_cast<size_t>(i)]) * hb, hb);
      }
      mtp.step(A, mslots.data(), mpos.data(), mhin, mnext.data(), ptr<float>(mlogits), mhid);
      for (int64_t a = 0; a < A; ++a) {
        const int32_t i = active[static_cast<size_t>(a)];
        row_of[static_cast<size_t>(i)] = a;
        drafts[static_cast<size_t>(i)][static_cast<size_t>(k)] = choose(i, k, ptr<float>(mlogits) + a * V);
      }
    }
    const auto d1 = Clock::now();
    // Verify [last token, drafts] of every active sequence in one step.
    ids.clear();
    for (int32_t i : active) {
      ids.push_back(r.tokens[static_cast<size_t>(i)].back());
      for (int32_t d : drafts[static_cast<size_t>(i)]) ids.push_back(d);
    }
    dec.verify(active, N + 1, ids, ptr<float>(logits), hid);
    const auto d2 = Clock::now();
    st.draft_seconds += std::chrono::duration<double>(d1 - d0).count();
    st.verify_seconds += std::chrono::duration<double>(d2 - d1).count();
    // Accept, emit, roll back; then the MTP layer catches up on the kept positions (true hidden states).
    mslots.clear();
    mpos.clear();
    mnext.clear();
    size_t kept = 0;
    for (int64_t a = 0; a < A; ++a) {
      const int32_t i = active[static_cast<size_t>(a)];
      const float* rows = ptr<float>(logits) + a * (N + 1) * V;
      const int64_t acc = accept_drafts(rows, V, drafts[static_cast<size_t>(i)].data(), N, opt.sampling,
                                        rngs[static_cast<size_t>(i)], q[static_cast<size_t>(i)], pdist, scratch,
                                        emitted);
      ++st.steps;
      for (int64_t k = 0; k < acc; ++k) ++st.accepted[static_cast<size_t>(k)];
      const int64_t L = dec.length(i);
      dec.accept(i, acc + 1);
      bool go_on = true;
      for (int32_t t : emitted) {
        ++st.emitted;
        ++r.decode_tokens;
        if (!(go_on = take(i, t))) break;
      }
      if (!go_on) continue;
      active[kept++] = i;
      for (int64_t j = 0; j <= acc; ++j) {  // MTP positions L..L+acc: (h_t, x_{t+1})
        mslots.push_back(i);
        mpos.push_back(static_cast<int32_t>(L + j));
        mnext.push_back(emitted[static_cast<size_t>(j)]);
        std::memcpy(mhin + (mslots.size() - 1) * hb, hid + static_cast<size_t>(a * (N + 1) + j) * hb, hb);
      }
      row_of[static_cast<size_t>(i)] = static_cast<int64_t>(mslots.size()) - 1;
    }
    active.resize(kept);
    if (!mslots.empty()) {
      const auto c0 = Clock::now();
      mtp.step(static_cast<int64_t>(mslots.size()), mslots.data(), mpos.data(), mhin, mnext.data(), ptr<float>(mlogits),
               mhid);
      st.draft_seconds += std::chrono::duration<double>(Clock::now() - c0).count();
    }
  }
  const auto t2 = Clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  r.decode_seconds = std::chrono::duration<double>(t2 - t1).count();
  r.peak_bytes = mem.peak_total();
  if (stats) *stats = st;
  return r;
}

}  // namespace hs::infer
