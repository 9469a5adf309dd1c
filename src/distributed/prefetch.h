// Prefetching the weights of a step's calls: the calls are known in order up front (sub-layer indices, forward and
// recomputation and backward), so when call k takes its weights, call k+1's are started (their gathers run while k
// computes). W is what starting gives (a ComputeWeights with its gathers in flight).
#pragma once
#include <cstddef>
#include <stdexcept>
#include <utility>
#include <vector>

namespace hs::distributed {

template <typename W> class InOrderPrefetch {
 public:
  // The calls in the order they will take their weights.
  std::vector<size_t> calls;

  // Call i's weights (the next of `calls`), the call after it started by start(its index).
  template <typename Start> W take(size_t i, Start&& start) {
    if (next_ >= calls.size() || calls[next_] != i) throw std::logic_error("prefetch: weights taken out of order");
    W w = have_ahead_ ? std::move(ahead_) : start(i);
    have_ahead_ = ++next_ < calls.size();
    if (have_ahead_) ahead_ = start(calls[next_]);
    return w;
  }

 private:
  size_t next_ = 0;
  W ahead_;
  bool have_ahead_ = false;
};

}  // namespace hs::distributed
