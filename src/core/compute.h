// Whether a step's arithmetic runs: the one place that asks the accountant's mode. Kernels and the model code make
// their allocations (saved tensors, workspace) through the MemoryAccountant in either mode, then hand the arithmetic
// over those buffers to compute(mem, f). Over a planning accountant the buffers have no data and f is skipped; since
// nothing else depends on the mode, a plan makes exactly the allocations and frees of the real run, in its order.
#pragma once
#include <type_traits>

#include "core/memory.h"

namespace hs {

// f() and its result, or, in planning mode, a value-initialised result without calling f.
template <typename F> std::invoke_result_t<F&> compute(const MemoryAccountant& mem, F&& f) {
  if (mem.planning()) return std::invoke_result_t<F&>();
  return f();
}

}  // namespace hs
