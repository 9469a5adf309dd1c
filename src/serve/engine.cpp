#include "serve/engine.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>

namespace hs::serve {

namespace {
int64_t since_ns(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

// The decoder prefills in pieces of PrefixCache::kChunk: a prompt restored at a chunk edge then runs the same pieces
// (the same kernels on the same rows) as one prefilled from the start, so a cache hit changes no bit.
Engine::Engine(const model::ParamSet& params, DType compute, const EngineOptions& opt, MemoryAccountant& mem,
               const infer::QuantWeights* quant)
    : opt_(opt), mem_(mem), dec_(params, compute, opt.parallel, opt.context, mem, PrefixCache::kChunk, quant) {
  if (opt.prefill_chunk <= 0 || opt.prefill_chunk % PrefixCache::kChunk != 0)
    throw std::invalid_argument("the prefill chunk (" + std::to_string(opt.prefill_chunk) +
                                ") must be a positive multiple of " + std::to_string(PrefixCache::kChunk));
  if (opt.queue < 0) throw std::invalid_argument("the queue length must be >= 0");
  if (opt.cache_bytes > 0) cache_ = std::make_unique<PrefixCache>(opt.cache_bytes, mem);
  const int64_t V = params.config().vocab;
  logits_ = mem.allocate_n<float>(static_cast<size_t>(opt.parallel * V), MemCategory::Workspace, "serve.logits");
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
  Job& j = *a.job;
  const int64_t V = dec_.config().vocab;
  TokenOut t;
  t.id = infer::sample_token(logits, V, j.sampling, a.rng, scratch_);
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
        const int64_t cached = cache_ ? cache_->restore(dec_, a.slot, j.prompt, n - 1) : 0;
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
                     a.pos + m == n ? row : nullptr);
        a.pos += m;
        budget -= m;
        metrics_.prefill_tokens += m;
        if (cache_ && a.pos % C == 0)
          cache_->insert(dec_, a.slot, std::span<const int32_t>(j.prompt).first(static_cast<size_t>(a.pos)));
      }
      metrics_.prefill_ns += since_ns(t0);
      if (a.pos == n) emit(a, row);
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

}  // namespace hs::serve
