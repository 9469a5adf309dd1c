#include "kernels/moe.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/compute.h"
#include "core/profile.h"
#include "kernels/common.h"
#include "kernels/matmul.h"

namespace hs::kernels {
namespace {

// Below this many elements an OpenMP region costs more than the loop (several loops run per expert).
constexpr int64_t kMinParallelWork = int64_t{1} << 14;

// Products over an expert's rows have a data-dependent row count n. oneDNN's AMX primitive is fastest with
// the row count fixed at creation (taking it at execution ran 0.7-0.8x as fast at these shapes), but creating one
// costs ~0.6 ms, so the row counts it sees must come from a small fixed set. The bulk is split into pieces of
// kRowBlock * 2^j rows (the binary digits of n / kRowBlock), and the last n % kRowBlock rows go to one primitive
// that takes the row count at execution (MatmulLayout::varying_rows), with no copy into a padded scratch. With the
// remainder uncopied, 1024-row pieces beat 256 (+1.9% on the `small` training step, 4 of 4 alternated rounds of
// bench/ab_train_step.sh) and 512 (+0.9%); all rows at execution (no pieces) was ~3% slower.
constexpr int64_t kRowBlock = 1024;

template <typename F>
void for_each_bulk_piece(int64_t n, F&& f) {
  const auto blocks = static_cast<uint64_t>(n / kRowBlock);
  int64_t row = 0;
  for (int j = std::bit_width(blocks) - 1; j >= 0; --j)
    if ((blocks >> j) & 1u) {
      f(row, kRowBlock << j);
      row += kRowBlock << j;
    }
}

// C[n, N] = A[n, K] op(B); op(B) = B^T for B stored [N, K] (trans_b), else B stored [K, N].
template <typename T, typename TC>
void rows_matmul(const T* A, const T* B, TC* C, int64_t n, int64_t N, int64_t K, bool trans_b) {
  for_each_bulk_piece(
      n, [&](int64_t row, int64_t rows) { matmul(A + row * K, B, C + row * N, rows, N, K, false, trans_b); });
  const int64_t r = n % kRowBlock, row = n - r;
  if (r == 0) return;
  MatmulLayout any_rows;
  any_rows.varying_rows = true;
  matmul(A + row * K, B, C + row * N, r, N, K, false, trans_b, false, any_rows);
}

// C[M, N] += A[n, M]^T B[n, N]: a weight gradient summed over an expert's rows, one call whatever n (one
// primitive takes n at execution).
template <typename T>
void rows_reduce_matmul(const T* A, const T* B, float* C, int64_t n, int64_t M, int64_t N) {
  MatmulLayout any_rows;
  any_rows.varying_rows = true;
  matmul(A, B, C, M, N, n, true, false, true, any_rows);
}

void check_shape(const MoeShape& s) {
  if (s.tokens < 0 || s.hidden <= 0 || s.experts <= 0 || s.top_k < 1 || s.top_k > s.experts || s.expert_inter <= 0 ||
      s.shared_inter <= 0)
    throw std::invalid_argument("moe: bad shape (tokens " + std::to_string(s.tokens) + ", experts " +
                                std::to_string(s.experts) + ", top_k " + std::to_string(s.top_k) + ")");
  if (s.tokens * s.top_k > std::numeric_limits<int32_t>::max())
    throw std::invalid_argument("moe: tokens * top_k must fit in int32");
}

}  // namespace

// In place: router logits -> softmax probabilities (fp32, per row), then the top-k. A NaN probability
// orders as -inf, so k distinct experts are always selected (and the NaN still reaches the loss).
void pieces::moe_route(int64_t tokens, int64_t E, int64_t k, bool norm, float* probs, int32_t* index, float* weight) {
#pragma omp parallel for schedule(static) if (tokens * E > kMinParallelWork)
  for (int64_t t = 0; t < tokens; ++t) {
    float* p = probs + t * E;
    float mx = p[0];
    for (int64_t e = 1; e < E; ++e) mx = std::max(mx, p[e]);
    float s = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      p[e] = std::exp(p[e] - mx);
      s += p[e];
    }
    for (int64_t e = 0; e < E; ++e) p[e] /= s;
    // k passes, each taking the largest entry strictly after the previous pick in the order
    // (probability descending, index ascending): ties go to the lower index.
    float prev_v = std::numeric_limits<float>::infinity();
    int64_t prev_i = -1;
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      float best_v = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        const float v = std::isnan(p[e]) ? -std::numeric_limits<float>::infinity() : p[e];
        const bool after_prev = v < prev_v || (v == prev_v && e > prev_i);
        if (after_prev && (best < 0 || v > best_v)) {
          best = e;
          best_v = v;
        }
      }
      index[t * k + j] = static_cast<int32_t>(best);
      weight[t * k + j] = p[best];
      sum += p[best];
      prev_v = best_v;
      prev_i = best;
    }
    if (norm)
      for (int64_t j = 0; j < k; ++j) weight[t * k + j] /= sum;
  }
}

void pieces::moe_group_by_expert(int64_t nk, int64_t E, const int32_t* idx, int64_t* off, int32_t* slots) {
  // off[e] serves as expert e's cursor, which leaves it at the old off[e + 1]; shift back after.
  std::fill_n(off, E + 1, int64_t{0});
  for (int64_t i = 0; i < nk; ++i) ++off[idx[i] + 1];
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  for (int64_t i = 0; i < nk; ++i) slots[off[idx[i]]++] = static_cast<int32_t>(i);
  for (int64_t e = E; e > 0; --e) off[e] = off[e - 1];
  off[0] = 0;
}

