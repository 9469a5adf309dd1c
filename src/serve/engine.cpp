#include "serve/engine.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

namespace hs::serve {

namespace {
int64_t since_ns(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

// Checked before the decoder is made: its capacity and recurrent-state slots grow with the draft.
int64_t checked_draft(const model::ParamSet& params, const EngineOptions& opt, const infer::QuantWeights* quant) {
  if (opt.draft == 0) return 0;
  if (opt.draft < 1 || opt.draft > infer::kMaxDraft)
    throw std::invalid_argument("--draft must be in [1, " + std::to_string(infer::kMaxDraft) + "] (got " +
                                std::to_string(opt.draft) + ")");
  if (params.config().mtp_layers < 1)
    throw std::invalid_argument("the checkpoint has no multi-token-prediction layer (mtp.*): serve --speculative mtp "
                                "needs one (a model trained from a '+mtp' preset, or a released Qwen3-Next / Qwen3.5 "
                                "checkpoint with its mtp.* tensors); serve it without --speculative");
  if (quant) throw std::invalid_argument("--speculative mtp does not run on quantized (--gguf-blocks) weights");
  return opt.draft;
}
}  // namespace

// The decoder prefills in pieces of PrefixCache::kChunk: a prompt restored at a chunk edge then runs the same pieces
// (the same kernels on the same rows) as one prefilled from the start, so a cache hit changes no bit.
Engine::Engine(const model::ParamSet& params, DType compute, const EngineOptions& opt, MemoryAccountant& mem,
               const infer::QuantWeights* quant)
    : opt_(opt),
      mem_(mem),
      // Verification writes up to `draft` positions past the last one plain decoding would reach.
      dec_(params, compute, opt.parallel, opt.context + checked_draft(params, opt, quant), mem, PrefixCache::kChunk,
           quant, opt.draft),
      hb_(static_cast<size_t>(params.config().hidden * dtype_size(compute))) {
  if (opt.prefill_chunk <= 0 || opt.prefill_chunk % PrefixCache::kChunk != 0)
    throw std::invalid_argument("the prefill chunk (" + std::to_string(opt.prefill_chunk) +
                                ") must be a positive multiple of " + std::to_string(PrefixCache::kChunk));
  if (opt.queue < 0) throw std::invalid_argument("the queue length must be >= 0");
  if (opt.draft > 0) {
    if (!dec_.fused())
      throw std::invalid_argument("--speculative mtp verifies on the fused decode step, which these weights do not "
                                  "allow (matrices and LM head stored in the compute dtype: give --weight-dtype; "
                                  "HS_DECODE_FUSED not 0)");
    mtp_ = std::make_unique<infer::MtpDrafter>(params, compute, opt.parallel, opt.context + opt.draft, mem,
                                               PrefixCache::kChunk);
  }
  if (opt.cache_bytes > 0) cache_ = std::make_unique<PrefixCache>(opt.cache_bytes, mem, mtp_.get(), hb_);
  const int64_t V = params.config().vocab, R = opt.parallel * (opt.draft + 1);
  logits_ = mem.allocate_n<float>(static_cast<size_t>(R * V), MemCategory::Workspace, "serve.logits");
  if (mtp_) {
    const size_t P = static_cast<size_t>(opt.parallel), rows = static_cast<size_t>(R);
    hidden_ = mem.allocate(rows * hb_, MemCategory::Workspace, "serve.hidden");
    mlogits_ = mem.allocate_n<float>(rows * static_cast<size_t>(V), MemCategory::Workspace, "serve.mtp_logits");
    mhidden_ = mem.allocate(rows * hb_, MemCategory::Workspace, "serve.mtp_hidden");
    mh_in_ = mem.allocate(rows * hb_, MemCategory::Workspace, "serve.mtp_hidden_in");
    phid_ = mem.allocate(static_cast<size_t>(PrefixCache::kChunk + 1) * hb_, MemCategory::Workspace,
                         "serve.prompt_hidden");
    pending_ = mem.allocate(P * hb_, MemCategory::Workspace, "serve.mtp_pending");
    dlogits_ = mem.allocate_n<float>(P * static_cast<size_t>(V), MemCategory::Workspace, "serve.draft_logits");
    dhidden_ = mem.allocate(P * hb_, MemCategory::Workspace, "serve.draft_hidden");
  }
  scratch_.reserve(static_cast<size_t>(2 * V));
  for (int64_t s = opt.parallel - 1; s >= 0; --s) free_slots_.push_back(static_cast<int32_t>(s));
  if (opt_.threads <= 0) opt_.threads = omp_get_max_threads();
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    for (auto& j : queue_) j->cancel = true;
  }
  cv_.notify_all();
  thread_.join();
}

Engine::Admit Engine::submit(std::shared_ptr<Job> job) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (draining_ || stop_) return Admit::Draining;
    if (running_ + static_cast<int64_t>(queue_.size()) >= opt_.parallel + opt_.queue) return Admit::Full;
    queue_.push_back(std::move(job));
    metrics_.queued = static_cast<int64_t>(queue_.size());
  }
  cv_.notify_all();
  return Admit::Ok;
}

