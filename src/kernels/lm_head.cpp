#include "kernels/lm_head.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/compute.h"
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
                        float grad_scale, float* dx, float* dW, MemoryAccountant& mem, int64_t chunk,
                        bool plan_backward) {
  profile::Scope profile_scope(profile::Phase::LossHead, "lm_head_xent");
  constexpr bool kF32 = std::is_same_v<T, float>;
  const bool backward = dx != nullptr || plan_backward;
  const int64_t c = std::max<int64_t>(1, std::min(tokens, chunk > 0 ? chunk : default_xent_chunk(vocab)));
  const auto cv = static_cast<size_t>(c * vocab);
  Buffer logits = mem.allocate_n<float>(cv, MemCategory::Workspace, "xent.logits");
  // For fp32 the logits' gradient overwrites the logits; bf16 needs its own copy for the matmuls.
  Buffer dlogits_cast;
  if (backward && !kF32) dlogits_cast = mem.allocate_n<T>(cv, MemCategory::Workspace, "xent.dlogits");
  Buffer row_loss = mem.allocate_n<float>(static_cast<size_t>(c), MemCategory::Workspace, "xent.row_loss");
  return compute(mem, [&] {
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
  });
}

template <typename T>
XentResult lm_head_xent_pieced(const T* x, const int32_t* targets, int64_t tokens, int64_t hidden, int64_t vocab,
                               int64_t rows, XentPieces<T>& pieces, float grad_scale, float* dx, MemoryAccountant& mem,
                               int64_t chunk, bool plan_backward) {
  profile::Scope profile_scope(profile::Phase::LossHead, "lm_head_xent_pieced");
  constexpr bool kF32 = std::is_same_v<T, float>;
  if (rows < 1) throw std::invalid_argument("lm_head_xent_pieced: a piece needs at least one row");
  const bool backward = dx != nullptr || plan_backward;
  rows = std::min(rows, vocab);
  const int64_t npieces = (vocab + rows - 1) / rows;
  const int64_t c = std::max<int64_t>(1, std::min(tokens, chunk > 0 ? chunk : default_xent_chunk(rows)));
  const auto cv = static_cast<size_t>(c * rows);
  compute(mem, [&] {
    for (int64_t i = 0; i < tokens; ++i)
      if (targets[i] >= vocab)
        throw std::out_of_range("lm_head_xent: target " + std::to_string(targets[i]) + " >= vocab " +
                                std::to_string(vocab));
  });
  const auto n = static_cast<size_t>(tokens);
  Buffer run_max = mem.allocate_n<float>(n, MemCategory::Workspace, "xent.max");
  Buffer run_sum = mem.allocate_n<float>(n, MemCategory::Workspace, "xent.sum");
  Buffer target_logit = mem.allocate_n<float>(n, MemCategory::Workspace, "xent.target_logit");
  Buffer logits = mem.allocate_n<float>(cv, MemCategory::Workspace, "xent.logits");
  Buffer dlogits_cast;
  if (backward && !kF32) dlogits_cast = mem.allocate_n<T>(cv, MemCategory::Workspace, "xent.dlogits");
  float* M = run_max.as<float>();
  float* S = run_sum.as<float>();
  float* LT = target_logit.as<float>();
  float* L = logits.as<float>();
  T* G = kF32 ? reinterpret_cast<T*>(L) : dlogits_cast.as<T>();

  for (int64_t k = 0; k < npieces; ++k) {
    const int64_t a = k * rows, rk = std::min(rows, vocab - a);
    const T* W = pieces.weights(k);
    compute(mem, [&] {
      for (int64_t start = 0; start < tokens; start += c) {
        const int64_t m = std::min(c, tokens - start);
        matmul(x + start * hidden, W, L, m, rk, hidden, false, true);
#pragma omp parallel for schedule(static) if (m * rk > (int64_t{1} << 14))
        for (int64_t r = 0; r < m; ++r) {
          const int64_t t = start + r;
          const int32_t tgt = targets[t];
          if (tgt < 0) continue;
          float* l = L + r * rk;
          float mx = l[0];
#pragma omp simd reduction(max : mx)
          for (int64_t v = 0; v < rk; ++v) mx = std::max(mx, l[v]);
          if (tgt >= a && tgt < a + rk) LT[t] = l[tgt - a];
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t v = 0; v < rk; ++v) sum += exp_vec(l[v] - mx);
          if (k == 0) {
            M[t] = mx;
            S[t] = sum;
          } else {
            const float nm = std::max(M[t], mx);
            S[t] = S[t] * exp_vec(M[t] - nm) + sum * exp_vec(mx - nm);
            M[t] = nm;
          }
        }
      }
    });
  }
  XentResult res;
  compute(mem, [&] {
    for (int64_t t = 0; t < tokens; ++t) {
      if (targets[t] < 0) continue;
      res.loss_sum += static_cast<float>(static_cast<double>(M[t]) + std::log(static_cast<double>(S[t])) - LT[t]);
      ++res.count;
    }
  });
  if (!backward) return res;

  for (int64_t k = npieces; k-- > 0;) {
    const int64_t a = k * rows, rk = std::min(rows, vocab - a);
    const T* W = pieces.weights(k);
    float* dW = pieces.grad(k);
    compute(mem, [&] {
      for (int64_t start = 0; start < tokens; start += c) {
        const int64_t m = std::min(c, tokens - start);
        matmul(x + start * hidden, W, L, m, rk, hidden, false, true);
#pragma omp parallel for schedule(static) if (m * rk > (int64_t{1} << 14))
        for (int64_t r = 0; r < m; ++r) {
          const int64_t t = start + r;
          const int32_t tgt = targets[t];
          float* l = L + r * rk;
          T* g = G + r * rk;
          if (tgt < 0) {
            std::fill_n(g, rk, T{});
            continue;
          }
          // As lm_head_xent: scale * e^(l - M) with scale = grad_scale / S, less grad_scale at the target.
          const float mx = M[t], scale = grad_scale / S[t];
          const bool here = tgt >= a && tgt < a + rk;
          // Read before g overwrites l (fp32: in place).
          const float at_target = here ? scale * exp_vec(l[tgt - a] - mx) - grad_scale : 0.0f;
#pragma omp simd
          for (int64_t v = 0; v < rk; ++v) g[v] = from_f32<T>(scale * exp_vec(l[v] - mx));
          if (here) g[tgt - a] = from_f32<T>(at_target);
        }
        matmul(G, W, dx + start * hidden, m, hidden, rk, false, false, true);         // dx += G W_k
        if (dW) matmul(G, x + start * hidden, dW, rk, hidden, m, true, false, true);  // dW_k += G^T x
      }
    });
    pieces.grad_done(k);
  }
  return res;
}

template XentResult lm_head_xent_pieced<float>(const float*, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                                               XentPieces<float>&, float, float*, MemoryAccountant&, int64_t, bool);
template XentResult lm_head_xent_pieced<bf16>(const bf16*, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                                              XentPieces<bf16>&, float, float*, MemoryAccountant&, int64_t, bool);

template XentResult lm_head_xent<float>(const float*, const float*, const int32_t*, int64_t, int64_t, int64_t, float,
                                        float*, float*, MemoryAccountant&, int64_t, bool);
template XentResult lm_head_xent<bf16>(const bf16*, const bf16*, const int32_t*, int64_t, int64_t, int64_t, float,
                                       float*, float*, MemoryAccountant&, int64_t, bool);

}  // namespace hs::kernels