template <typename T>
void pieces::moe_shared_scale(int64_t N, int64_t H, const T* x, const float* shared_expert_gate, float* scale) {
#pragma omp parallel for schedule(static) if (N * H > kMinParallelWork)
  for (int64_t t = 0; t < N; ++t) {
    const T* xt = x + t * H;
    float z = 0.0f;
#pragma omp simd reduction(+ : z)
    for (int64_t h = 0; h < H; ++h) z += to_f32(xt[h]) * shared_expert_gate[h];
    scale[t] = sigmoidf(z);
  }
}

namespace {

// Position of slot s of token t among the token's k slots ordered by expert index (the order in which the
// grouped experts reach the token): 0 = its first expert, k - 1 = its last. A token's experts are distinct.
inline int64_t expert_rank(const int32_t* index, int64_t t, int64_t k, int64_t slot) {
  const int32_t e = index[slot];
  int64_t rank = 0;
  for (int64_t j = 0; j < k; ++j) rank += index[t * k + j] < e;
  return rank;
}

// The routed experts of MoeWeights / MoeGrads when no ExpertStream is given: all of them in memory.
template <typename T>
class ExpertsInPlace final : public ExpertStream<T> {
 public:
  ExpertsInPlace(const MoeShape& s, const MoeWeights<T>& w, const MoeGrads* g)
      : gate_up_(s.expert_inter * 2 * s.hidden), down_(s.hidden * s.expert_inter), w_(w), g_(g) {}
  typename ExpertStream<T>::Expert next(int64_t e) override {
    return {w_.gate_up + e * gate_up_, w_.down + e * down_, g_ ? g_->gate_up + e * gate_up_ : nullptr,
            g_ ? g_->down + e * down_ : nullptr};
  }
  void finish() override {}

 private:
  int64_t gate_up_, down_;
  const MoeWeights<T>& w_;
  const MoeGrads* g_;
};


}  // namespace

namespace {
// Row r of pieces::moe_add_expert_rows, on the calling thread.
template <typename T>
inline void add_expert_row(int64_t r, int64_t H, int64_t k, const int32_t* rows, const int32_t* idx, const float* wts,
                           const float* scale, const T* sh, const float* yg, float* sum, T* y) {
  const int64_t t = rows[r] / k, rank = expert_rank(idx, t, k, rows[r]);
  const float wt = wts[rows[r]];
  float* st = sum + t * H;
  const float* src = yg + r * H;
  if (rank == k - 1) {
    const float sg = scale[t];
    const T* sht = sh + t * H;
    T* yt = y + t * H;
    if (rank == 0) {
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) {
        float v = 0.0f;
        v += wt * src[h];
        yt[h] = from_f32<T>(v + sg * to_f32(sht[h]));
      }
    } else {
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) {
        float v = st[h];
        v += wt * src[h];
        yt[h] = from_f32<T>(v + sg * to_f32(sht[h]));
      }
    }
  } else if (rank == 0) {
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) {
      float v = 0.0f;
      v += wt * src[h];
      st[h] = v;
    }
  } else {
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) st[h] += wt * src[h];
  }
}
}  // namespace

// Adds an expert's output rows yg [n, H] (fp32, grouped rows `rows` of the expert) into its tokens' outputs: each token
// appears once per expert, so rows never collide; experts add in index order like transformers' index_add_ loop (into
// a zero sum), and the token's last expert adds the gated shared expert and writes y.
template <typename T>
void pieces::moe_add_expert_rows(int64_t n, int64_t H, int64_t k, const int32_t* rows, const int32_t* idx,
                                 const float* wts, const float* scale, const T* sh, const float* yg, float* sum,
                                 T* y) {
#pragma omp parallel for schedule(static) if (n * H > kMinParallelWork)
  for (int64_t r = 0; r < n; ++r) add_expert_row(r, H, k, rows, idx, wts, scale, sh, yg, sum, y);
}

namespace {

// The first expert at or after e that has rows (E when none); off holds the experts' row offsets [E + 1].
inline int64_t next_expert_with_rows(const int64_t* off, int64_t E, int64_t e) {
  while (e < E && off[e + 1] == off[e]) ++e;
  return e;
}

// gather(e, r) for every row r of expert e in one parallel region, timed under `label` (nothing when e == E). The
// experts after it gather inside the previous expert's combine / scatter region instead.
template <typename Gather>
void gather_expert_rows(const int64_t* off, int64_t E, int64_t e, int64_t H, const char* label, Gather&& gather) {
  if (e >= E) return;
  profile::Scope sub(profile::Phase::MoeDispatch, label);
  const int64_t n = off[e + 1] - off[e];
#pragma omp parallel for schedule(static) if (n * H > kMinParallelWork)
  for (int64_t r = 0; r < n; ++r) gather(e, r);
}

// Row r of add_expert_dx, on the calling thread.
inline void add_expert_dx_row(int64_t r, int64_t H, int64_t k, const int32_t* rows, const int32_t* idx,
                              const float* dzt, const float* w_sg, const float* dxg, float* dx) {
  const int64_t t = rows[r] / k;
  float* dst = dx + t * H;
  const float* src = dxg + r * H;
  if (expert_rank(idx, t, k, rows[r]) == 0) {
    const float dzv = dzt[t];
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) {
      float v = dst[h];
      v += dzv * w_sg[h];
      dst[h] = v + src[h];
    }
  } else {
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) dst[h] += src[h];
  }
}
// Adds an expert's input-gradient rows dxg [n, H] into dx; a token's first expert (in index order) also adds the
// shared-expert gate's term dz * w_sg.
inline void add_expert_dx(int64_t n, int64_t H, int64_t k, const int32_t* rows, const int32_t* idx, const float* dzt,
                          const float* w_sg, const float* dxg, float* dx) {
#pragma omp parallel for schedule(static) if (n * H > kMinParallelWork)
  for (int64_t r = 0; r < n; ++r) add_expert_dx_row(r, H, k, rows, idx, dzt, w_sg, dxg, dx);
}

