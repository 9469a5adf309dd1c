// How the global tensors (embedding, final norm, LM head, the MTP layer's own) arrive for compute and how their
// gradients leave: whole (all-gathered from this rank's FSDP shard, or cast from their storage dtype), or the [V, H]
// vocabulary tables in row pieces, each gathered (or cast) when asked for, its gradient reduce-scattered into the
// shard piece by piece. A sub-layer's own weights arrive through distributed/weights.h.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/collectives.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "distributed/gradient_flights.h"
#include "distributed/weights.h"
#include "kernels/lm_head.h"

namespace hs::distributed {

// `t` whole as E: all-gathered when it is this rank's shard of a tensor of `full_elems` elements sharded over
// `sharded_over`, else (null) cast into a WeightCasts buffer when its dtype is not E, else used in place.
template <typename E>
Converted<E> whole_weight(const TensorView& t, int64_t full_elems, Collectives* sharded_over, MemoryAccountant& mem);

// Where a table's gradient pieces go: this rank's shard of the [V, H] gradient (unsharded: all of it), and, updating
// in backward, the buffer holding it and what to call once the last piece is in (the sink's hand-over).
struct RowGradients {
  float* shard = nullptr;
  Buffer* own = nullptr;
  std::function<void()> complete;
};

// Rows [k rows, min(V, (k + 1) rows)) of a [V, H] table, piece by piece: the flat range of the FSDP layout gathered
// with all_gather_range (sharded) or cast (unsharded, stored in another dtype than E; in place when it is E), and its
// fp32 gradient accumulated in a piece's buffer and reduce-scattered into the shard with reduce_scatter_range
// (sharded; unsharded it accumulates in place). Weights are asked for in `order` (a piece asked for twice in a row is
// the same piece): at most one piece is held, or, prefetching, one more whose gather runs while the current piece
// computes. A piece's gradient goes to `flights` (in flight while the next piece computes when they overlap); the
// last one hands the shard over (RowGradients::complete).
template <typename E> class RowPieces {
 public:
  // t: this rank's shard of the table, sharded over `sharded_over` (null: t is the whole table). grad: null for a
  // forward.
  RowPieces(MemoryAccountant& mem, Collectives* sharded_over, const TensorView& t, int64_t V, int64_t H, int64_t rows,
            std::vector<int64_t> order, bool prefetch, GradientFlights& flights, RowGradients* grad = nullptr);
  ~RowPieces() { finish(); }
  RowPieces(const RowPieces&) = delete;
  RowPieces& operator=(const RowPieces&) = delete;

  int64_t pieces() const { return (V_ + rows_ - 1) / rows_; }
  int64_t rows() const { return rows_; }
  int64_t first(int64_t k) const { return k * rows_; }
  int64_t count(int64_t k) const { return std::min(rows_, V_ - k * rows_); }
  // Piece k's rows as E (the next piece of `order`, or the one held).
  const E* weights(int64_t k);
  // The fp32 gradient of piece k's rows: a zeroed buffer (sharded) or the shard's own rows; then, once the piece's
  // backward has accumulated into it, grad_rows_done(k).
  float* grad_rows(int64_t k);
  void grad_rows_done(int64_t k);

 private:
  struct Piece {
    int64_t k = -1;
    Buffer w;
    const E* ptr = nullptr;
    std::vector<Pending> requests;  // after the buffer: finished before it is freed
  };
  static void drop(Piece& q);
  void finish();
  Piece start(int64_t k);

  MemoryAccountant& mem_;
  Collectives* comm_;  // null: unsharded
  TensorView t_;
  int64_t V_, H_, rows_, n_;
  std::vector<int64_t> order_;
  bool prefetch_;
  GradientFlights& flights_;
  RowGradients* grad_;
  size_t pos_ = 0;
  Piece cur_, ahead_;
  Buffer grad_piece_;
  int64_t grads_left_;
};

// A table's row pieces as the LM head's pieced cross-entropy asks for them.
template <typename E> struct XentRowPieces final : kernels::XentPieces<E> {
  RowPieces<E>& p;
  explicit XentRowPieces(RowPieces<E>& rp) : p(rp) {}
  const E* weights(int64_t k) override { return p.weights(k); }
  float* grad(int64_t k) override { return p.grad_rows(k); }
  void grad_done(int64_t k) override { p.grad_rows_done(k); }
};

}  // namespace hs::distributed
