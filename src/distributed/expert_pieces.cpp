#include "distributed/expert_pieces.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "core/compute.h"
#include "core/profile.h"

namespace hs::distributed {
namespace {

// n elements of dtype `from` at p become n elements of dtype `to` at p (fp32 <-> bf16), through a small buffer:
// narrowing runs up the array (a chunk's writes only reach elements already read), widening down it.
void convert_in_place(void* p, DType from, DType to, int64_t n) {
  if (from == to) return;
  constexpr int64_t kChunk = 4096;
  alignas(64) char tmp[kChunk * 4];
  const size_t fs = dtype_size(from), ts = dtype_size(to);
  char* b = static_cast<char*>(p);
  auto one = [&](int64_t a, int64_t c) {
    convert_elements(b + static_cast<size_t>(a) * fs, from, tmp, to, c);
    std::memcpy(b + static_cast<size_t>(a) * ts, tmp, static_cast<size_t>(c) * ts);
  };
  if (ts < fs) {
    for (int64_t a = 0; a < n; a += kChunk) one(a, std::min(kChunk, n - a));
  } else {
    for (int64_t end = n; end > 0; end -= kChunk) {
      const int64_t a = std::max<int64_t>(0, end - kChunk);
      one(a, end - a);
    }
  }
}

}  // namespace

template <typename T>
PiecedExperts<T>::PiecedExperts(const StoredExperts& x, MemoryAccountant& mem, Collectives* comm,
                                int64_t expert_parallel, size_t piece_bytes)
    : mem_(mem), comm_(comm), sharded_(x.shards > 1), ep_(expert_parallel), x_(x) {
  if (sharded_ && (!comm_ || comm_->size() != x.shards))
    throw std::logic_error("sharded weights need the collectives of their group");
  local_ = x.experts / ep_;
  if (ep_ > 1 && (!sharded_ || comm_->size() % ep_ != 0 || x.experts % ep_ != 0))
    throw std::logic_error("expert parallelism needs weights sharded over a group it divides");
  n_[0] = 2 * x.expert_inter * x.hidden;
  n_[1] = x.hidden * x.expert_inter;
  for (int k = 0; k < 2; ++k) {
    full_stride_[k] = sharded_ ? comm_->padded_elems(n_[k]) : n_[k];
    shard_stride_[k] = sharded_ ? Collectives::shard_elems(n_[k], x.shards) : n_[k];
  }
  const size_t expert_bytes = static_cast<size_t>(full_stride_[0] + full_stride_[1]) * sizeof(T);
  per_piece_ = piece_bytes == 0 ? local_ : std::clamp<int64_t>(static_cast<int64_t>(piece_bytes / expert_bytes), 1, local_);
}

template <typename T>
typename PiecedExperts<T>::Expert PiecedExperts<T>::next(int64_t e) {
  const int64_t le = e, piece = le / per_piece_;
  if (piece != index_) advance(piece);
  return compute(mem_, [&] {
    const int64_t j = le - cur_.first;
    Expert x{};
    x.gate_up = cur_.w[0].empty() ? static_cast<const T*>(x_.gate_up.data) + le * n_[0]
                                  : ptr<T>(cur_.w[0]) + j * full_stride_[0];
    x.down = cur_.w[1].empty() ? static_cast<const T*>(x_.down.data) + le * n_[1]
                               : ptr<T>(cur_.w[1]) + j * full_stride_[1];
    if (x_.backward) {
      x.dgate_up = sharded_ ? ptr<float>(cur_.g[0]) + j * full_stride_[0] : grad(0) + le * n_[0];
      x.ddown = sharded_ ? ptr<float>(cur_.g[1]) + j * full_stride_[1] : grad(1) + le * n_[1];
    }
    return x;
  });
}

template <typename T>
void PiecedExperts<T>::finish() {
  scatter(cur_);
  drop(retiring_);
  drop(cur_);
  drop(ahead_);
}

// Completes a piece's transfers, then frees its buffers (a plain assignment would free them first).
template <typename T>
void PiecedExperts<T>::drop(Piece& q) {
  for (auto& r : q.requests) r.wait();
  q = {};
}

template <typename T>
typename PiecedExperts<T>::Piece PiecedExperts<T>::start_weights(int64_t piece) {
  Piece q;
  q.first = piece * per_piece_;
  q.count = std::min(per_piece_, local_ - q.first);
  for (int k = 0; k < 2; ++k) {
    const TensorView& src = weight(k);
    if (!sharded_ && src.dtype == dtype_of<T>()) continue;
    const size_t src_elem = dtype_size(src.dtype);
    // Expert parallel: the all-to-all moves the storage dtype, converted in place to T when the piece arrives.
    const size_t elem = ep_ > 1 ? std::max(src_elem, sizeof(T)) : sizeof(T);
    q.w[k] = mem_.allocate(static_cast<size_t>(q.count * full_stride_[k]) * elem, MemCategory::WeightCasts,
                           k ? "expert_piece:down_proj" : "expert_piece:gate_up_proj");
    q.convert[k] = ep_ > 1 && src.dtype != dtype_of<T>();
    compute(mem_, [&] {
      if (ep_ > 1) {
        const int64_t G = comm_->size(), s = shard_stride_[k];
        for (int64_t j = 0; j < q.count; ++j) {
          std::vector<int64_t> counts(static_cast<size_t>(G), s), sd, rd;
          for (int64_t r = 0; r < G; ++r) {
            sd.push_back(((r % ep_) * local_ + q.first + j) * s);
            rd.push_back(r * s);
          }
          char* to = static_cast<char*>(q.w[k].data()) + static_cast<size_t>(j * full_stride_[k]) * src_elem;
          q.requests.push_back(comm_->start_all_to_all_v(src.data, counts, sd, to, counts, rd, src_elem));
        }
        return;
      }
      if (!sharded_) {  // the piece's experts are contiguous in both: one cast (one parallel pass) for all of them
        const char* from = static_cast<const char*>(src.data) + q.first * n_[k] * src_elem;
        convert_elements(from, src.dtype, q.w[k].data(), dtype_of<T>(), q.count * n_[k]);
        return;
      }
      for (int64_t j = 0; j < q.count; ++j) {
        const char* from = static_cast<const char*>(src.data) + (q.first + j) * shard_stride_[k] * src_elem;
        T* to = ptr<T>(q.w[k]) + j * full_stride_[k];
        q.requests.push_back(comm_->start_all_gather(TensorView(const_cast<char*>(from), src.dtype, {shard_stride_[k]}),
                                                     to, dtype_of<T>(), n_[k]));
      }
    });
  }
  return q;
}

// Starts the reduce-scatter of a finished piece's gradients and keeps it in flight as retiring_ (the one before it is
// completed and freed first).
template <typename T>
void PiecedExperts<T>::scatter(Piece& q) {
  for (int k = 0; k < 2; ++k) q.w[k].reset();
  drop(retiring_);
  if (!x_.backward || !sharded_) return;
  compute(mem_, [&] {
    for (int k = 0; k < 2; ++k)
      for (int64_t j = 0; j < q.count; ++j) {
        float* full = ptr<float>(q.g[k]) + j * full_stride_[k];
        if (ep_ > 1) {
          // Rank r's block is the gradient of the expert r owns: it goes into this rank's shard of that expert.
          std::vector<float*> dest;
          for (int64_t r = 0; r < comm_->size(); ++r)
            dest.push_back(grad(k) + ((r % ep_) * local_ + q.first + j) * shard_stride_[k]);
          q.requests.push_back(comm_->start_reduce_scatter_to(full, n_[k], std::move(dest)));
        } else {
          q.requests.push_back(comm_->start_reduce_scatter(full, n_[k], grad(k) + (q.first + j) * shard_stride_[k]));
        }
      }
  });
  retiring_ = std::move(q);
}

template <typename T>
void PiecedExperts<T>::advance(int64_t piece) {
  // Expert weights cast (or, sharded, gathered) piece by piece.
  profile::Scope profile_scope(sharded_ ? profile::Phase::Communication : profile::Phase::Elementwise,
                               "expert_weight_pieces");
  if (piece != index_ + 1) throw std::logic_error("moe: experts visited out of order");
  if (index_ >= 0) scatter(cur_);
  cur_ = index_ >= 0 && sharded_ ? std::move(ahead_) : start_weights(piece);
  for (auto& r : cur_.requests) r.wait();
  cur_.requests.clear();
  compute(mem_, [&] {
    for (int k = 0; k < 2; ++k)
      if (cur_.convert[k])
        convert_in_place(cur_.w[k].data(), weight(k).dtype, dtype_of<T>(), cur_.count * full_stride_[k]);
  });
  index_ = piece;
  if (sharded_ && (piece + 1) * per_piece_ < local_) ahead_ = start_weights(piece + 1);
  if (x_.backward && sharded_)
    for (int k = 0; k < 2; ++k)
      cur_.g[k] = mem_.allocate_n<float>(static_cast<size_t>(cur_.count * full_stride_[k]), MemCategory::Gradients,
                                         k ? "expert_piece_grad:down_proj" : "expert_piece_grad:gate_up_proj", true);
}

template class PiecedExperts<float>;
template class PiecedExperts<bf16>;

}  // namespace hs::distributed