// Where the rows of an expert-parallel exchange are. A block is the rows one rank sent for one local expert of
// another: block p * Xl + j holds rank p's rows for this rank's local expert j. Received blocks are in rank order
// (and, within a rank, expert order); the owner computes in expert order (and, within an expert, rank order).
struct EpLayout {
  int64_t ranks = 1, local = 0, received = 0, capacity = 0;
  ExpertRowRoutes routes;                        // rows per rank and where they start
  std::vector<int64_t> count, at_recv, at_own;   // per block: rows, start in each order
  std::vector<int64_t> own_first;                // [Xl + 1]: owner-order start of each expert
};

// off: this rank's grouped offsets [E + 1]; recv: rows received per block [ranks * Xl] (both null in planning,
// where every rank is taken to receive as many rows as it sends: balanced routing). Buffers on the owner's side hold
// capacity = max(received, tokens * k) rows, so a rank's memory is the plan's unless its experts receive more.
EpLayout ep_layout(const int64_t* off, const int64_t* recv, int64_t ranks, int64_t E, int64_t nk) {
  EpLayout L;
  L.ranks = ranks;
  L.local = E / ranks;
  const int64_t Xl = L.local;
  const auto P = static_cast<size_t>(ranks);
  ExpertRowRoutes& R = L.routes;
  R.send_rows.assign(P, 0), R.send_first.assign(P, 0), R.recv_rows.assign(P, 0), R.recv_first.assign(P, 0);
  L.count.assign(P * static_cast<size_t>(Xl), 0), L.at_recv = L.count, L.at_own = L.count;
  L.own_first.assign(static_cast<size_t>(Xl + 1), 0);
  if (!off) {
    L.received = nk;
    L.capacity = nk;
    return L;
  }
  for (int64_t q = 0; q < ranks; ++q) {
    R.send_first[size_t(q)] = off[q * Xl];
    R.send_rows[size_t(q)] = off[(q + 1) * Xl] - off[q * Xl];
  }
  int64_t at = 0;
  for (int64_t p = 0; p < ranks; ++p) {
    R.recv_first[size_t(p)] = at;
    for (int64_t j = 0; j < Xl; ++j) {
      const size_t b = size_t(p * Xl + j);
      L.count[b] = recv[b];
      L.at_recv[b] = at;
      at += recv[b];
    }
    R.recv_rows[size_t(p)] = at - R.recv_first[size_t(p)];
  }
  L.received = at;
  at = 0;
  for (int64_t j = 0; j < Xl; ++j) {
    L.own_first[size_t(j)] = at;
    for (int64_t p = 0; p < ranks; ++p) {
      const size_t b = size_t(p * Xl + j);
      L.at_own[b] = at;
      at += L.count[b];
    }
  }
  L.own_first[size_t(Xl)] = at;
  L.capacity = std::max(L.received, nk);
  return L;
}

// Moves rows of `row_bytes` between the two orders of an EpLayout.
void ep_permute(const EpLayout& L, const void* src, void* dst, size_t row_bytes, bool to_owner) {
  const auto blocks = static_cast<int64_t>(L.count.size());
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const size_t i = static_cast<size_t>(b);
    if (L.count[i] == 0) continue;
    const int64_t from = to_owner ? L.at_recv[i] : L.at_own[i], to = to_owner ? L.at_own[i] : L.at_recv[i];
    std::memcpy(static_cast<char*>(dst) + static_cast<size_t>(to) * row_bytes,
                static_cast<const char*>(src) + static_cast<size_t>(from) * row_bytes,
                static_cast<size_t>(L.count[i]) * row_bytes);
  }
}

}  // namespace

