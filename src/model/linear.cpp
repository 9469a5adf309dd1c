#include "model/linear.h"

#include "core/compute.h"
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
    compute(mem, [&] { linear_backward_from(x, W, dy, dx, dW, N, out, in, accumulate_dx); });
  } else {
    Buffer dyc = mem.allocate_n<T>(static_cast<size_t>(N * out), MemCategory::Workspace, "linear.dy_cast");
    compute(mem, [&] {
      cast(dy, dyc.as<T>(), N * out);
      linear_backward_from(x, W, dyc.as<T>(), dx, dW, N, out, in, accumulate_dx);
    });
  }
}

template <typename T> void add(const T* a, const T* b, T* y, int64_t n) {
  profile::Scope profile_scope(profile::Phase::Elementwise, "residual_add");
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

#define HS_INSTANTIATE(T)                                                                                     \
  template void linear_forward<T>(const T*, const T*, T*, int64_t, int64_t, int64_t);                           \
  template void linear_backward<T>(const T*, const T*, const float*, float*, float*, int64_t, int64_t, int64_t, \
                                   MemoryAccountant&, bool);                                                    \
  template void linear_backward_from<T>(const T*, const T*, const T*, float*, float*, int64_t, int64_t, int64_t,   \
                                        bool);                                                                  \
  template void add<T>(const T*, const T*, T*, int64_t);
HS_INSTANTIATE(float)
HS_INSTANTIATE(bf16)
#undef HS_INSTANTIATE

}  // namespace hs::model
