// Tensor views (non-owning: data, dtype, shape, strides in elements) and owning tensors whose storage
// is a Buffer from the memory accountant.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/memory.h"

namespace hs {

using Shape = std::vector<int64_t>;

inline int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}
std::string shape_str(const Shape& s);
Shape contiguous_strides(const Shape& s);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  Shape shape;
  Shape strides;

  TensorView() = default;
  TensorView(void* d, DType t, Shape s) : data(d), dtype(t), shape(std::move(s)), strides(contiguous_strides(shape)) {}
  TensorView(void* d, DType t, Shape s, Shape st) : data(d), dtype(t), shape(std::move(s)), strides(std::move(st)) {}

  int64_t dim() const { return static_cast<int64_t>(shape.size()); }
  int64_t size(int64_t i) const { return shape.at(static_cast<size_t>(i < 0 ? i + dim() : i)); }
  int64_t numel() const { return hs::numel(shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const { return strides == contiguous_strides(shape); }

  template <typename T> T* as() const {
    if (dtype_of<T>() != dtype) throw std::logic_error("tensor dtype is " + std::string(dtype_name(dtype)));
    return static_cast<T*>(data);
  }
  // Sub-tensor i along the leading axis (a view; the layout of the rest is kept).
  TensorView operator[](int64_t i) const;
  // The same memory with another contiguous shape of the same element count.
  TensorView reshape(Shape s) const;
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(MemoryAccountant& mem, MemCategory cat, DType t, Shape s, std::string_view tag);
  static Tensor zeros(MemoryAccountant& mem, MemCategory cat, DType t, Shape s, std::string_view tag);
  // A view of memory the tensor does not own (a memory-mapped checkpoint); defined() is false.
  static Tensor borrowed(TensorView v) {
    Tensor r;
    r.view_ = std::move(v);
    return r;
  }

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  template <typename T> T* as() const { return view_.as<T>(); }
  void* data() const { return view_.data; }
  DType dtype() const { return view_.dtype; }
  const Shape& shape() const { return view_.shape; }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return view_.nbytes(); }
  bool defined() const { return !buf_.empty(); }
  void reset() { buf_.reset(); view_ = TensorView(); }

 private:
  Buffer buf_;
  TensorView view_;
};

}  // namespace hs