template <typename T>
RouterStats moe_forward(const MoeShape& s, const T* x, const MoeWeights<T>& w, T* y, MoeSaved* saved,
                        MemoryAccountant& mem) {
  profile::Scope profile_scope(profile::Phase::MoeDispatch, "moe_forward");
  check_shape(s);
  const int64_t N = s.tokens, H = s.hidden, E = s.experts, k = s.top_k, I = s.expert_inter;
  const auto nk = static_cast<size_t>(N * k);
  const bool ep = w.exchange && w.exchange->ranks() > 1;
  if (ep && (!w.experts || E % w.exchange->ranks() != 0))
    throw std::invalid_argument("moe: expert parallelism needs an expert stream and ranks dividing the experts");
  const MemCategory keep = saved ? MemCategory::Activations : MemCategory::Workspace;
  Buffer probs = mem.allocate_n<float>(static_cast<size_t>(N * E), keep, "moe.probs");
  Buffer topk_index = mem.allocate_n<int32_t>(nk, keep, "moe.topk_index");
  Buffer topk_weight = mem.allocate_n<float>(nk, keep, "moe.topk_weight");
  Buffer offset = mem.allocate_n<int64_t>(static_cast<size_t>(E + 1), keep, "moe.expert_offset");
  Buffer row_slot = mem.allocate_n<int32_t>(nk, keep, "moe.row_slot");
  Buffer gate_up;
  if (!ep) gate_up = mem.allocate_n<T>(nk * static_cast<size_t>(2 * I), keep, "moe.gate_up");
  Buffer shared_scale = mem.allocate_n<float>(static_cast<size_t>(N), keep, "moe.shared_scale");

  const auto nh = static_cast<size_t>(N * H);
  Buffer shared_out = mem.allocate_n<T>(nh, MemCategory::Workspace, "moe.shared_out");
  auto shared_expert = [&] {
    swiglu_forward(N, H, s.shared_inter, x, w.shared_gate, w.shared_up, w.shared_down, shared_out.as<T>(),
                   saved ? &saved->shared : nullptr, mem);
  };
  if (!ep) shared_expert();  // expert parallel: while the rows travel to their owners, below
  // Running sum of a token's weighted expert outputs between its first and its last expert (never read
  // before a token's first expert writes it, so not cleared).
  Buffer acc = mem.allocate_n<float>(nh, MemCategory::Workspace, "moe.routed_sum");
  // Per-expert scratch: an expert gets at most one slot per token, so N rows bound every group.
  Buffer xe, act, ye;
  if (!ep) {
    xe = mem.allocate_n<T>(nh, MemCategory::Workspace, "moe.expert_x");
    act = mem.allocate_n<T>(static_cast<size_t>(N * I), MemCategory::Workspace, "moe.expert_act");
    ye = mem.allocate_n<float>(nh, MemCategory::Workspace, "moe.expert_y");
  }

  ExpertsInPlace<T> in_place(s, w, nullptr);
  ExpertStream<T>& experts = w.experts ? *w.experts : in_place;
  RouterStats stats;
  stats.expert_counts.assign(static_cast<size_t>(E), 0.0);
  stats.prob_sums.assign(static_cast<size_t>(E), 0.0);
  stats.rows = N;
  compute(mem, [&] {
    float* p = probs.as<float>();
    int32_t* idx = topk_index.as<int32_t>();
    float* wts = topk_weight.as<float>();
    int64_t* off = offset.as<int64_t>();
    int32_t* slots = row_slot.as<int32_t>();
    matmul(x, w.router, p, N, E, H, false, true);  // fp32 logits
    profile::Scope sub(profile::Phase::MoeDispatch, "moe_route");
    pieces::moe_route(N, E, k, s.norm_topk_prob, p, idx, wts);

    // Counting sort of the (token, slot) pairs by expert; tokens stay ascending within an expert.
    pieces::moe_group_by_expert(static_cast<int64_t>(nk), E, idx, off, slots);

    for (int64_t t = 0; t < N; ++t)
      for (int64_t e = 0; e < E; ++e) stats.prob_sums[static_cast<size_t>(e)] += p[t * E + e];
    for (int64_t e = 0; e < E; ++e)
      stats.expert_counts[static_cast<size_t>(e)] = static_cast<double>(off[e + 1] - off[e]);

    // Shared-expert gate, needed by the last expert of each token below.
    pieces::moe_shared_scale(N, H, x, w.shared_expert_gate, shared_scale.as<float>());
  });
  if (!ep) {
    const int32_t* idx = topk_index.as<int32_t>();
    const float* wts = topk_weight.as<float>();
    const int64_t* off = offset.as<int64_t>();
    const int32_t* slots = row_slot.as<int32_t>();
    T* gu = gate_up.as<T>();
    T* xg = xe.as<T>();
    // Expert e's input rows: gathered while the previous expert's outputs are combined, one parallel region for
    // both (the two loops write different buffers), so each expert costs one region of its own here, not two.
    auto gather_rows = [&](int64_t e, int64_t r) { std::copy_n(x + (slots[off[e] + r] / k) * H, H, xg + r * H); };
    compute(mem, [&] { gather_expert_rows(off, E, next_expert_with_rows(off, E, 0), H, "moe_gather", gather_rows); });
    for (int64_t e = 0; e < E; ++e) {
      const typename ExpertStream<T>::Expert ex = experts.next(e);
      compute(mem, [&] {
        const int64_t r0 = off[e], n = off[e + 1] - off[e];
        if (n == 0) return;
        const int32_t* rows = slots + r0;
        T* gu_e = gu + r0 * 2 * I;
        rows_matmul(xg, ex.gate_up, gu_e, n, 2 * I, H, true);
        {
          profile::Scope sub(profile::Phase::MoeDispatch, "moe_swiglu_rows");
          pieces::swiglu_act_rows(n, I, gu_e, nullptr, act.as<T>());
        }
        rows_matmul(act.as<T>(), ex.down, ye.as<float>(), n, H, I, true);
        profile::Scope sub(profile::Phase::MoeDispatch, "moe_combine");
        const int64_t nx = next_expert_with_rows(off, E, e + 1), n_next = nx < E ? off[nx + 1] - off[nx] : 0;
        const float* sc = shared_scale.as<float>();
        const T* so = shared_out.as<T>();
        const float* yv = ye.as<float>();
        float* sum = acc.as<float>();
#pragma omp parallel if ((n + n_next) * H > kMinParallelWork)
        {
#pragma omp for schedule(static) nowait
          for (int64_t r = 0; r < n; ++r) add_expert_row(r, H, k, rows, idx, wts, sc, so, yv, sum, y);
#pragma omp for schedule(static)
          for (int64_t r = 0; r < n_next; ++r) gather_rows(nx, r);
        }
      });
    }
    experts.finish();
  } else {
    // Expert parallelism: counts, then the rows out to their owners, the owner's experts, the outputs back.
    ExpertRowExchange& xc = *w.exchange;
    const int64_t ranks = xc.ranks(), Xl = E / ranks;
    Buffer recv_counts = mem.allocate_n<int64_t>(static_cast<size_t>(E), keep, "moe.ep_counts");
    compute(mem, [&] {
      std::vector<int64_t> sendc(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) sendc[size_t(e)] = offset.as<int64_t>()[e + 1] - offset.as<int64_t>()[e];
      xc.exchange_counts(sendc.data(), recv_counts.as<int64_t>(), E);
    });
    const EpLayout L = ep_layout(offset.as<int64_t>(), recv_counts.as<int64_t>(), ranks, E, static_cast<int64_t>(nk));
    const auto cap = static_cast<size_t>(L.capacity);
    Buffer own_x = mem.allocate_n<T>(cap * static_cast<size_t>(H), keep, "moe.ep_x");
    {
      Buffer x_send = mem.allocate_n<T>(nk * static_cast<size_t>(H), MemCategory::Workspace, "moe.ep_x_send");
      compute(mem, [&] {
        const int32_t* slots = row_slot.as<int32_t>();
        T* xs = x_send.as<T>();
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(nk) * H > kMinParallelWork)
        for (int64_t r = 0; r < static_cast<int64_t>(nk); ++r) std::copy_n(x + (slots[r] / k) * H, H, xs + r * H);
      });
      Buffer x_recv = mem.allocate_n<T>(cap * static_cast<size_t>(H), MemCategory::Workspace, "moe.ep_x_recv");
      Pending rows;
      compute(mem, [&] { rows = xc.start_dispatch(L.routes, x_send.data(), x_recv.data(), H, sizeof(T)); });
      shared_expert();
      rows.wait();
      compute(mem, [&] { ep_permute(L, x_recv.data(), own_x.data(), static_cast<size_t>(H) * sizeof(T), true); });
    }
    gate_up = mem.allocate_n<T>(cap * static_cast<size_t>(2 * I), keep, "moe.gate_up");
    Buffer y_own = mem.allocate_n<float>(cap * static_cast<size_t>(H), MemCategory::Workspace, "moe.ep_y");
    {
      Buffer act_own = mem.allocate_n<T>(cap * static_cast<size_t>(I), MemCategory::Workspace, "moe.expert_act");
      for (int64_t j = 0; j < Xl; ++j) {
        const typename ExpertStream<T>::Expert ex = experts.next(j);
        compute(mem, [&] {
          const int64_t o = L.own_first[size_t(j)], n = L.own_first[size_t(j + 1)] - o;
          if (n == 0) return;
          T* gu_e = gate_up.as<T>() + o * 2 * I;
          rows_matmul(own_x.as<T>() + o * H, ex.gate_up, gu_e, n, 2 * I, H, true);
          pieces::swiglu_act_rows(n, I, gu_e, nullptr, act_own.as<T>());
          rows_matmul(act_own.as<T>(), ex.down, y_own.as<float>() + o * H, n, H, I, true);
        });
      }
      experts.finish();
    }
    Buffer y_back = mem.allocate_n<float>(nk * static_cast<size_t>(H), MemCategory::Workspace, "moe.ep_y_back");
    {
      Buffer y_send = mem.allocate_n<float>(cap * static_cast<size_t>(H), MemCategory::Workspace, "moe.ep_y_send");
      compute(mem, [&] {
        ep_permute(L, y_own.data(), y_send.data(), static_cast<size_t>(H) * sizeof(float), false);
        y_own.reset();
        xc.start_combine(L.routes, y_send.data(), y_back.data(), H, sizeof(float)).wait();
      });
    }
    y_own.reset();
    compute(mem, [&] {
      const int64_t* off = offset.as<int64_t>();
      const int32_t* slots = row_slot.as<int32_t>();
      for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = off[e], n = off[e + 1] - off[e];
        if (n == 0) continue;
        pieces::moe_add_expert_rows(n, H, k, slots + r0, topk_index.as<int32_t>(), topk_weight.as<float>(),
                        shared_scale.as<float>(), shared_out.as<T>(), y_back.as<float>() + r0 * H, acc.as<float>(), y);
      }
    });
    if (saved) {
      saved->recv_counts = std::move(recv_counts);
      saved->own_x = std::move(own_x);
    }
  }
  if (saved) {
    saved->probs = std::move(probs);
    saved->topk_index = std::move(topk_index);
    saved->topk_weight = std::move(topk_weight);
    saved->expert_offset = std::move(offset);
    saved->row_slot = std::move(row_slot);
    saved->gate_up = std::move(gate_up);
    saved->shared_scale = std::move(shared_scale);
  }
  return stats;
}

