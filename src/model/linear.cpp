#include "model/linear.h"

#include "core/profile.h"
#include "kernels/matmul.h"

namespace hs::model {

template <typename T> void linear_forward(const T* x, const T* W, T* y, int64_t N, int64_t out, int64_t in) {
  kernels::matmul(x, W, y, N, out, in, false, true);
}

template <typename T>
void linear_backward_from(const T* x, const T* W, const T* dy, float* dx, float* dW, int64_t N, int64_t out, int64_t in,
                          bool accumulate_dx) {
  if (dx) kernels::matmul(dy, W, dx, N, in, out, false, false, accumulate_dx);
  kernels::matmul(dy, x, dW, out, in, N, true, false, true);
}

template <typename T>
void linear_backward(const T* x, const T* W, const float* dy, float* dx, float* dW, int64_t N, int64_t out, int64_t in,
                     MemoryAccountant& mem, bool accumulate_dx) {
  if constexpr (std::is_same_v<T, float>) {
    if (mem.planning()) return;
    linear_backward_from(x, W, dy, dx, dW, N, out, in, accumulate_dx);
  } else {
    Buffer dyc = mem.allocate_n<T>(static_cast<size_t>(N * out), MemCategory::Workspace, "linear.dy_cast");
    if (mem.planning()) return;
    cast(dy, dyc.as<T>(), N * out);
    linear_backward_from(x, W, dyc.as<T>(), dx, dW, N, out, in, accumulate_dx);
  }
}

template <typename T> void add(const T* a, const T* b, T* y, int64_t n) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "residual_add");
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

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
  if (mem.planning()) return c;
  if (t.dtype == DType::F32) cast(static_cast<const float*>(t.data), c.owned.template as<T>(), t.numel());
  else cast(static_cast<const bf16*>(t.data), c.owned.template as<T>(), t.numel());
  return c;
}

#define HS_INSTANTIATE(T)                                                                                     \
  template void linear_forward<T>(const T*, const T*, T*, int64_t, int64_t, int64_t);                           \
  template void linear_backward<T>(const T*, const T*, const float*, float*, float*, int64_t, int64_t, int64_t, \
                                   MemoryAccountant&, bool);                                                    \
  template void linear_backward_from<T>(const T*, const T*, const T*, float*, float*, int64_t, int64_t, int64_t,   \
                                        bool);                                                                  \
  template void add<T>(const T*, const T*, T*, int64_t);                                                        \
  template Converted<T> as_type<T>(const TensorView&, MemoryAccountant&, MemCategory, const char*);
HS_INSTANTIATE(float)
HS_INSTANTIATE(bf16)
#undef HS_INSTANTIATE

#define HS_INSTANTIATE2(S, D) template void cast<S, D>(const S*, D*, int64_t);
HS_INSTANTIATE2(float, float)
HS_INSTANTIATE2(float, bf16)
HS_INSTANTIATE2(bf16, float)
HS_INSTANTIATE2(bf16, bf16)
#undef HS_INSTANTIATE2

}  // namespace hs::model
