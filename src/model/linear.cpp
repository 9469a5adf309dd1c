#include "model/linear.h"

#include "kernels/matmul.h"

namespace hs::model {

template <typename T> void linear_forward(const T* x, const T* W, T* y, int64_t N, int64_t out, int64_t in) {
  kernels::matmul(x, W, y, N, out, in, false, true);
}

template <typename T>
void linear_backward(const T* x, const T* W, const float* dy, float* dx, float* dW, int64_t N, int64_t out, int64_t in,
                     MemoryAccountant& mem, bool accumulate_dx) {
  if constexpr (std::is_same_v<T, float>) {
    if (mem.planning()) return;
    if (dx) kernels::matmul(dy, W, dx, N, in, out, false, false, accumulate_dx);
    kernels::matmul(dy, x, dW, out, in, N, true, false, true);
  } else {
    Buffer dyc = mem.allocate_n<T>(static_cast<size_t>(N * out), MemCategory::Workspace, "linear.dy_cast");
    if (mem.planning()) return;
    cast(dy, dyc.as<T>(), N * out);
    if (dx) kernels::matmul(dyc.as<T>(), W, dx, N, in, out, false, false, accumulate_dx);
    kernels::matmul(dyc.as<T>(), x, dW, out, in, N, true, false, true);
  }
}

template <typename T> void add(const T* a, const T* b, T* y, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

void accumulate(const float* x, float* y, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

template <typename S, typename D>
void copy_columns(const S* src, int64_t src_cols, int64_t col, D* dst, int64_t rows, int64_t width) {
#pragma omp parallel for schedule(static) if (rows * width > 65536)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) dst[r * width + j] = from_f32<D>(to_f32(src[r * src_cols + col + j]));
}

template <typename S, typename D>
void scatter_columns(const S* src, int64_t rows, int64_t width, D* dst, int64_t dst_cols, int64_t col) {
#pragma omp parallel for schedule(static) if (rows * width > 65536)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) dst[r * dst_cols + col + j] = from_f32<D>(to_f32(src[r * width + j]));
}

template <typename S, typename D> void cast(const S* src, D* dst, int64_t n) {
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
  template void add<T>(const T*, const T*, T*, int64_t);                                                        \
  template Converted<T> as_type<T>(const TensorView&, MemoryAccountant&, MemCategory, const char*);
HS_INSTANTIATE(float)
HS_INSTANTIATE(bf16)
#undef HS_INSTANTIATE

#define HS_INSTANTIATE2(S, D)                                                                   \
  template void copy_columns<S, D>(const S*, int64_t, int64_t, D*, int64_t, int64_t);          \
  template void scatter_columns<S, D>(const S*, int64_t, int64_t, D*, int64_t, int64_t);       \
  template void cast<S, D>(const S*, D*, int64_t);
HS_INSTANTIATE2(float, float)
HS_INSTANTIATE2(float, bf16)
HS_INSTANTIATE2(bf16, float)
HS_INSTANTIATE2(bf16, bf16)
#undef HS_INSTANTIATE2

}  // namespace hs::model
