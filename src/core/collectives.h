// Collectives of a data-parallel group, behind one small interface so the step schedule is the same for one
// process (LocalCollectives), for planning (VirtualCollectives: a group of any size, no data moves) and for MPI runs
// (src/mpi). Sharded tensors hold shard_elems(n, size) = ceil(n / size) elements per rank: rank r holds elements
// [r * shard, (r + 1) * shard) of the n, the last rank's tail past n is zero padding.
//
// Gathers and reduce-scatters are non-blocking: start_* returns a Request and the buffers must stay alive until its
// wait(). A caller that splits a big tensor into pieces (each piece sharded over the group on its own, so a piece's
// shard is contiguous on every rank) gathers or reduce-scatters a piece with the same calls on that piece's shard and
// full buffers, and bounds the memory by keeping a fixed window of Requests in flight (two: double buffering).
//
// Sums are in rank order (rank 0 + rank 1 + ...), whatever the transport, so a run is deterministic for a given
// group size.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/pending.h"
#include "core/tensor.h"

namespace hs {

class Collectives {
 public:
  // A started collective (core/pending.h): wait() completes it and rethrows the transport's error; destroying a
  // pending Request waits for it, so no buffer is freed under a transfer.
  using Request = Pending;

  explicit Collectives(int64_t size, int64_t rank = 0) : size_(size), rank_(rank) {}
  virtual ~Collectives() = default;
  int64_t size() const { return size_; }
  int64_t rank() const { return rank_; }
  static int64_t shard_elems(int64_t n, int64_t size) { return (n + size - 1) / size; }
  // Elements of a full buffer that gathers write and reduce-scatters read: n rounded up to a multiple of size.
  static int64_t padded_elems(int64_t n, int64_t size) { return shard_elems(n, size) * size; }
  int64_t padded_elems(int64_t n) const { return padded_elems(n, size_); }

  // full[0..n) (dtype `to`) = the concatenation of every rank's shard (converted from the shard's dtype, which is
  // shard.dtype; shard.data holds shard_elems(n, size) elements). full holds padded_elems(n) elements; the tail past
  // n is scratch.
  virtual Request start_all_gather(const TensorView& shard, void* full, DType to, int64_t n) = 0;
  // shard[0..shard_elems(n, size)) += this rank's slice of the sum over ranks of full[0..n). full holds
  // padded_elems(n) floats (the tail past n zero) and is overwritten.
  virtual Request start_reduce_scatter(float* full, int64_t n, float* shard) = 0;
  // A reduce-scatter whose slices land in places of the caller's choosing (expert parallelism: rank p's full[0..n) is
  // the gradient of an expert that may differ from rank to rank): dest[p][0..shard_elems(n, size)) += this rank's
  // slice of rank p's full[0..n), for p in rank order, so ranks that send to the same destination are summed in rank
  // order. full holds padded_elems(n) floats (the tail past n zero) and is overwritten; dest has size() entries.
  virtual Request start_reduce_scatter_to(float* full, int64_t n, std::vector<float*> dest) = 0;
  // All-to-all with counts per rank, in elements of elem_bytes (2, 4 or 8; moved, never reduced): this rank's
  // send[send_displs[q] ..+ send_counts[q]) goes to rank q, and rank p's block for this rank lands at
  // recv[recv_displs[p] ..+ recv_counts[p]). The token rows of expert parallelism and the owners' expert weights.
  // Every vector has size() entries; send and recv do not overlap.
  virtual Request start_all_to_all_v(const void* send, std::vector<int64_t> send_counts,
                                     std::vector<int64_t> send_displs, void* recv, std::vector<int64_t> recv_counts,
                                     std::vector<int64_t> recv_displs, size_t elem_bytes) = 0;
  void all_to_all_v(const void* send, std::vector<int64_t> send_counts, std::vector<int64_t> send_displs, void* recv,
                    std::vector<int64_t> recv_counts, std::vector<int64_t> recv_displs, size_t elem_bytes) {
    start_all_to_all_v(send, std::move(send_counts), std::move(send_displs), recv, std::move(recv_counts),
                       std::move(recv_displs), elem_bytes)
        .wait();
  }
  // Ranges of a flat sharded tensor (a big tensor in pieces whose bounds need not fall on shard bounds: the LM head
  // and the embedding in vocabulary pieces). For 0 <= begin <= end <= n, rank q holds the elements
  // [q * s, (q + 1) * s) of the n (s = shard_elems(n, size)); its part of the range is their intersection.
  //
  // out[0..end - begin) (dtype `to`) = elements [begin, end) of the tensor: each rank contributes its part (from
  // `shard`, this rank's shard_elems(n, size) elements, converted from shard.dtype). A rank may hold none of it.
  virtual Request start_all_gather_range(const TensorView& shard, int64_t n, int64_t begin, int64_t end, void* out,
                                         DType to) = 0;
  // This rank's part of the range in `shard` (its shard_elems(n, size) floats) += the sum over ranks of their
  // full[0..end - begin) (each rank's contribution to elements [begin, end)), in rank order per element
  // (shard + rank 0 + rank 1 + ..., as start_reduce_scatter). full is only read. scratch: the caller's
  // range_scratch_elems(end - begin) floats (so that its memory can be accounted), used until wait().
  virtual Request start_reduce_scatter_range(const float* full, int64_t n, int64_t begin, int64_t end, float* shard,
                                             float* scratch) = 0;
  // The reduce-scatter of a range receives every rank's contribution to this rank's part in rounds of
  // max(1, len / size) elements from each rank, so its receive buffer is about the range's size whatever the part:
  // size * max(1, len / size) floats; none for a group of one.
  int64_t range_scratch_elems(int64_t len) const {
    return size_ > 1 ? size_ * std::max<int64_t>(1, len / size_) : 0;
  }
  // Rank q's part of [begin, end): [first, first + count) of the tensor (count 0 when it holds none of it).
  struct RangePart {
    int64_t first = 0, count = 0;
  };
  static RangePart range_part(int64_t n, int64_t size, int64_t q, int64_t begin, int64_t end) {
    const int64_t s = shard_elems(n, size);
    const int64_t lo = std::max(begin, q * s), hi = std::min(end, (q + 1) * s);
    return hi > lo ? RangePart{lo, hi - lo} : RangePart{std::min(std::max(begin, q * s), end), 0};
  }

