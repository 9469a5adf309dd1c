#include "distributed/global_weights.h"

#include <stdexcept>
#include <utility>

#include "core/compute.h"
#include "core/profile.h"

namespace hs::distributed {

template <typename E>
Converted<E> whole_weight(const TensorView& t, int64_t full_elems, Collectives* sharded_over, MemoryAccountant& mem) {
  if (!sharded_over) {
    profile::Scope profile_scope(profile::Phase::Elementwise, "global_weight_cast");  // a cast, when the dtypes differ
    return as_type<E>(t, mem, MemCategory::WeightCasts, "weight_cast");
  }
  profile::Scope profile_scope(profile::Phase::Communication, "global_weight_gather");
  Converted<E> r;
  r.owned = mem.allocate_n<E>(static_cast<size_t>(sharded_over->padded_elems(full_elems)), MemCategory::WeightCasts,
                              "gathered_weight");
  sharded_over->all_gather(t, r.owned.data(), dtype_of<E>(), full_elems);
  r.ptr = static_cast<const E*>(r.owned.data());
  return r;
}

template <typename E>
RowPieces<E>::RowPieces(MemoryAccountant& mem, Collectives* sharded_over, const TensorView& t, int64_t V, int64_t H,
                        int64_t rows, std::vector<int64_t> order, bool prefetch, GradientFlights& flights,
                        RowGradients* grad)
    : mem_(mem), comm_(sharded_over), t_(t), V_(V), H_(H), rows_(rows), n_(V * H), order_(std::move(order)),
      prefetch_(prefetch), flights_(flights), grad_(grad), grads_left_(pieces()) {}

template <typename E> void RowPieces<E>::drop(Piece& q) {
  for (auto& x : q.requests) x.wait();
  q = {};
}

template <typename E> void RowPieces<E>::finish() {
  drop(ahead_);
  drop(cur_);
}

template <typename E> typename RowPieces<E>::Piece RowPieces<E>::start(int64_t k) {
  Piece q;
  q.k = k;
  const int64_t a = first(k) * H_, len = count(k) * H_;
  if (!comm_ && t_.dtype == dtype_of<E>()) {
    q.ptr = compute(mem_, [&] { return static_cast<const E*>(t_.data) + a; });
    return q;
  }
  q.w = mem_.template allocate_n<E>(static_cast<size_t>(len), MemCategory::WeightCasts,
                                    comm_ ? "vocab_piece" : "vocab_piece_cast");
  q.ptr = static_cast<const E*>(q.w.data());
  compute(mem_, [&] {
    if (comm_)
      q.requests.push_back(comm_->start_all_gather_range(t_, n_, a, a + len, q.w.data(), dtype_of<E>()));
    else
      convert_elements(static_cast<const char*>(t_.data) + static_cast<size_t>(a) * dtype_size(t_.dtype), t_.dtype,
                       q.w.data(), dtype_of<E>(), len);
  });
  return q;
}

template <typename E> const E* RowPieces<E>::weights(int64_t k) {
  if (k == cur_.k) return cur_.ptr;
  if (pos_ >= order_.size() || order_[pos_] != k) throw std::logic_error("row pieces: asked for out of order");
  ++pos_;
  drop(cur_);
  if (ahead_.k == k) cur_ = std::move(ahead_);
  else cur_ = start(k);
  {
    profile::Scope profile_scope(profile::Phase::Communication, "vocab_piece_gather");
    for (auto& x : cur_.requests) x.wait();
  }
  cur_.requests.clear();
  if (prefetch_ && pos_ < order_.size()) ahead_ = start(order_[pos_]);
  return cur_.ptr;
}

template <typename E> float* RowPieces<E>::grad_rows(int64_t k) {
  if (!comm_) return compute(mem_, [&] { return grad_->shard + first(k) * H_; });
  grad_piece_ = mem_.template allocate_n<float>(static_cast<size_t>(count(k) * H_), MemCategory::Gradients,
                                                "vocab_piece_grad", true);
  return ptr<float>(grad_piece_);
}

template <typename E> void RowPieces<E>::grad_rows_done(int64_t k) {
  const bool last = --grads_left_ == 0;
  GradientFlight f;
  if (comm_) {
    const int64_t a = first(k) * H_, len = count(k) * H_;
    Buffer scratch = mem_.template allocate_n<float>(static_cast<size_t>(comm_->range_scratch_elems(len)),
                                                     MemCategory::Workspace, "vocab_piece_scatter");
    compute(mem_, [&] {
      f.requests.push_back(comm_->start_reduce_scatter_range(ptr<float>(grad_piece_), n_, a, a + len, grad_->shard,
                                                             ptr<float>(scratch)));
    });
    f.full.push_back(std::move(grad_piece_));
    f.full.push_back(std::move(scratch));
  }
  const bool hand_over = last && grad_->complete;
  if (hand_over) {
    if (grad_->own) f.shards.push_back(std::move(*grad_->own));
    f.done = grad_->complete;
  }
  if (comm_ || hand_over) flights_.submit(std::move(f));
}

template Converted<float> whole_weight<float>(const TensorView&, int64_t, Collectives*, MemoryAccountant&);
template Converted<bf16> whole_weight<bf16>(const TensorView&, int64_t, Collectives*, MemoryAccountant&);
template class RowPieces<float>;
template class RowPieces<bf16>;

}  // namespace hs::distributed
