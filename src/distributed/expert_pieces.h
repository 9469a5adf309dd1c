// How a layer's routed experts arrive and their gradients leave: the MoE kernel's kernels::ExpertStream, gathering (or
// casting) the experts piece by piece just before the kernel reaches them, prefetching the next piece, and
// reduce-scattering each piece's gradients as the kernel moves on.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/collectives.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "kernels/moe.h"

namespace hs::distributed {

// One layer's routed experts as this rank stores them.
struct StoredExperts {
  int64_t experts = 0, hidden = 0, expert_inter = 0;
  TensorView gate_up, down;  // [E, 2I, H], [E, H, I]; sharded: this rank's shards, expert by expert (shard units)
  int64_t shards = 1;        // > 1: sharded over the FSDP group (Collectives of that size)
  // Backward: their fp32 gradients, laid out as the weights (this rank's shards when sharded), accumulated into.
  // (In planning the pointers are null: `backward` says which pass this is.)
  bool backward = false;
  float* dgate_up = nullptr;
  float* ddown = nullptr;
};

// One pass of the MoE kernel over a layer's routed experts, piece by piece: pieces of consecutive experts of at most
// piece_bytes in T (gate_up and down together; at least one expert; 0: the whole layer's experts are one piece).
// Sharded: a piece's weights are all-gathered expert by expert (each expert is a shard unit, so its shards are
// contiguous on every rank) into one buffer, and the next piece's gathers start when a piece is reached; in backward
// a piece's gradients accumulate in a zeroed full-size buffer that is reduce-scattered into this rank's shards when
// the kernel moves on, left in flight until the piece after it is done. So two pieces of weights and two of
// gradients live at once. Unsharded: the weights are used in place, or cast to T one piece at a time, and the
// gradients accumulate straight into the gradient stacks.
// Expert parallel (expert_parallel = X > 1, sharded over the FSDP group `comm`): the kernel asks only for this rank's
// E / X experts (kernels::MoeWeights::exchange); FSDP rank r owns experts [(r % X) E / X, (r % X + 1) E / X).
// The shards stay as without expert parallelism (every rank holds its 1/G of every expert, so parameters, moments,
// checkpoints and the optimizer are unchanged); an owned expert is put together by an all-to-all over the group in
// which every rank sends each rank its shard of the expert that rank owns, and its full gradient goes back by an
// in-place all-to-all whose blocks each rank adds into its shards of the experts their senders own, in rank order:
// the ranks of the group that own the same expert (the data-parallel dimension of the experts, G / X of them; and
// with --fsdp < world their replicas, through the replicas' all-reduce) are summed in rank order.
template <typename T>
class PiecedExperts final : public kernels::ExpertStream<T> {
 public:
  using Expert = typename kernels::ExpertStream<T>::Expert;
  PiecedExperts(const StoredExperts& experts, MemoryAccountant& mem, Collectives* comm, int64_t expert_parallel,
                size_t piece_bytes);
  // e: the kernel's expert index; with expert parallelism, among this rank's own (local) experts.
  Expert next(int64_t e) override;
  void finish() override;

 private:
  struct Piece {
    int64_t first = 0, count = 0;
    Buffer w[2], g[2];                           // gate_up, down: weights in T (empty: in place), full gradients
    bool convert[2] = {false, false};            // expert parallel: received in the storage dtype, converted on arrival
    std::vector<Collectives::Request> requests;  // after the buffers: finished before they are freed
  };
  static void drop(Piece& q);
  float* grad(int k) const { return k ? x_.ddown : x_.dgate_up; }
  const TensorView& weight(int k) const { return k ? x_.down : x_.gate_up; }
  Piece start_weights(int64_t piece);
  void scatter(Piece& q);
  void advance(int64_t piece);

  MemoryAccountant& mem_;
  Collectives* comm_;
  bool sharded_;
  int64_t ep_;
  StoredExperts x_;
  int64_t local_ = 0, per_piece_ = 1, index_ = -1;
  int64_t n_[2], full_stride_[2], shard_stride_[2];
  Piece retiring_, cur_, ahead_;
};

}  // namespace hs::distributed
