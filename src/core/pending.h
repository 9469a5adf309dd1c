// A started operation that completes later: a collective (Collectives::Request), a move of token rows between ranks
// (kernels::ExpertRowExchange). Nothing here knows what the operation is.
#pragma once
#include <functional>
#include <utility>

namespace hs {

// wait() completes it, including the local part that follows a transfer (the rank-order sum of a reduce-scatter),
// and rethrows the transport's error. Destroying a pending one waits for it (errors are then dropped: this only
// happens while an earlier error unwinds the step) so no buffer is freed under a transfer.
class Pending {
 public:
  Pending() = default;
  explicit Pending(std::function<void()> finish) : finish_(std::move(finish)) {}
  Pending(Pending&& o) noexcept : finish_(std::move(o.finish_)) { o.finish_ = nullptr; }
  Pending& operator=(Pending&& o) noexcept;
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  ~Pending() { wait_quietly(); }
  void wait();
  bool pending() const { return static_cast<bool>(finish_); }

 private:
  void wait_quietly() noexcept;
  std::function<void()> finish_;
};

}  // namespace hs
