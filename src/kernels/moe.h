// The sparse mixture-of-experts feed-forward block of Qwen3-Next / Qwen3.5-MoE, forward and backward,
// and the transformers load-balance (auxiliary) loss.
//
// Routing: logits = x W_router^T in fp32, p = softmax(logits) in fp32, the k largest p per token,
// descending, ties to the LOWER expert index (a deterministic rule; torch.topk on the CPU returns tied
// values in an unspecified order, e.g. indices [2, 4, 1] for [1, 3, 3, 2, 3]), and the k weights divided
// by their sum when norm_topk_prob (Qwen3.5 always, Qwen3-Next by config).
// y = sum_{selected e} w_e expert_e(x) + sigmoid(x . shared_expert_gate) shared(x), each expert a
// SwiGLU MLP (kernels/mlp.h). Tokens are grouped by expert (counting sort, tokens ascending within an
// expert): gather rows, one matmul per expert over its rows, scatter-add back; never a dense
// tokens x experts computation.
#pragma once
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/memory.h"
#include "core/pending.h"
#include "kernels/mlp.h"

namespace hs::kernels {

struct MoeShape {
  int64_t tokens, hidden, experts, top_k, expert_inter, shared_inter;
  bool norm_topk_prob = true;
};

// Routed-expert weights (and, in backward, their fp32 gradient accumulators) handed out one expert at a time, so
// that a caller can gather or cast a few consecutive experts at a time instead of a whole layer's. In each pass
// (one moe_forward or one moe_backward) the kernel asks for every expert e = 0..E-1 in ascending order, whether or
// not any row was routed to it (a caller's collectives stay matched across ranks), then calls finish(); in planning
// mode too, so the caller's buffers are accounted at the same moments.
template <typename T>
class ExpertStream {
 public:
  struct Expert {
    const T* gate_up;  // [2I, H]
    const T* down;     // [H, I]
    float* dgate_up;   // backward only: accumulated into
    float* ddown;
  };
  virtual ~ExpertStream() = default;
  virtual Expert next(int64_t e) = 0;
  virtual void finish() = 0;
};

// Expert parallelism's token exchange as the kernel sees it: the rows of this rank's tokens go to the ranks that own
// their experts (dispatch) and the owners' results come back (combine). The kernel decides which rows go where
// (ExpertRowRoutes); the implementation moves them (src/distributed/expert_exchange.h: over a Collectives group; the
// kernel knows nothing of collectives). Every rank of the group makes the same calls in the same order.
//
// Per rank q of the group: this rank's rows for q's experts are send_rows[q] rows from row send_first[q] of the
// dispatch's send buffer (grouped order), and q's rows for this rank's experts land as recv_rows[q] rows from row
// recv_first[q] of its receive buffer (rank order).
struct ExpertRowRoutes {
  std::vector<int64_t> send_rows, send_first, recv_rows, recv_first;
};
class ExpertRowExchange {
 public:
  virtual ~ExpertRowExchange() = default;
  // Ranks in the group (more than one). Rank r owns experts [r * E / ranks, (r + 1) * E / ranks).
  virtual int64_t ranks() const = 0;
  // Blocking: rows[0..E), this rank's rows per expert, out to the experts' owners; received[p * Xl + j] (Xl = E /
  // ranks) = rank p's rows for this rank's local expert j.
  virtual void exchange_counts(const int64_t* rows, int64_t* received, int64_t experts) = 0;
  // Start moving rows of row_elems elements of elem_bytes (2, 4 or 8) bytes each (moved, never reduced). dispatch:
  // the routes' send rows of `send` to their owners, received at the recv rows of `recv`; combine: the other way, the
  // recv rows of `send` back to the send rows of `recv`. Both buffers stay alive until the returned Pending
  // completes; the caller computes meanwhile (the shared expert while the rows travel).
  virtual Pending start_dispatch(const ExpertRowRoutes& routes, const void* send, void* recv, int64_t row_elems,
                                 size_t elem_bytes) = 0;
  virtual Pending start_combine(const ExpertRowRoutes& routes, const void* send, void* recv, int64_t row_elems,
                                size_t elem_bytes) = 0;
};

// Matrices in T (the compute dtype), Hugging Face [out, in] layouts.
template <typename T>
struct MoeWeights {
  const T* router;                  // [E, H]
  const T* gate_up;                 // [E, 2I, H]: rows 0..I-1 gate, I..2I-1 up (the fused Qwen3.5 layout)
  const T* down;                    // [E, H, I]
  const T* shared_gate;             // [Is, H]
  const T* shared_up;               // [Is, H]
  const T* shared_down;             // [H, Is]
  const float* shared_expert_gate;  // [H]
  // When given, the routed experts come from here (and their gradients go there) instead of gate_up / down (and
  // MoeGrads::gate_up / down).
  ExpertStream<T>* experts = nullptr;
  // Expert parallelism: the exchange of the tokens' rows with the ranks of a group (more than one; null: no expert
  // parallelism). Rank r of it owns the experts [r * E / ranks, (r + 1) * E / ranks), and `experts` (required) hands
  // out only those, as local experts 0 .. E / ranks - 1 in ascending order. Each rank routes its own tokens over all E
  // experts; the rows routed to an expert go (dispatch) to its owner, which runs the expert over the rows of every
  // rank, expert by expert (rows of rank 0 first, each rank's in its grouped order), and sends the outputs back
  // (combine); each rank then combines its tokens' rows in expert order as without expert parallelism. Backward: dy
  // rows and routing weights out, dx rows and the routing weights' gradients back; the owner accumulates its experts'
  // weight gradients. The shared expert (forward and backward) computes while the rows travel to the owners.
  ExpertRowExchange* exchange = nullptr;
};

// fp32 gradients with the shapes of MoeWeights; backward accumulates into each.
struct MoeGrads {
  float *router, *gate_up, *down, *shared_gate, *shared_up, *shared_down, *shared_expert_gate;
};

// Per-layer router statistics (values, no side effects): expert_counts[e] = number of (token, slot)
// selections of expert e; prob_sums[e] = sum over tokens of p[e]; rows = tokens.
struct RouterStats {
  std::vector<double> expert_counts, prob_sums;
  int64_t rows = 0;
};

// What backward needs, all MemCategory::Activations. Sizes depend on the shape only: the grouped
// buffers have tokens * top_k rows whatever the routing.
struct MoeSaved {
  Buffer probs;          // [tokens, E] fp32 softmax of the router logits
  Buffer topk_index;     // [tokens, k] int32, descending probability, ties to the lower index
  Buffer topk_weight;    // [tokens, k] fp32 routing weights (renormalised when norm_topk_prob)
  Buffer expert_offset;  // [E + 1] int64: expert e owns grouped rows [offset[e], offset[e + 1])
  Buffer row_slot;       // [tokens * k] int32: grouped row -> flat slot t * k + s
  Buffer gate_up;        // [tokens * k, 2I] T: grouped gate | up pre-activations (expert parallel: of the rows
                         // this rank's experts received, owner order; at least tokens * k rows)
  Buffer recv_counts;    // expert parallel: [ranks * local experts] int64 rows received from each rank per expert
  Buffer own_x;          // expert parallel: [rows received (at least tokens * k), H] T, owner order
  Buffer shared_scale;   // [tokens] fp32: sigmoid(x . shared_expert_gate)
  SwigluSaved shared;    // the shared expert's own saved tensors
};

// x, y [tokens, hidden]. saved == nullptr: inference. In planning mode it makes the same allocations
// and returns zero statistics (of the right sizes) without touching data.
template <typename T>
RouterStats moe_forward(const MoeShape& shape, const T* x, const MoeWeights<T>& w, T* y, MoeSaved* saved,
                        MemoryAccountant& mem);

// dy [tokens, hidden] fp32. aux_dprob [E] = d(total loss) / d(prob_sums[e]) from the load-balance term
// (already multiplied by its coefficient), or nullptr. The router gets gradient only through the
// selected (renormalised) probabilities and aux_dprob. Accumulates into every gradient, and into dx (or, with
// accumulate_dx = false, writes dx: the caller needs no cleared buffer).
template <typename T>
void moe_backward(const MoeShape& shape, const T* x, const MoeWeights<T>& w, const MoeSaved& saved, const float* dy,
                  const float* aux_dprob, float* dx, const MoeGrads& grads, MemoryAccountant& mem,
                  bool accumulate_dx = true);

// transformers' load_balancing_loss_func over all MoE layers (rows stacked, N = total rows, no padding
// mask): aux = E * sum_e (sum_layers counts[e] / N) * (sum_layers prob_sums[e] / N). If dprob_sums !=
// nullptr it receives [E] d aux / d prob_sums[e] (the counts carry no gradient), the same vector for
// every layer; multiply by the aux coefficient to get moe_backward's aux_dprob.
double load_balance_loss(const std::vector<RouterStats>& layers, int64_t experts, std::vector<float>* dprob_sums);

// The pieces of moe_forward, a public part of this interface: a decode step that runs its own threads
// (src/infer/fused_step.h) composes them; called from inside a parallel region they run on the calling thread.
namespace pieces {
// In place: router logits probs [tokens, E] -> softmax, then the top k (index, weight [tokens, k]) as the header
// describes.
void moe_route(int64_t tokens, int64_t E, int64_t k, bool norm, float* probs, int32_t* index, float* weight);
// Counting sort of the nk (token, slot) pairs by expert: expert e owns grouped rows [off[e], off[e + 1]) (off: E + 1),
// slots[row] = t * k + slot, tokens ascending within an expert.
void moe_group_by_expert(int64_t nk, int64_t E, const int32_t* idx, int64_t* off, int32_t* slots);
// scale[t] = sigmoid(x_t . shared_expert_gate).
template <typename T>
void moe_shared_scale(int64_t N, int64_t H, const T* x, const float* shared_expert_gate, float* scale);
// Adds expert rows yg [n, H] (grouped rows `rows`) into the running sums; a token's last expert (in index order)
// adds scale[t] * shared[t] and writes y. Experts must come in ascending index order.
template <typename T>
void moe_add_expert_rows(int64_t n, int64_t H, int64_t k, const int32_t* rows, const int32_t* idx, const float* wts,
                         const float* scale, const T* sh, const float* yg, float* sum, T* y);
}  // namespace pieces

// Defined in src/kernels/reference/ (hs_kernel_references: tests and benchmarks link it, the engine does not).
namespace reference {
// All parameters in S (float or double) so finite differences can perturb every one of them.
template <typename S>
struct MoeParams {
  const S *router, *gate_up, *down, *shared_gate, *shared_up, *shared_down, *shared_expert_gate;
};
template <typename S>
struct MoeParamGrads {
  S *router, *gate_up, *down, *shared_gate, *shared_up, *shared_down, *shared_expert_gate;
};
// Dense oracle: every expert runs on every token and the unselected ones are masked out; the top-k
// is a stable sort by descending probability (the same tie rule, written differently).
template <typename S>
RouterStats moe_forward(const MoeShape& shape, const S* x, const MoeParams<S>& w, S* y);
// Accumulates (+=) like the fast kernel.
template <typename S>
void moe_backward(const MoeShape& shape, const S* x, const MoeParams<S>& w, const S* dy, const S* aux_dprob, S* dx,
                  const MoeParamGrads<S>& grads);
}  // namespace reference

}  // namespace hs::kernels
