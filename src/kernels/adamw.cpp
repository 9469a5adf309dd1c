#include "kernels/adamw.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>
#include <stdexcept>
#include <string>

#include "core/profile.h"

namespace hs::kernels {
namespace {

// sum_squares cuts x into at most kMaxBlocks blocks of at least kMinBlock elements: enough blocks to
// spread over the threads, few enough that their sums fit on the stack.
constexpr int64_t kMaxBlocks = 1024;
constexpr int64_t kMinBlock = 1 << 15;

// The step's scalars. PyTorch computes the bias corrections and the step size in double (Python floats), then uses
// them as fp32 scalars.
struct Scalars {
  float step_size, bc2_sqrt, one_minus_b1, one_minus_b2;
};
Scalars scalars(const AdamWParams& p, int64_t step) {
  if (step < 1) throw std::invalid_argument("adamw_update: step is 1-based, got " + std::to_string(step));
  const double bc1 = 1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(step));
  return {static_cast<float>(static_cast<double>(p.lr) / bc1), static_cast<float>(std::sqrt(bc2)), 1.0f - p.beta1,
          1.0f - p.beta2};
}

// Elements [i0, i1) of one tensor, on the calling thread. Moments in bf16 (TM) are read as fp32, the step runs in
// fp32 as for fp32 moments, and the new moments are stored rounded to nearest even.
template <bool kClear, typename TW, typename TG, typename TM = float>
inline void update_range(TW* w, TG* grad, TM* m, TM* v, int64_t i0, int64_t i1, const AdamWParams& p,
                         const Scalars& k, float decay) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) {
    const float g = grad[i] * p.grad_scale;
    const float m0 = to_f32(m[i]), v0 = to_f32(v[i]);
    const float mi = m0 + k.one_minus_b1 * (g - m0);  // lerp, as torch's exp_avg.lerp_
    const float vi = p.beta2 * v0 + k.one_minus_b2 * g * g;
    const float denom = std::sqrt(vi) / k.bc2_sqrt + p.eps;
    w[i] = from_f32<TW>(to_f32(w[i]) * decay - k.step_size * (mi / denom));
    m[i] = from_f32<TM>(mi);
    v[i] = from_f32<TM>(vi);
    if constexpr (kClear) grad[i] = 0.0f;
  }
}

template <typename TW>
void update(TW* w, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p, int64_t step) {
  const Scalars k = scalars(p, step);
  const float decay = 1.0f - p.lr * p.weight_decay;
  constexpr int64_t kPiece = 4096;
  const int64_t pieces = (n + kPiece - 1) / kPiece;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < pieces; ++c)
    update_range<false>(w, grad, m, v, c * kPiece, std::min(n, (c + 1) * kPiece), p, k, decay);
}

// sum_squares's blocks of an n-element array.
int64_t block_size(int64_t n) { return std::max(kMinBlock, (n + kMaxBlocks - 1) / kMaxBlocks); }

// One block's sum, a single function so that sum_squares and sum_squares_all add in the same order.
[[gnu::noinline]] double block_sum(const float* x, int64_t i0, int64_t i1) {
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = i0; i < i1; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return s;
}

}  // namespace

template <typename TW>
void adamw_update(TW* w, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p, int64_t step) {
  profile::Scope profile_scope(profile::Phase::Optimizer, "adamw_update");
  update(w, grad, m, v, n, p, step);
}

double sum_squares(const float* x, int64_t n) {
  if (n <= 0) return 0.0;
  const int64_t block = block_size(n);
  const int64_t nblocks = (n + block - 1) / block;
  double partial[kMaxBlocks];
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t i0 = blk * block;
    partial[blk] = block_sum(x, i0, std::min(n, i0 + block));
  }
  double total = 0.0;
  for (int64_t blk = 0; blk < nblocks; ++blk) total += partial[blk];
  return total;
}

void adamw_update_clear_all(const std::vector<AdamWTensor>& tensors, const AdamWParams& p, int64_t step) {
  profile::Scope profile_scope(profile::Phase::Optimizer, "adamw_update_clear_all");
  const Scalars k = scalars(p, step);
  // Pieces of at most kPiece elements within one tensor, split evenly (statically) between the threads.
  constexpr int64_t kPiece = 16384;
  std::vector<std::pair<size_t, int64_t>> pieces;  // (tensor, first element)
  for (size_t t = 0; t < tensors.size(); ++t) {
    if ((tensors[t].w == nullptr) == (tensors[t].w_bf16 == nullptr))
      throw std::invalid_argument("adamw_update_clear_all: each tensor needs exactly one of w, w_bf16");
    if ((tensors[t].m == nullptr) == (tensors[t].m_bf16 == nullptr) ||
        (tensors[t].v == nullptr) == (tensors[t].v_bf16 == nullptr) || (tensors[t].m == nullptr) != (tensors[t].v == nullptr))
      throw std::invalid_argument("adamw_update_clear_all: each tensor needs m, v or m_bf16, v_bf16");
    for (int64_t i = 0; i < tensors[t].n; i += kPiece) pieces.emplace_back(t, i);
  }
  const auto np = static_cast<int64_t>(pieces.size());
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < np; ++j) {
    const AdamWTensor& a = tensors[pieces[static_cast<size_t>(j)].first];
    const int64_t i0 = pieces[static_cast<size_t>(j)].second, i1 = std::min(a.n, i0 + kPiece);
    const float decay = 1.0f - p.lr * a.weight_decay;
    if (a.m) {
      if (a.w) update_range<true>(a.w, a.grad, a.m, a.v, i0, i1, p, k, decay);
      else update_range<true>(a.w_bf16, a.grad, a.m, a.v, i0, i1, p, k, decay);
    } else {
      if (a.w) update_range<true>(a.w, a.grad, a.m_bf16, a.v_bf16, i0, i1, p, k, decay);
      else update_range<true>(a.w_bf16, a.grad, a.m_bf16, a.v_bf16, i0, i1, p, k, decay);
    }
  }
}

double sum_squares_all(const std::vector<std::pair<const float*, int64_t>>& arrays) {
  profile::Scope profile_scope(profile::Phase::Optimizer, "sum_squares_all");
  struct Block {
    const float* x;
    int64_t i0, i1;
  };
  std::vector<Block> blocks;
  std::vector<size_t> first;  // index of each array's first block
  for (const auto& [x, n] : arrays) {
    first.push_back(blocks.size());
    const int64_t b = block_size(n);
    for (int64_t i = 0; i < n; i += b) blocks.push_back({x, i, std::min(n, i + b)});
  }
  first.push_back(blocks.size());
  std::vector<double> partial(blocks.size());
  const auto nb = static_cast<int64_t>(blocks.size());
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < nb; ++j) {
    const Block& b = blocks[static_cast<size_t>(j)];
    partial[static_cast<size_t>(j)] = block_sum(b.x, b.i0, b.i1);
  }
  // Per array in block order (as sum_squares adds them), then the arrays in order.
  double total = 0.0;
  for (size_t a = 0; a + 1 < first.size(); ++a) {
    double t = 0.0;
    for (size_t j = first[a]; j < first[a + 1]; ++j) t += partial[j];
    total += t;
  }
  return total;
}

template void adamw_update<float>(float*, const float*, float*, float*, int64_t, const AdamWParams&, int64_t);
template void adamw_update<bf16>(bf16*, const float*, float*, float*, int64_t, const AdamWParams&, int64_t);

}  // namespace hs::kernels