template <typename T>
void moe_backward(const MoeShape& s, const T* x, const MoeWeights<T>& w, const MoeSaved& sv, const float* dy,
                  const float* aux_dprob, float* dx, const MoeGrads& g, MemoryAccountant& mem, bool accumulate_dx) {
  profile::Scope profile_scope(profile::Phase::MoeDispatch, "moe_backward");
  check_shape(s);
  const int64_t N = s.tokens, H = s.hidden, E = s.experts, k = s.top_k, I = s.expert_inter;
  const auto nh = static_cast<size_t>(N * H);

  // Shared expert: y_s = sig(z) S(x), z = x . w_sg. Its MLP sees dy * sig; dL/dz = sig (1 - sig) <dy, S>
  // = (1 - sig) * row_dot, where row_dot = <dact, act> = sig <dy, S> comes out of swiglu_backward.
  // dz * w_sg joins dx below, together with the token's first routed expert.
  Buffer dz = mem.allocate_n<float>(static_cast<size_t>(N), MemCategory::Workspace, "moe.shared_dz");
  const bool ep = w.exchange && w.exchange->ranks() > 1;
  auto shared_expert = [&] {
    // dy * sig, rounded to T in the same pass (the MLP's products run in T).
    Buffer dy_shared = mem.allocate_n<T>(nh, MemCategory::Workspace, "moe.shared_dy");
    const float* scale = sv.shared_scale.as<float>();
    compute(mem, [&] {
      profile::Scope sub(profile::Phase::MoeDispatch, "moe_shared_dy");
      T* d = dy_shared.as<T>();
#pragma omp parallel for schedule(static) if (N * H > kMinParallelWork)
      for (int64_t t = 0; t < N; ++t)
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) d[t * H + h] = from_f32<T>(scale[t] * dy[t * H + h]);
    });
    pieces::swiglu_backward_from(N, H, s.shared_inter, x, w.shared_gate, w.shared_up, w.shared_down, sv.shared,
                                 dy_shared.as<T>(), dx, g.shared_gate, g.shared_up, g.shared_down,
                                 mem, dz.as<float>(), accumulate_dx);  // the first writer of dx
    compute(mem, [&] {
      profile::Scope sub(profile::Phase::MoeDispatch, "moe_shared_gate_grad");
      float* dzt = dz.as<float>();
      for (int64_t t = 0; t < N; ++t) dzt[t] *= 1.0f - scale[t];
      // d w_sg[h] += sum_t dz[t] x[t, h], column blocks so each thread owns its outputs.
      constexpr int64_t kCols = 64;
#pragma omp parallel for schedule(static) if (N * H > kMinParallelWork)
      for (int64_t h0 = 0; h0 < H; h0 += kCols) {
        const int64_t hn = std::min(kCols, H - h0);
        float col[kCols] = {};
        for (int64_t t = 0; t < N; ++t) {
          const T* xt = x + t * H + h0;
#pragma omp simd
          for (int64_t j = 0; j < hn; ++j) col[j] += dzt[t] * to_f32(xt[j]);
        }
        for (int64_t j = 0; j < hn; ++j) g.shared_expert_gate[h0 + j] += col[j];
      }
    });
  };
  if (!ep) shared_expert();  // expert parallel: while the dy rows travel to the owners, below

  // Routed experts, one group at a time. dL/dw for each slot = <dy[t], expert_out> = <dact, act> with
  // dact computed from the unweighted dy (no division by a possibly tiny w).
  const auto nk = static_cast<size_t>(N * k);
  ExpertsInPlace<T> in_place(s, w, &g);
  ExpertStream<T>& experts = w.experts ? *w.experts : in_place;
  Buffer dweight = mem.allocate_n<float>(nk, MemCategory::Workspace, "moe.dweight");
  if (!ep) {
    Buffer wrow = mem.allocate_n<float>(static_cast<size_t>(N), MemCategory::Workspace, "moe.row_weight");
    Buffer rdot = mem.allocate_n<float>(static_cast<size_t>(N), MemCategory::Workspace, "moe.row_dot");
    Buffer dy_rows = mem.allocate_n<T>(nh, MemCategory::Workspace, "moe.expert_dy");
    Buffer x_rows = mem.allocate_n<T>(nh, MemCategory::Workspace, "moe.expert_x");
    Buffer actw = mem.allocate_n<T>(static_cast<size_t>(N * I), MemCategory::Workspace, "moe.expert_wact");
    Buffer dact = mem.allocate_n<float>(static_cast<size_t>(N * I), MemCategory::Workspace, "moe.expert_dact");
    Buffer dgu = mem.allocate_n<T>(static_cast<size_t>(N * 2 * I), MemCategory::Workspace, "moe.expert_dgate_up");
    Buffer dxe = mem.allocate_n<float>(nh, MemCategory::Workspace, "moe.expert_dx");
    const int64_t* off = sv.expert_offset.as<int64_t>();
    const int32_t* slots = sv.row_slot.as<int32_t>();
    const int32_t* idx = sv.topk_index.as<int32_t>();
    const float* wts = sv.topk_weight.as<float>();
    const float* dzt = dz.as<float>();
    const T* gu = sv.gate_up.as<T>();
    float* dw = dweight.as<float>();
    float* wr = wrow.as<float>();
    float* rd = rdot.as<float>();
    T* dyg = dy_rows.as<T>();
    T* xg = x_rows.as<T>();
    // Expert e's dy (cast to T) and x rows and routing weights: gathered while the previous expert's dx rows are
    // added into dx, one parallel region for both (they write different buffers).
    auto gather_rows = [&](int64_t e, int64_t r) {
      const int32_t slot = slots[off[e] + r];
      wr[r] = wts[slot];
      const int64_t t = slot / k;
      const float* src = dy + t * H;
      T* dst = dyg + r * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) dst[h] = from_f32<T>(src[h]);
      std::copy_n(x + t * H, H, xg + r * H);
    };
    compute(mem,
            [&] { gather_expert_rows(off, E, next_expert_with_rows(off, E, 0), H, "moe_gather_dy", gather_rows); });
    for (int64_t e = 0; e < E; ++e) {
      const typename ExpertStream<T>::Expert ex = experts.next(e);
      compute(mem, [&] {
        const int64_t r0 = off[e], n = off[e + 1] - off[e];
        if (n == 0) return;
        const int32_t* rows = slots + r0;
        const T* gu_e = gu + r0 * 2 * I;
        rows_matmul(dyg, ex.down, dact.as<float>(), n, I, H, false);  // dact = dy W_down
        {
          // w act (recomputed) and d(gate | up) in one pass.
          profile::Scope sub(profile::Phase::MoeDispatch, "moe_swiglu_grad_rows");
          pieces::swiglu_act_grad_rows(n, I, gu_e, dact.as<float>(), wr, actw.as<T>(), dgu.as<T>(), rd);
          for (int64_t r = 0; r < n; ++r) dw[rows[r]] = rd[r];
        }
        rows_reduce_matmul(dyg, actw.as<T>(), ex.ddown, n, H, I);  // dW_down += dy^T (w act)
        rows_reduce_matmul(dgu.as<T>(), xg, ex.dgate_up, n, 2 * I, H);
        rows_matmul(dgu.as<T>(), ex.gate_up, dxe.as<float>(), n, H, 2 * I, false);
        profile::Scope sub(profile::Phase::MoeDispatch, "moe_scatter_dx");
        const int64_t nx = next_expert_with_rows(off, E, e + 1), n_next = nx < E ? off[nx + 1] - off[nx] : 0;
        const float* dxv = dxe.as<float>();
#pragma omp parallel if ((n + n_next) * H > kMinParallelWork)
        {
#pragma omp for schedule(static) nowait
          for (int64_t r = 0; r < n; ++r) add_expert_dx_row(r, H, k, rows, idx, dzt, w.shared_expert_gate, dxv, dx);
#pragma omp for schedule(static)
          for (int64_t r = 0; r < n_next; ++r) gather_rows(nx, r);
        }
      });
    }
    experts.finish();
  } else {
    // Expert parallelism: dy rows and their routing weights out to the owners, the owner's experts, dx rows and the
    // weights' gradients back, combined in expert order as above.
    ExpertRowExchange& xc = *w.exchange;
    const int64_t ranks = xc.ranks(), Xl = E / ranks;
    const EpLayout L =
        ep_layout(sv.expert_offset.as<int64_t>(), sv.recv_counts.as<int64_t>(), ranks, E, static_cast<int64_t>(nk));
    const auto cap = static_cast<size_t>(L.capacity), uH = static_cast<size_t>(H), uI = static_cast<size_t>(I);
    Buffer dy_own = mem.allocate_n<T>(cap * uH, MemCategory::Workspace, "moe.ep_dy");
    Buffer w_own = mem.allocate_n<float>(cap, MemCategory::Workspace, "moe.ep_weight");
    {
      Buffer dy_send = mem.allocate_n<T>(nk * uH, MemCategory::Workspace, "moe.ep_dy_send");
      Buffer w_send = mem.allocate_n<float>(nk, MemCategory::Workspace, "moe.ep_weight_send");
      Buffer dy_recv = mem.allocate_n<T>(cap * uH, MemCategory::Workspace, "moe.ep_dy_recv");
      Buffer w_recv = mem.allocate_n<float>(cap, MemCategory::Workspace, "moe.ep_weight_recv");
      compute(mem, [&] {
        const int32_t* slots = sv.row_slot.as<int32_t>();
        const float* wts = sv.topk_weight.as<float>();
        T* ds = dy_send.as<T>();
        float* ws = w_send.as<float>();
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(nk) * H > kMinParallelWork)
        for (int64_t r = 0; r < static_cast<int64_t>(nk); ++r) {
          ws[r] = wts[slots[r]];
          const float* src = dy + (slots[r] / k) * H;
          T* dst = ds + r * H;
#pragma omp simd
          for (int64_t h = 0; h < H; ++h) dst[h] = from_f32<T>(src[h]);
        }
      });
      Pending dy_rows, w_rows;
      compute(mem, [&] {
        dy_rows = xc.start_dispatch(L.routes, dy_send.data(), dy_recv.data(), H, sizeof(T));
        w_rows = xc.start_dispatch(L.routes, w_send.data(), w_recv.data(), 1, sizeof(float));
      });
      shared_expert();  // the first writer of dx, as without expert parallelism
      dy_rows.wait();
      w_rows.wait();
      compute(mem, [&] {
        ep_permute(L, dy_recv.data(), dy_own.data(), uH * sizeof(T), true);
        ep_permute(L, w_recv.data(), w_own.data(), sizeof(float), true);
      });
    }
    Buffer dx_own = mem.allocate_n<float>(cap * uH, MemCategory::Workspace, "moe.ep_dx");
    Buffer rd_own = mem.allocate_n<float>(cap, MemCategory::Workspace, "moe.ep_row_dot");
    {
      Buffer actw = mem.allocate_n<T>(cap * uI, MemCategory::Workspace, "moe.expert_wact");
      Buffer dact = mem.allocate_n<float>(cap * uI, MemCategory::Workspace, "moe.expert_dact");
      Buffer dgu = mem.allocate_n<T>(cap * 2 * uI, MemCategory::Workspace, "moe.expert_dgate_up");
      for (int64_t j = 0; j < Xl; ++j) {
        const typename ExpertStream<T>::Expert ex = experts.next(j);
        compute(mem, [&] {
          const int64_t o = L.own_first[size_t(j)], n = L.own_first[size_t(j + 1)] - o;
          if (n == 0) return;
          const T* dyg = dy_own.as<T>() + o * H;
          rows_matmul(dyg, ex.down, dact.as<float>(), n, I, H, false);  // dact = dy W_down
          pieces::swiglu_act_grad_rows(n, I, sv.gate_up.as<T>() + o * 2 * I, dact.as<float>(), w_own.as<float>() + o,
                                       actw.as<T>(), dgu.as<T>(), rd_own.as<float>() + o);
          rows_reduce_matmul(dyg, actw.as<T>(), ex.ddown, n, H, I);  // dW_down += dy^T (w act)
          rows_reduce_matmul(dgu.as<T>(), sv.own_x.as<T>() + o * H, ex.dgate_up, n, 2 * I, H);
          rows_matmul(dgu.as<T>(), ex.gate_up, dx_own.as<float>() + o * H, n, H, 2 * I, false);
        });
      }
      experts.finish();
    }
    dy_own.reset();
    w_own.reset();
    Buffer dx_back = mem.allocate_n<float>(nk * uH, MemCategory::Workspace, "moe.ep_dx_back");
    Buffer rd_back = mem.allocate_n<float>(nk, MemCategory::Workspace, "moe.ep_row_dot_back");
    {
      Buffer dx_send = mem.allocate_n<float>(cap * uH, MemCategory::Workspace, "moe.ep_dx_send");
      Buffer rd_send = mem.allocate_n<float>(cap, MemCategory::Workspace, "moe.ep_row_dot_send");
      compute(mem, [&] {
        ep_permute(L, dx_own.data(), dx_send.data(), uH * sizeof(float), false);
        ep_permute(L, rd_own.data(), rd_send.data(), sizeof(float), false);
        Pending dx_rows = xc.start_combine(L.routes, dx_send.data(), dx_back.data(), H, sizeof(float));
        xc.start_combine(L.routes, rd_send.data(), rd_back.data(), 1, sizeof(float)).wait();
        dx_rows.wait();
      });
    }
    dx_own.reset();
    rd_own.reset();
    compute(mem, [&] {
      const int64_t* off = sv.expert_offset.as<int64_t>();
      const int32_t* slots = sv.row_slot.as<int32_t>();
      float* dw = dweight.as<float>();
      for (int64_t r = 0; r < static_cast<int64_t>(nk); ++r) dw[slots[r]] = rd_back.as<float>()[r];
      for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = off[e], n = off[e + 1] - off[e];
        if (n == 0) continue;
        add_expert_dx(n, H, k, slots + r0, sv.topk_index.as<int32_t>(), dz.as<float>(), w.shared_expert_gate,
                      dx_back.as<float>() + r0 * H, dx);
      }
    });
  }

  // Router: slot weights -> selected probabilities (through the renormalisation) plus the aux term on
  // every probability -> logits through the softmax.
  const auto ne = static_cast<size_t>(N * E);
  Buffer dlogits = mem.allocate_n<float>(ne, MemCategory::Workspace, "moe.dlogits");
  Buffer dlogits_cast;
  if constexpr (!std::is_same_v<T, float>)
    dlogits_cast = mem.allocate_n<T>(ne, MemCategory::Workspace, "moe.dlogits_t");
  compute(mem, [&] {
    profile::Scope router_scope(profile::Phase::MoeDispatch, "moe_router_backward");
    const float* probs = sv.probs.as<float>();
    const int32_t* idx = sv.topk_index.as<int32_t>();
    const float* wts = sv.topk_weight.as<float>();
    const float* dw = dweight.as<float>();
    float* dl = dlogits.as<float>();
#pragma omp parallel for schedule(static) if (N * E > kMinParallelWork)
    for (int64_t t = 0; t < N; ++t) {
      const float* p = probs + t * E;
      float* d = dl + t * E;
      for (int64_t e = 0; e < E; ++e) d[e] = aux_dprob ? aux_dprob[e] : 0.0f;
      const int32_t* it = idx + t * k;
      const float* wt = wts + t * k;
      const float* dwt = dw + t * k;
      if (s.norm_topk_prob) {
        // w_j = p_j / S, S = sum of the selected p: dp_j = (dw_j - sum_i dw_i w_i) / S
        float sum = 0.0f, dot = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
          sum += p[it[j]];
          dot += dwt[j] * wt[j];
        }
        for (int64_t j = 0; j < k; ++j) d[it[j]] += (dwt[j] - dot) / sum;
      } else {
        for (int64_t j = 0; j < k; ++j) d[it[j]] += dwt[j];
      }
      float pd = 0.0f;
      for (int64_t e = 0; e < E; ++e) pd += p[e] * d[e];
      for (int64_t e = 0; e < E; ++e) d[e] = p[e] * (d[e] - pd);
    }
    const T* dlt = in_storage_type<T>(dl, dlogits_cast, ne);
    matmul(dlt, x, g.router, E, H, N, true, false, true);    // dW_router += dlogits^T x
    matmul(dlt, w.router, dx, N, H, E, false, false, true);  // dx += dlogits W_router
  });
}

