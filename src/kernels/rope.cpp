#include "kernels/rope.h"

#include <cmath>
#include <stdexcept>
#include <vector>

#include "core/profile.h"

namespace hs::kernels {
namespace {

void check_dims(int64_t head_dim, int64_t rotary_dim) {
  if (rotary_dim < 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
    throw std::invalid_argument("rope: rotary_dim must be even and in [0, head_dim]");
}

// inv_freq exactly as transformers computes it in fp32: 1 / theta**(float(2i) / rd) (glibc's powf
// and PyTorch's pow agree bit for bit on these inputs).
std::vector<float> inverse_frequencies(int64_t rotary_dim, float theta) {
  std::vector<float> inv(static_cast<size_t>(rotary_dim / 2));
  for (int64_t i = 0; i < rotary_dim / 2; ++i)
    inv[static_cast<size_t>(i)] =
        1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(rotary_dim));
  return inv;
}

// Rotates every head of every token of x0 [tokens, heads0, head_dim] and, when given, of x1 [tokens, heads1, head_dim]
// by sign * angle (sign -1 is the transpose): each token's cos/sin once for both.
template <typename T>
void rotate(T* x0, int64_t heads0, T* x1, int64_t heads1, const int32_t* positions, int64_t tokens, int64_t head_dim,
            int64_t rotary_dim, float theta, float sign) {
  check_dims(head_dim, rotary_dim);
  const int64_t half = rotary_dim / 2;
  if (half == 0) return;
  if (!x1) heads1 = 0;
  const std::vector<float> inv_freq = inverse_frequencies(rotary_dim, theta);
#pragma omp parallel if (tokens * (heads0 + heads1) * rotary_dim >= kParallelMinWork)
  {
    std::vector<float> cs(static_cast<size_t>(2 * half));  // cos then sin of this token's angles
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const float pos = static_cast<float>(positions[t]);
      for (int64_t i = 0; i < half; ++i) {
        const float angle = pos * inv_freq[static_cast<size_t>(i)];  // the fp32 product, as in PyTorch
        cs[static_cast<size_t>(i)] = std::cos(angle);
        cs[static_cast<size_t>(half + i)] = sign * std::sin(angle);
      }
      const float* c = cs.data();
      const float* s = cs.data() + half;
      auto heads_of = [&](T* x, int64_t heads) {
        for (int64_t h = 0; h < heads; ++h) {
          T* lo = x + (t * heads + h) * head_dim;
          T* hi = lo + half;
          for (int64_t i = 0; i < half; ++i) {
            const float a = to_f32(lo[i]), b = to_f32(hi[i]);
            lo[i] = from_f32<T>(a * c[i] - b * s[i]);
            hi[i] = from_f32<T>(b * c[i] + a * s[i]);
          }
        }
      };
      heads_of(x0, heads0);
      if (x1) heads_of(x1, heads1);
    }
  }
}

}  // namespace

template <typename T>
void rope_forward(T* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                  int64_t rotary_dim, float theta) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "rope_forward");
  rotate<T>(x, heads, nullptr, 0, positions, tokens, head_dim, rotary_dim, theta, 1.0f);
}

template <typename T>
void rope_forward(T* q, int64_t q_heads, T* k, int64_t k_heads, const int32_t* positions, int64_t tokens,
                  int64_t head_dim, int64_t rotary_dim, float theta) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "rope_forward");
  rotate<T>(q, q_heads, k, k_heads, positions, tokens, head_dim, rotary_dim, theta, 1.0f);
}

void rope_backward(float* dx, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                   int64_t rotary_dim, float theta) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "rope_backward");
  rotate<float>(dx, heads, nullptr, 0, positions, tokens, head_dim, rotary_dim, theta, -1.0f);
}

void rope_backward(float* dq, int64_t q_heads, float* dk, int64_t k_heads, const int32_t* positions, int64_t tokens,
                   int64_t head_dim, int64_t rotary_dim, float theta) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "rope_backward");
  rotate<float>(dq, q_heads, dk, k_heads, positions, tokens, head_dim, rotary_dim, theta, -1.0f);
}

template void rope_forward<float>(float*, const int32_t*, int64_t, int64_t, int64_t, int64_t, float);
template void rope_forward<bf16>(bf16*, const int32_t*, int64_t, int64_t, int64_t, int64_t, float);
template void rope_forward<float>(float*, int64_t, float*, int64_t, const int32_t*, int64_t, int64_t, int64_t, float);
template void rope_forward<bf16>(bf16*, int64_t, bf16*, int64_t, const int32_t*, int64_t, int64_t, int64_t, float);

}  // namespace hs::kernels