void Engine::drain() {
  std::unique_lock<std::mutex> lk(mu_);
  draining_ = true;
  idle_cv_.wait(lk, [&] { return running_ == 0 && queue_.empty(); });
}

void Engine::loop() {
  omp_set_num_threads(opt_.threads);
  std::vector<Active> active;
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    while (!queue_.empty() && !free_slots_.empty()) {
      Active a;
      a.job = std::move(queue_.front());
      queue_.pop_front();
      a.slot = free_slots_.back();
      free_slots_.pop_back();
      a.rng.seed(a.job->sampling.seed);
      active.push_back(std::move(a));
      ++running_;
    }
    metrics_.queued = static_cast<int64_t>(queue_.size());
    metrics_.busy_slots = running_;
    if (active.empty()) {
      idle_cv_.notify_all();
      if (stop_) break;
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      continue;
    }
    lk.unlock();
    try {
      pass(active);
    } catch (const std::exception& e) {  // (an exception leaving this thread would end the process)
      for (Active& a : active) finish(a, "error", e.what());
    }
    lk.lock();
    // Ended requests give their slots back.
    for (auto it = active.begin(); it != active.end();) {
      bool done;
      {
        std::lock_guard<std::mutex> jl(it->job->mu);
        done = it->job->finished;
      }
      if (done) {
        free_slots_.push_back(it->slot);
        --running_;
        it = active.erase(it);
      } else {
        ++it;
      }
    }
    if (stop_)
      for (Active& a : active) a.job->cancel = true;
  }
}

void Engine::finish(Active& a, const std::string& reason, const std::string& error) {
  {
    std::lock_guard<std::mutex> lk(a.job->mu);
    if (a.job->finished) return;
    a.job->finished = true;
    a.job->finish_reason = reason;
    a.job->error = error;
  }
  a.job->cv.notify_all();
}

bool Engine::emit(Active& a, const float* logits) {
  return push(a, infer::sample_token(logits, dec_.config().vocab, a.job->sampling, a.rng, scratch_), logits);
}

bool Engine::push(Active& a, int32_t token, const float* logits) {
  Job& j = *a.job;
  const int64_t V = dec_.config().vocab;
  TokenOut t;
  t.id = token;
  if (j.top_logprobs >= 0) {
    // Log-probabilities of the model's own distribution (before temperature and truncation), as OpenAI reports them.
    float mx = logits[0];
    for (int64_t i = 1; i < V; ++i) mx = std::max(mx, logits[i]);
    double sum = 0;
    for (int64_t i = 0; i < V; ++i) sum += std::exp(double(logits[i]) - mx);
    const double lse = mx + std::log(sum);
    t.logprob = static_cast<float>(logits[t.id] - lse);
    if (j.top_logprobs > 0) {
      std::vector<std::pair<float, int32_t>> all(static_cast<size_t>(V));
      for (int64_t i = 0; i < V; ++i) all[static_cast<size_t>(i)] = {logits[i], static_cast<int32_t>(i)};
      const int64_t k = std::min(j.top_logprobs, V);
      std::partial_sort(all.begin(), all.begin() + k, all.end(), [](const auto& x, const auto& y) {
        return x.first > y.first || (x.first == y.first && x.second < y.second);
      });
      for (int64_t i = 0; i < k; ++i) {
        const auto& [logit, id] = all[static_cast<size_t>(i)];
        t.top.emplace_back(id, static_cast<float>(logit - lse));
      }
    }
  }
  a.last = t.id;
  ++a.generated;
  {
    std::lock_guard<std::mutex> lk(j.mu);
    j.tokens.push_back(std::move(t));
  }
  j.cv.notify_all();
  if (std::find(j.stop_ids.begin(), j.stop_ids.end(), a.last) != j.stop_ids.end()) {
    finish(a, "stop");
    return false;
  }
  if (a.generated >= j.max_tokens) {
    finish(a, "length");
    return false;
  }
  return true;
}