double load_balance_loss(const std::vector<RouterStats>& layers, int64_t experts, std::vector<float>* dprob_sums) {
  const auto E = static_cast<size_t>(experts);
  std::vector<double> counts(E, 0.0), probs(E, 0.0);
  double rows = 0.0;
  for (const RouterStats& l : layers) {
    if (l.expert_counts.size() != E || l.prob_sums.size() != E)
      throw std::invalid_argument("load_balance_loss: router statistics for " + std::to_string(l.expert_counts.size()) +
                                  " experts, expected " + std::to_string(experts));
    for (size_t e = 0; e < E; ++e) {
      counts[e] += l.expert_counts[e];
      probs[e] += l.prob_sums[e];
    }
    rows += static_cast<double>(l.rows);
  }
  if (dprob_sums) dprob_sums->assign(E, 0.0f);
  if (rows == 0.0) return 0.0;
  double aux = 0.0;
  for (size_t e = 0; e < E; ++e) aux += (counts[e] / rows) * (probs[e] / rows);
  if (dprob_sums)
    for (size_t e = 0; e < E; ++e)
      (*dprob_sums)[e] = static_cast<float>(static_cast<double>(experts) * counts[e] / (rows * rows));
  return static_cast<double>(experts) * aux;
}

template RouterStats moe_forward<float>(const MoeShape&, const float*, const MoeWeights<float>&, float*, MoeSaved*,
                                        MemoryAccountant&);
template RouterStats moe_forward<bf16>(const MoeShape&, const bf16*, const MoeWeights<bf16>&, bf16*, MoeSaved*,
                                       MemoryAccountant&);
template void moe_backward<float>(const MoeShape&, const float*, const MoeWeights<float>&, const MoeSaved&,
                                  const float*, const float*, float*, const MoeGrads&, MemoryAccountant&, bool);
template void moe_backward<bf16>(const MoeShape&, const bf16*, const MoeWeights<bf16>&, const MoeSaved&, const float*,
                                 const float*, float*, const MoeGrads&, MemoryAccountant&, bool);
#define HS_INSTANTIATE(T)                                                                                            \
  template void pieces::moe_shared_scale<T>(int64_t, int64_t, const T*, const float*, float*);                      \
  template void pieces::moe_add_expert_rows<T>(int64_t, int64_t, int64_t, const int32_t*, const int32_t*,          \
                                               const float*, const float*, const T*, const float*, float*, T*);
HS_INSTANTIATE(float)
HS_INSTANTIATE(bf16)
#undef HS_INSTANTIATE

}  // namespace hs::kernels
