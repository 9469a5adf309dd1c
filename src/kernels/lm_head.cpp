#include "kernels/lm_head.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/profile.h"
#include "kernels/matmul.h"
#include "kernels/vec_math.h"

namespace hs::kernels {

int64_t default_xent_chunk(int64_t vocab) {
  constexpr int64_t kChunkLogitBytes = int64_t{64} << 20;
  return std::max<int64_t>(1, kChunkLogitBytes / (4 * std::max<int64_t>(vocab, 1)));
}

template <typename T>
XentResult lm_head_xent(const T* x, const T* W, const int32_t* targets, int64_t tokens, int64_t hidden, int64_t vocab,
                        float grad_scale, float* dx, float* dW, MemoryAccountant& mem, int64_t chunk) {
  profile::Scope profile_scope(profile::Phase::LossHead, "lm_head_xent");
  constexpr bool kF32 = std::is_same_v<T, float>;
  const bool backward = dx != nullptr;
  const int64_t c = std::max<int64_t>(1, std::min(tokens, chunk > 0 ? chunk : default_xent_chunk(vocab)));
  const auto cv = static_cast<size_t>(c * vocab);
  Buffer logits = mem.allocate_n<float>(cv, MemCategory::Workspace, "xent.logits");
  // For fp32 the logits' gradient overwrites the logits; bf16 needs its own copy for the matmuls.
  Buffer dlogits_cast;
  if (backward && !kF32) dlogits_cast = mem.allocate_n<T>(cv, MemCategory::Workspace, "xent.dlogits");
  Buffer row_loss = mem.allocate_n<float>(static_cast<size_t>(c), MemCategory::Workspace, "xent.row_loss");
  if (mem.planning()) return {};

  for (int64_t i = 0; i < tokens; ++i)
    if (targets[i] >= vocab)
      throw std::out_of_range("lm_head_xent: target " + std::to_string(targets[i]) + " >= vocab " +
                              std::to_string(vocab));
  XentResult res;
  float* L = logits.as<float>();
  float* loss = row_loss.as<float>();
  T* G = kF32 ? reinterpret_cast<T*>(L) : dlogits_cast.as<T>();
  for (int64_t start = 0; start < tokens; start += c) {
    const int64_t m = std::min(c, tokens - start);
    matmul(x + start * hidden, W, L, m, vocab, hidden, false, true);
#pragma omp parallel for schedule(static) if (m * vocab > (int64_t{1} << 14))
    for (int64_t r = 0; r < m; ++r) {
      float* l = L + r * vocab;
      T* g = G + r * vocab;
      const int32_t tgt = targets[start + r];
      if (tgt < 0) {
        loss[r] = 0.0f;
        if (backward) std::fill_n(g, vocab, T{});
        continue;
      }
      float mx = l[0];
#pragma omp simd reduction(max : mx)
      for (int64_t v = 0; v < vocab; ++v) mx = std::max(mx, l[v]);
      const float lt = l[tgt];
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t v = 0; v < vocab; ++v) {
        const float e = exp_vec(l[v] - mx);
        l[v] = e;
        s += e;
      }
      loss[r] = static_cast<float>(static_cast<double>(mx) + std::log(static_cast<double>(s)) - lt);
      if (!backward) continue;
      // d(grad_scale * loss) / d logit = grad_scale * (softmax - onehot(target))
      const float scale = grad_scale / s;
      const float at_target = scale * l[tgt] - grad_scale;
#pragma omp simd
      for (int64_t v = 0; v < vocab; ++v) g[v] = from_f32<T>(scale * l[v]);
      g[tgt] = from_f32<T>(at_target);
    }
    for (int64_t r = 0; r < m; ++r) {
      if (targets[start + r] < 0) continue;
      res.loss_sum += loss[r];
      ++res.count;
    }
    if (!backward) continue;
    matmul(G, W, dx + start * hidden, m, hidden, vocab, false, false, true);         // dx += G W
    if (dW) matmul(G, x + start * hidden, dW, vocab, hidden, m, true, false, true);  // dW += G^T x
  }
  return res;
}

template XentResult lm_head_xent<float>(const float*, const float*, const int32_t*, int64_t, int64_t, int64_t, float,
                                        float*, float*, MemoryAccountant&, int64_t);
template XentResult lm_head_xent<bf16>(const bf16*, const bf16*, const int32_t*, int64_t, int64_t, int64_t, float,
                                       float*, float*, MemoryAccountant&, int64_t);

}  // namespace hs::kernels
