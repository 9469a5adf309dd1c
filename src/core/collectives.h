// Collectives of a data-parallel group, behind one small interface so the step schedule is the same for one
// process (LocalCollectives), for planning (VirtualCollectives: a group of any size, no data moves) and, later, for
// MPI/NCCL runs. Sharded tensors hold ceil(n / size) elements per rank.
#pragma once
#include <cstdint>
#include <memory>

#include "core/tensor.h"

namespace hs {

class Collectives {
 public:
  explicit Collectives(int64_t size) : size_(size) {}
  virtual ~Collectives() = default;
  int64_t size() const { return size_; }
  static int64_t shard_elems(int64_t n, int64_t size) { return (n + size - 1) / size; }
  // full[0..n) (dtype `to`) = the concatenation of every rank's shard (converted from the shard's dtype).
  virtual void all_gather(const TensorView& shard, void* full, DType to, int64_t n) = 0;
  // shard += this rank's slice of the sum over ranks of full[0..n).
  virtual void reduce_scatter(const float* full, int64_t n, float* shard) = 0;
  // Sum of a scalar over ranks (loss, token counts, squared gradient norms).
  virtual double all_reduce_sum(double x) = 0;

 private:
  int64_t size_;
};

// A group of one: gathers are dtype conversions, reduce-scatters are adds.
class LocalCollectives final : public Collectives {
 public:
  LocalCollectives() : Collectives(1) {}
  void all_gather(const TensorView& shard, void* full, DType to, int64_t n) override;
  void reduce_scatter(const float* full, int64_t n, float* shard) override;
  double all_reduce_sum(double x) override { return x; }
};

// Planning: a group of `size` ranks whose buffers are virtual; nothing is touched.
class VirtualCollectives final : public Collectives {
 public:
  explicit VirtualCollectives(int64_t size) : Collectives(size) {}
  void all_gather(const TensorView&, void*, DType, int64_t) override {}
  void reduce_scatter(const float*, int64_t, float*) override {}
  double all_reduce_sum(double x) override { return x; }
};

}  // namespace hs
