#include "distributed/weights.h"

#include <stdexcept>

#include "core/compute.h"
#include "core/profile.h"

namespace hs::distributed {

template <typename S, typename D> void cast(const S* src, D* dst, int64_t n) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "cast");
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) dst[i] = from_f32<D>(to_f32(src[i]));
}

template <typename T>
Converted<T> as_type(const TensorView& t, MemoryAccountant& mem, MemCategory cat, const char* tag) {
  Converted<T> c;
  if (t.dtype == dtype_of<T>()) {
    c.ptr = static_cast<const T*>(t.data);
    return c;
  }
  c.owned = mem.allocate_n<T>(static_cast<size_t>(t.numel()), cat, tag);
  c.ptr = c.owned.template as<T>();
  compute(mem, [&] {
    if (t.dtype == DType::F32) cast(static_cast<const float*>(t.data), c.owned.template as<T>(), t.numel());
    else cast(static_cast<const bf16*>(t.data), c.owned.template as<T>(), t.numel());
  });
  return c;
}

template <typename T>
ComputeWeights<T> start_compute_weights(const std::vector<WeightSource>& w, int64_t shards, MemoryAccountant& mem,
                                        Collectives* comm) {
  ComputeWeights<T> cw;
  for (const WeightSource& src : w) {
    const TensorView& t = *src.t;
    if (src.use == WeightSource::Use::Skip) {
      cw.ptr.push_back(nullptr);
      continue;
    }
    const bool matrix = src.use == WeightSource::Use::Matrix;
    if (shards > 1) {
      if (!comm || comm->size() != shards) throw std::logic_error("sharded weights need the collectives of their group");
      const DType to = matrix ? dtype_of<T>() : DType::F32;
      const int64_t n = t.numel();
      Buffer full = mem.allocate(static_cast<size_t>(comm->padded_elems(n)) * dtype_size(to), MemCategory::WeightCasts,
                                 "gathered:" + *src.name);
      cw.pending.push_back(comm->start_all_gather(t, full.data(), to, n));
      cw.ptr.push_back(full.data());
      cw.owned.push_back(std::move(full));
      continue;
    }
    if (matrix) {
      Converted<T> m = as_type<T>(t, mem, MemCategory::WeightCasts, ("cast:" + *src.name).c_str());
      cw.ptr.push_back(m.ptr);
      if (!m.owned.empty()) cw.owned.push_back(std::move(m.owned));
    } else {
      Converted<float> v = as_type<float>(t, mem, MemCategory::WeightCasts, "weight_cast");
      cw.ptr.push_back(v.ptr);
      if (!v.owned.empty()) cw.owned.push_back(std::move(v.owned));
    }
  }
  return cw;
}

#define HS_INSTANTIATE(T)                                                                                 \
  template Converted<T> as_type<T>(const TensorView&, MemoryAccountant&, MemCategory, const char*);         \
  template ComputeWeights<T> start_compute_weights<T>(const std::vector<WeightSource>&, int64_t, MemoryAccountant&, \
                                                      Collectives*);
HS_INSTANTIATE(float)
HS_INSTANTIATE(bf16)
#undef HS_INSTANTIATE

#define HS_INSTANTIATE2(S, D) template void cast<S, D>(const S*, D*, int64_t);
HS_INSTANTIATE2(float, float)
HS_INSTANTIATE2(float, bf16)
HS_INSTANTIATE2(bf16, float)
HS_INSTANTIATE2(bf16, bf16)
#undef HS_INSTANTIATE2

}  // namespace hs::distributed
