#include "core/tensor.h"

namespace hs {

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

TensorView TensorView::operator[](int64_t i) const {
  if (shape.empty() || i < 0 || i >= shape[0])
    throw std::out_of_range("index " + std::to_string(i) + " out of range for shape " + shape_str(shape));
  char* p = static_cast<char*>(data);
  if (p) p += static_cast<ptrdiff_t>(i * strides[0] * static_cast<int64_t>(dtype_size(dtype)));
  return TensorView(p, dtype, Shape(shape.begin() + 1, shape.end()), Shape(strides.begin() + 1, strides.end()));
}

TensorView TensorView::reshape(Shape s) const {
  if (!is_contiguous()) throw std::logic_error("reshape of a non-contiguous view");
  if (hs::numel(s) != numel())
    throw std::invalid_argument("cannot reshape " + shape_str(shape) + " to " + shape_str(s));
  return TensorView(data, dtype, std::move(s));
}

Tensor Tensor::empty(MemoryAccountant& mem, MemCategory cat, DType t, Shape s, std::string_view tag) {
  Tensor r;
  r.buf_ = mem.allocate(static_cast<size_t>(hs::numel(s)) * dtype_size(t), cat, tag);
  r.view_ = TensorView(r.buf_.data(), t, std::move(s));
  return r;
}

Tensor Tensor::zeros(MemoryAccountant& mem, MemCategory cat, DType t, Shape s, std::string_view tag) {
  Tensor r;
  r.buf_ = mem.allocate(static_cast<size_t>(hs::numel(s)) * dtype_size(t), cat, tag, /*zero=*/true);
  r.view_ = TensorView(r.buf_.data(), t, std::move(s));
  return r;
}

}  // namespace hs
