// How a sub-layer's weights arrive in the compute dtype: cast from their storage dtype, or all-gathered from the
// shards of an FSDP group (converted on the way). The gathers start here and complete at ComputeWeights::wait(), so
// that the step schedule can start the next sub-layer's while this one computes (prefetch). The routed experts are
// not among them: they arrive piece by piece (distributed/expert_pieces.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/collectives.h"
#include "core/memory.h"
#include "core/tensor.h"

namespace hs::distributed {

// dst = convert(src): between storage types (fp32, bf16), in parallel.
template <typename S, typename D> void cast(const S* src, D* dst, int64_t n);

// A view of `t` as const T*, casting into a new buffer of category `cat` when the storage type differs.
template <typename T> struct Converted {
  Buffer owned;
  const T* ptr = nullptr;
};
template <typename T> Converted<T> as_type(const TensorView& t, MemoryAccountant& mem, MemCategory cat, const char* tag);

// One tensor of a sub-layer's weights and what its compute wants of it: a matrix in the compute dtype, a small
// vector in fp32, or nothing (skipped: a null pointer; the routed experts). `name` tags its buffers ("cast:<name>",
// "gathered:<name>").
struct WeightSource {
  enum class Use { Skip, Matrix, Vector };
  const TensorView* t;
  const std::string* name;
  Use use;
};

// A sub-layer's weights as the kernels want them: matrices in the compute dtype T, small vectors in fp32, in the
// order of their sources. Casts and all-gathered shards are temporaries of this sub-layer (MemCategory::WeightCasts);
// when the weights are unsharded and the storage dtype already matches, nothing is copied.
template <typename T> struct ComputeWeights {
  std::vector<Buffer> owned;
  std::vector<const void*> ptr;
  std::vector<Collectives::Request> pending;  // gathers still in flight; after `owned` so they finish first
  const T* mat(size_t i) const { return static_cast<const T*>(ptr[i]); }
  const float* vec(size_t i) const { return static_cast<const float*>(ptr[i]); }
  void wait() {
    for (auto& r : pending) r.wait();
    pending.clear();
  }
};

// Starts the gathers (shards > 1: every source is this rank's shard of a tensor sharded over `comm`, a group of
// `shards` ranks) or does the casts, and returns with the gathers in flight.
template <typename T>
ComputeWeights<T> start_compute_weights(const std::vector<WeightSource>& w, int64_t shards, MemoryAccountant& mem,
                                        Collectives* comm);

}  // namespace hs::distributed