  void all_gather(const TensorView& shard, void* full, DType to, int64_t n) { start_all_gather(shard, full, to, n).wait(); }
  void reduce_scatter(float* full, int64_t n, float* shard) { start_reduce_scatter(full, n, shard).wait(); }

  // In place: x[i] = the sum over ranks of x[i] (loss, token counts, squared norms, router statistics).
  virtual void all_reduce_sum(double* x, int64_t n) = 0;
  double all_reduce_sum(double x) {
    all_reduce_sum(&x, 1);
    return x;
  }
  // In place, fp32 (the gradient shards of data-parallel replicas), through `scratch`: all_reduce_scratch_elems(n)
  // floats of the caller's (so that its memory can be accounted). Without scratch the backend allocates it.
  virtual void all_reduce_sum(float* x, int64_t n, float* scratch) = 0;
  void all_reduce_sum(float* x, int64_t n);
  int64_t all_reduce_scratch_elems(int64_t n) const { return size_ > 1 ? padded_elems(n) + shard_elems(n, size_) : 0; }
  // Rank `root`'s bytes to every rank.
  virtual void broadcast(void* data, size_t bytes, int64_t root) = 0;

  // Seconds the calling thread spent blocked on this group's communication (inside wait() and the blocking calls)
  // since the group was made: the communication that computation did not hide.
  virtual double exposed_seconds() const { return 0; }

 private:
  int64_t size_, rank_;
};

// A group of one: gathers are dtype conversions, reduce-scatters are adds.
class LocalCollectives final : public Collectives {
 public:
  LocalCollectives() : Collectives(1) {}
  using Collectives::all_reduce_sum;
  Request start_all_gather(const TensorView& shard, void* full, DType to, int64_t n) override;
  Request start_reduce_scatter(float* full, int64_t n, float* shard) override;
  Request start_reduce_scatter_to(float* full, int64_t n, std::vector<float*> dest) override;
  Request start_all_gather_range(const TensorView& shard, int64_t n, int64_t begin, int64_t end, void* out,
                                 DType to) override;
  Request start_reduce_scatter_range(const float* full, int64_t n, int64_t begin, int64_t end, float* shard,
                                     float* scratch) override;
  Request start_all_to_all_v(const void* send, std::vector<int64_t> send_counts, std::vector<int64_t> send_displs,
                             void* recv, std::vector<int64_t> recv_counts, std::vector<int64_t> recv_displs,
                             size_t elem_bytes) override;
  void all_reduce_sum(double*, int64_t) override {}
  void all_reduce_sum(float*, int64_t, float*) override {}
  void broadcast(void*, size_t, int64_t) override {}
};

// Planning: a group of `size` ranks whose buffers are virtual; nothing is touched.
class VirtualCollectives final : public Collectives {
 public:
  explicit VirtualCollectives(int64_t size) : Collectives(size) {}
  using Collectives::all_reduce_sum;
  Request start_all_gather(const TensorView&, void*, DType, int64_t) override { return {}; }
  Request start_reduce_scatter(float*, int64_t, float*) override { return {}; }
  Request start_reduce_scatter_to(float*, int64_t, std::vector<float*>) override { return {}; }
  Request start_all_gather_range(const TensorView&, int64_t, int64_t, int64_t, void*, DType) override { return {}; }
  Request start_reduce_scatter_range(const float*, int64_t, int64_t, int64_t, float*, float*) override { return {}; }
  Request start_all_to_all_v(const void*, std::vector<int64_t>, std::vector<int64_t>, void*, std::vector<int64_t>,
                             std::vector<int64_t>, size_t) override {
    return {};
  }
  void all_reduce_sum(double*, int64_t) override {}
  void all_reduce_sum(float*, int64_t, float*) override {}
  void broadcast(void*, size_t, int64_t) override {}
};

// dst[0..n) (dtype to) = src[0..n) (dtype from): a copy, or an fp32 <-> bf16 conversion.
void convert_elements(const void* src, DType from, void* dst, DType to, int64_t n);

}  // namespace hs
