#include "infer/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "infer/decoder.h"

namespace hs::infer {

int32_t sample_token(const float* logits, int64_t vocab, const Sampling& s, std::mt19937_64& rng,
                     std::vector<std::pair<float, int32_t>>& scratch) {
  if (s.temperature <= 0) {
    int64_t best = 0;
    for (int64_t i = 1; i < vocab; ++i)
      if (logits[i] > logits[best]) best = i;
    return static_cast<int32_t>(best);
  }
  scratch.resize(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) scratch[static_cast<size_t>(i)] = {logits[i], static_cast<int32_t>(i)};
  // Most likely first, the lower id first on a tie, so the candidate set does not depend on the sort.
  auto more_likely = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const int64_t k = s.top_k > 0 ? std::min(s.top_k, vocab) : vocab;
  std::partial_sort(scratch.begin(), scratch.begin() + k, scratch.end(), more_likely);
  // The candidates' weights exp((l - max) / T) replace their logits; sums in double.
  const double mx = scratch[0].first, inv_t = 1.0 / s.temperature;
  double total = 0;
  for (int64_t i = 0; i < k; ++i) {
    auto& c = scratch[static_cast<size_t>(i)];
    c.first = static_cast<float>(std::exp((c.first - mx) * inv_t));
    total += c.first;
  }
  // top_p: the shortest prefix (most likely first) whose probability reaches top_p; at least one id.
  int64_t n = k;
  if (s.top_p < 1) {
    double acc = 0;
    for (n = 0; n < k;) {
      acc += scratch[static_cast<size_t>(n++)].first;
      if (acc >= s.top_p * total) break;
    }
    total = acc;
  }
  const double u = std::uniform_real_distribution<double>(0, total)(rng);
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    acc += scratch[static_cast<size_t>(i)].first;
    if (u < acc) return scratch[static_cast<size_t>(i)].second;
  }
  return scratch[static_cast<size_t>(n - 1)].second;
}

GenerateResult generate(const model::ParamSet& params, const std::vector<std::vector<int32_t>>& prompts,
                        const GenerateOptions& opt, MemoryAccountant& mem,
                        const std::function<bool(size_t, int32_t)>& on_token) {
  using Clock = std::chrono::steady_clock;
  if (opt.max_new_tokens <= 0)
    throw std::invalid_argument("max_new_tokens must be positive (got " + std::to_string(opt.max_new_tokens) + ")");
  if (prompts.empty()) throw std::invalid_argument("no prompts");
  int64_t longest = 0;
  for (const auto& p : prompts) {
    if (p.empty()) throw std::invalid_argument("an empty prompt (give at least one token)");
    longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  }
  const int64_t B = static_cast<int64_t>(prompts.size()), V = params.config().vocab;
  // A finished sequence's last token is never fed back, so max_new_tokens - 1 positions follow the prompt.
  mem.reset_peak();
  Decoder dec(params, opt.compute, B, longest + opt.max_new_tokens - 1, mem, opt.piece);
  GenerateResult r;
  r.kv_cache_bytes = dec.kv_cache_bytes();
  r.recurrent_state_bytes = dec.recurrent_state_bytes();
  r.tokens.resize(static_cast<size_t>(B));
  Buffer logits = mem.allocate_n<float>(static_cast<size_t>(B * V), MemCategory::Workspace, "generate.logits");
  std::vector<std::mt19937_64> rngs;
  for (int64_t i = 0; i < B; ++i) rngs.emplace_back(opt.sampling.seed + static_cast<uint64_t>(i));
  std::vector<std::pair<float, int32_t>> scratch;
  scratch.reserve(static_cast<size_t>(V));
  std::vector<int32_t> active, next;
  active.reserve(static_cast<size_t>(B));
  next.reserve(static_cast<size_t>(B));

  // Takes the new token of sequence i from its logits; true while the sequence goes on.
  auto take = [&](int64_t i, const float* row) {
    const int32_t id = sample_token(row, V, opt.sampling, rngs[static_cast<size_t>(i)], scratch);
    auto& out = r.tokens[static_cast<size_t>(i)];
    out.push_back(id);
    const bool go_on = on_token ? on_token(static_cast<size_t>(i), id) : true;
    return go_on && static_cast<int64_t>(out.size()) < opt.max_new_tokens &&
           std::find(opt.stop_ids.begin(), opt.stop_ids.end(), id) == opt.stop_ids.end();
  };

  const auto t0 = Clock::now();
  for (int64_t i = 0; i < B; ++i) {
    const auto& p = prompts[static_cast<size_t>(i)];
    dec.prefill(i, p, ptr<float>(logits));
    r.prefill_tokens += static_cast<int64_t>(p.size());
    if (take(i, ptr<float>(logits))) active.push_back(static_cast<int32_t>(i));
  }
  const auto t1 = Clock::now();
  while (!active.empty()) {
    next.clear();
    for (int32_t i : active) next.push_back(r.tokens[static_cast<size_t>(i)].back());
    dec.step(active, next, ptr<float>(logits));
    r.decode_tokens += static_cast<int64_t>(active.size());
    size_t kept = 0;
    for (size_t j = 0; j < active.size(); ++j)
      if (take(active[j], ptr<float>(logits) + static_cast<int64_t>(j) * V)) active[kept++] = active[j];
    active.resize(kept);
  }
  const auto t2 = Clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  r.decode_seconds = std::chrono::duration<double>(t2 - t1).count();
  r.peak_bytes = mem.peak_total();
  return r;
}

}  // namespace hs::infer
