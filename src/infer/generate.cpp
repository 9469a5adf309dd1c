#include "infer/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "infer/decoder.h"

namespace hs::infer {

namespace {
// Sorts c[0, n) (ids ascending on entry) most likely first, the lower id first on a tie, as std::sort with the
// sampler's order would: a stable least-significant-digit radix sort (3 passes of 11 bits) on the logit's bits mapped
// to an unsigned key that ascends as the logit descends (+0 and -0 one key), using tmp[0, n).
void radix_sort_most_likely_first(std::pair<float, int32_t>* c, std::pair<float, int32_t>* tmp, int64_t n) {
  auto key = [](float f) {
    uint32_t u;
    if (f == 0.0f) f = 0.0f;
    std::memcpy(&u, &f, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascends with f
    return ~u;                                         // ascends as f descends
  };
  std::pair<float, int32_t>* src = c;
  std::pair<float, int32_t>* dst = tmp;
  for (int shift = 0; shift < 32; shift += 11) {
    uint32_t count[2049] = {};
    for (int64_t i = 0; i < n; ++i) ++count[((key(src[i].first) >> shift) & 2047u) + 1];
    for (int b = 0; b < 2048; ++b) count[b + 1] += count[b];
    for (int64_t i = 0; i < n; ++i) dst[count[(key(src[i].first) >> shift) & 2047u]++] = src[i];
    std::swap(src, dst);
  }
  if (src != c) std::copy_n(src, n, c);  // 3 passes: the result is in tmp
}
}  // namespace

// Sampling without sorting the vocabulary. The distribution is the most likely ids first (the lower id first on a
// tie), each weighted w = exp((l - max) / T) in fp32, summed in double in that order; the sampler draws one uniform u
// in [0, total) and returns the first id whose running sum passes u. Ids of weight w < 2^-53 change nothing there:
// the running sum starts at the most likely id's w = exp(0) = 1, so adding less than half its ulp leaves it as it is.
// So only the ids with (l - max) / T >= ln 2^-54 (which bounds w below 2^-53 for the rest, with room for exp's
// rounding) and, with top_k, only the top_k of those are put in order (a heap, std::partial_sort); when many ids
// weigh (a flat distribution, a high temperature) they are ordered by a radix sort, not a comparison sort. The ids, the sums and the draw are those of a full sort, bit for bit
// (Generate.SamplerEqualsTheFullSortSampler checks against one).
int32_t sample_token(const float* logits, int64_t vocab, const Sampling& s, std::mt19937_64& rng,
                     std::vector<std::pair<float, int32_t>>& scratch) {
  if (s.temperature <= 0) {
    int64_t best = 0;
    for (int64_t i = 1; i < vocab; ++i)
      if (logits[i] > logits[best]) best = i;
    return static_cast<int32_t>(best);
  }
  // Most likely first, the lower id first on a tie.
  auto more_likely = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const int64_t K = s.top_k > 0 ? std::min(s.top_k, vocab) : vocab;
  // Logits that are not finite (a diverged model): NaN ids never weigh; when the largest logit is +inf or every one
  // is -inf (or NaN) there is no distribution to draw from, and the most likely id (the lowest holding the largest
  // logit, id 0 when all are NaN) is the answer.
  int64_t best = -1;
  for (int64_t i = 0; i < vocab; ++i)
    if (!std::isnan(logits[i]) && (best < 0 || logits[i] > logits[best])) best = i;
  if (best < 0) return 0;
  const float top = logits[best];
  if (!std::isfinite(top)) return static_cast<int32_t>(best);
  const double mx = top, inv_t = 1.0 / s.temperature;
  const double floor = std::log(0x1p-54);
  scratch.resize(static_cast<size_t>(2 * vocab));  // the upper half: the radix sort's buffer
  int64_t m = 0;  // candidates: every id that can weigh (and any others above the bound), in id order
  for (int64_t i = 0; i < vocab; ++i)
    if ((logits[i] - mx) * inv_t >= floor) scratch[static_cast<size_t>(m++)] = {logits[i], static_cast<int32_t>(i)};
  if (K < m) {  // a heap of the K most likely (few updates once it holds them), then in order
    std::partial_sort(scratch.begin(), scratch.begin() + K, scratch.begin() + m, more_likely);
    m = K;
  } else if (m > 2048) {
    radix_sort_most_likely_first(scratch.data(), scratch.data() + vocab, m);
  } else {
    std::sort(scratch.begin(), scratch.begin() + m, more_likely);
  }
  // The candidates' weights replace their logits; sums in double.
  double total = 0;
  for (int64_t i = 0; i < m; ++i) {
    auto& c = scratch[static_cast<size_t>(i)];
    c.first = static_cast<float>(std::exp((c.first - mx) * inv_t));
    total += c.first;
  }
  // top_p: the shortest prefix whose probability reaches top_p; at least one id, never past the candidates (their
  // sum is already the total).
  int64_t n = K;
  if (s.top_p < 1) {
    double acc = 0;
    for (n = 0; n < m;) {
      acc += scratch[static_cast<size_t>(n++)].first;
      if (acc >= s.top_p * total) break;
    }
    total = acc;
  }
  const double u = std::uniform_real_distribution<double>(0, total)(rng);
  double acc = 0;
  for (int64_t i = 0; i < std::min(n, m); ++i) {
    acc += scratch[static_cast<size_t>(i)].first;
    if (u < acc) return scratch[static_cast<size_t>(i)].second;
  }
  // u reached the total (the distribution may round up to its bound): the last id of the n in order.
  if (n <= m) return scratch[static_cast<size_t>(n - 1)].second;
  int64_t e = 0;  // the (n - m)-th most likely of the ids below the bound
  for (int64_t i = 0; i < vocab; ++i)
    if (!((logits[i] - mx) * inv_t >= floor)) scratch[static_cast<size_t>(e++)] = {logits[i], static_cast<int32_t>(i)};
  std::nth_element(scratch.begin(), scratch.begin() + (n - m - 1), scratch.begin() + e, more_likely);
  return scratch[static_cast<size_t>(n - m - 1)].second;
}

int64_t longest_prompt(const std::vector<std::vector<int32_t>>& prompts, int64_t max_new_tokens) {
  if (max_new_tokens <= 0)
    throw std::invalid_argument("max_new_tokens must be positive (got " + std::to_string(max_new_tokens) + ")");
  if (prompts.empty()) throw std::invalid_argument("no prompts");
  int64_t longest = 0;
  for (const auto& p : prompts) {
    if (p.empty()) throw std::invalid_argument("an empty prompt (give at least one token)");
    longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  }
  return longest;
}

GenerateResult generate(const model::ParamSet& params, const std::vector<std::vector<int32_t>>& prompts,
                        const GenerateOptions& opt, MemoryAccountant& mem,
                        const std::function<bool(size_t, int32_t)>& on_token) {
  using Clock = std::chrono::steady_clock;
  const int64_t longest = longest_prompt(prompts, opt.max_new_tokens);
  const int64_t B = static_cast<int64_t>(prompts.size()), V = params.config().vocab;
  // A finished sequence's last token is never fed back, so max_new_tokens - 1 positions follow the prompt.
  mem.reset_peak();
  Decoder dec(params, opt.compute, B, longest + opt.max_new_tokens - 1, mem, opt.piece, opt.quant);
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