void Engine::pass(std::vector<Active>& active) {
  const int64_t V = dec_.config().vocab, C = PrefixCache::kChunk;
  // 1. Requests ended outside the scheduler.
  for (Active& a : active)
    if (a.job->cancel.load()) finish(a, "cancelled");
  // 2-3. Prompts: restore the cached prefix, then prefill up to prefill_chunk tokens, chunk by chunk.
  int64_t budget = opt_.prefill_chunk;
  for (Active& a : active) {
    Job& j = *a.job;
    const int64_t n = static_cast<int64_t>(j.prompt.size());
    bool done;
    {
      std::lock_guard<std::mutex> lk(j.mu);
      done = j.finished;
    }
    if (done || a.pos >= n || budget <= 0) continue;
    try {
      if (!a.started) {
        a.started = true;
        dec_.reset(a.slot);
        // A hit must leave at least one prompt token to prefill: its logits choose the first new token.
        const int64_t cached =
            cache_ ? cache_->restore(dec_, a.slot, j.prompt, n - 1, mtp_ ? slot_row(pending_, a.slot) : nullptr) : 0;
        a.pos = cached;
        {
          std::lock_guard<std::mutex> lk(j.mu);
          j.cached_tokens = cached;
        }
        metrics_.cached_tokens += cached;
        ++(cached > 0 ? metrics_.cache_hits : metrics_.cache_misses);
      }
      const auto t0 = std::chrono::steady_clock::now();
      float* row = ptr<float>(logits_);
      while (a.pos < n && budget > 0) {
        const int64_t m = std::min(C - a.pos % C, n - a.pos);
        dec_.prefill(a.slot, std::span<const int32_t>(j.prompt).subspan(static_cast<size_t>(a.pos),
                                                                        static_cast<size_t>(m)),
                     a.pos + m == n ? row : nullptr, false, mtp_ ? slot_row(phid_, 1) : nullptr);
        if (mtp_) mtp_prefill(a, a.pos, m);
        a.pos += m;
        budget -= m;
        metrics_.prefill_tokens += m;
        if (cache_ && a.pos % C == 0)
          cache_->insert(dec_, a.slot, std::span<const int32_t>(j.prompt).first(static_cast<size_t>(a.pos)),
                         mtp_ ? slot_row(pending_, a.slot) : nullptr);
      }
      metrics_.prefill_ns += since_ns(t0);
      if (a.pos == n && emit(a, row) && mtp_) {
        // The MTP layer's last prompt position reads the first new token; its logits and output give the first draft.
        mtp_->prefill(a.slot, n - 1, slot_row(pending_, a.slot), &a.last, 1,
                      ptr<float>(dlogits_) + a.slot * V, slot_row(dhidden_, a.slot), true);
      }
    } catch (const std::exception& e) {
      finish(a, "error", e.what());
    }
  }
  // 4. One decode step for every request past its prompt (a first token just chosen included).
  std::vector<Active*> rows;
  std::vector<int32_t> slots, ids;
  for (Active& a : active) {
    bool done;
    {
      std::lock_guard<std::mutex> lk(a.job->mu);
      done = a.job->finished;
    }
    if (done || a.pos < static_cast<int64_t>(a.job->prompt.size()) || a.generated == 0) continue;
    rows.push_back(&a);
    slots.push_back(a.slot);
    ids.push_back(a.last);
  }
  if (rows.empty()) {
    last_step_.reset();
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (last_step_) {
    const int64_t gap = std::chrono::duration_cast<std::chrono::nanoseconds>(t0 - *last_step_).count();
    if (gap > metrics_.decode_gap_max_ns.load()) metrics_.decode_gap_max_ns = gap;
  }
  last_step_ = t0;
  if (mtp_) {
    try {
      speculative_step(rows);
    } catch (const std::exception& e) {
      for (Active* a : rows) finish(*a, "error", e.what());
      return;
    }
    metrics_.decode_ns += since_ns(t0);
    ++metrics_.steps;
    return;
  }
  try {
    dec_.step(slots, ids, ptr<float>(logits_));
  } catch (const std::exception& e) {
    for (Active* a : rows) finish(*a, "error", e.what());
    return;
  }
  metrics_.decode_ns += since_ns(t0);
  metrics_.decode_tokens += static_cast<int64_t>(rows.size());
  ++metrics_.steps;
  for (size_t r = 0; r < rows.size(); ++r) emit(*rows[r], ptr<float>(logits_) + static_cast<int64_t>(r) * V);
}

// The MTP layer runs one position behind the decoder: its position t reads h_t and the token t + 1, which for the
// piece's last position is the next piece's first token (or the first new one). So after the decoder's piece
// [from, from + m), it runs [from - 1, from + m - 1) on the row left waiting by the piece before (pending_, or the
// prefix cache's) and the piece's rows; the piece's last row waits in turn. The pieces are the same whether a prefix
// was restored or prefilled (they end on the same 64-token edges), so a cache hit changes no bit of the drafts either.
void Engine::mtp_prefill(Active& a, int64_t from, int64_t m) {
  const int32_t* next = a.job->prompt.data() + from;  // the token after position from - 1
  char* rows = slot_row(phid_, 0);                     // row 0: h_{from-1}, rows 1..m: h_from .. h_{from+m-1}
  if (from > 0) {
    std::memcpy(rows, slot_row(pending_, a.slot), hb_);
    mtp_->prefill(a.slot, from - 1, rows, next, m, nullptr, nullptr, false);
  } else if (m > 1) {
    mtp_->prefill(a.slot, 0, rows + hb_, next + 1, m - 1, nullptr, nullptr, false);
  }
  std::memcpy(slot_row(pending_, a.slot), rows + static_cast<size_t>(m) * hb_, hb_);
}

// Draft k of a request from MTP logits: greedy, the argmax; sampled, a draw from the distribution q the rejection rule
// needs, with the request's own generator (so a seeded request is reproducible).
int32_t Engine::choose_draft(Active& a, int64_t k, const float* mtp_logits) {
  const infer::Sampling& s = a.job->sampling;
  const int64_t V = dec_.config().vocab;
  if (s.temperature <= 0) return infer::sample_token(mtp_logits, V, s, a.rng, scratch_);
  a.q.resize(static_cast<size_t>(opt_.draft));
  infer::sampling_probs(mtp_logits, V, s, a.q[static_cast<size_t>(k)]);
  return infer::draw(a.q[static_cast<size_t>(k)], a.rng);
}

// generate_speculative's step (infer/speculative.cpp) over the decoding requests: drafts, one verification of
// [last token, drafts] for all of them, acceptance per request, the tokens through push()'s stop checks in order, the
// roll-back, then the MTP layer's catch-up on the kept positions of the requests that go on.
void Engine::speculative_step(const std::vector<Active*>& rows) {
  const int64_t V = dec_.config().vocab, N = opt_.draft, A = static_cast<int64_t>(rows.size());
  std::vector<int32_t> mslots, mpos, mnext, ids, slots, emitted;
  char* mhin = slot_row(mh_in_, 0);
  char* mhid = slot_row(mhidden_, 0);
  char* hid = slot_row(hidden_, 0);
  for (Active* a : rows) {
    a->drafts.resize(static_cast<size_t>(N));
    a->drafts[0] = choose_draft(*a, 0, ptr<float>(dlogits_) + a->slot * V);
  }
  // Drafts 2..N: the MTP layer on its own output and the draft before.
  for (int64_t k = 1; k < N; ++k) {
    mslots.clear();
    mpos.clear();
    mnext.clear();
    for (int64_t r = 0; r < A; ++r) {
      Active& a = *rows[static_cast<size_t>(r)];
      mslots.push_back(a.slot);
      mpos.push_back(static_cast<int32_t>(dec_.length(a.slot) + k - 1));
      mnext.push_back(a.drafts[static_cast<size_t>(k - 1)]);
      std::memcpy(mhin + static_cast<size_t>(r) * hb_, k == 1 ? slot_row(dhidden_, a.slot) : mhid + r * hb_, hb_);
    }
    mtp_->step(A, mslots.data(), mpos.data(), mhin, mnext.data(), ptr<float>(mlogits_), mhid);
    for (int64_t r = 0; r < A; ++r)
      rows[static_cast<size_t>(r)]->drafts[static_cast<size_t>(k)] =
          choose_draft(*rows[static_cast<size_t>(r)], k, ptr<float>(mlogits_) + r * V);
  }
  for (Active* a : rows) {
    slots.push_back(a->slot);
    ids.push_back(a->last);
    ids.insert(ids.end(), a->drafts.begin(), a->drafts.end());
  }
  dec_.verify(slots, N + 1, ids, ptr<float>(logits_), hid);
  metrics_.spec_verifications += A;
  metrics_.spec_drafted += A * N;
  std::vector<std::vector<double>> p(static_cast<size_t>(N + 1));
  mslots.clear();
  mpos.clear();
  mnext.clear();
  std::vector<std::pair<Active*, size_t>> caught;  // a request going on and its last catch-up row
  for (int64_t r = 0; r < A; ++r) {
    Active& a = *rows[static_cast<size_t>(r)];
    const float* lrows = ptr<float>(logits_) + r * (N + 1) * V;
    const int64_t acc = infer::accept_drafts(lrows, V, a.drafts.data(), N, a.job->sampling, a.rng, a.q, p, scratch_,
                                             emitted);
    for (int64_t k = 0; k < acc; ++k) ++metrics_.spec_accepted[static_cast<size_t>(k)];
    const int64_t L = dec_.length(a.slot);
    dec_.accept(a.slot, acc + 1);
    // In order, each through the stop checks (stop ids, max_tokens); a client gone or a stop string met (cancel)
    // ends it too. Tokens past the end are dropped.
    bool go_on = true;
    for (size_t e = 0; e < emitted.size() && go_on; ++e) {
      if (a.job->cancel.load()) {
        finish(a, "cancelled");
        go_on = false;
        break;
      }
      ++metrics_.decode_tokens;
      go_on = push(a, emitted[e], lrows + static_cast<int64_t>(e) * V);
    }
    if (!go_on) continue;
    for (int64_t j = 0; j <= acc; ++j) {  // MTP positions L..L+acc: (h_t, x_{t+1})
      mslots.push_back(a.slot);
      mpos.push_back(static_cast<int32_t>(L + j));
      mnext.push_back(emitted[static_cast<size_t>(j)]);
      std::memcpy(mhin + (mslots.size() - 1) * hb_, hid + static_cast<size_t>(r * (N + 1) + j) * hb_, hb_);
    }
    caught.emplace_back(&a, mslots.size() - 1);
  }
  if (mslots.empty()) return;
  mtp_->step(static_cast<int64_t>(mslots.size()), mslots.data(), mpos.data(), mhin, mnext.data(), ptr<float>(mlogits_),
             mhid);
  for (const auto& [a, row] : caught) {  // the next draft's source, kept per slot (a prefill may write others' rows)
    std::memcpy(ptr<float>(dlogits_) + a->slot * V, ptr<float>(mlogits_) + static_cast<int64_t>(row) * V,
                static_cast<size_t>(V) * sizeof(float));
    std::memcpy(slot_row(dhidden_, a->slot), mhid + row * hb_, hb_);
  }
}

}  // namespace hs::serve
