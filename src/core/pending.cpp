#include "core/pending.h"

namespace hs {

Pending& Pending::operator=(Pending&& o) noexcept {
  if (this != &o) {
    wait_quietly();
    finish_ = std::move(o.finish_);
    o.finish_ = nullptr;
  }
  return *this;
}

void Pending::wait() {
  if (!finish_) return;
  std::function<void()> f = std::move(finish_);
  finish_ = nullptr;
  f();
}

void Pending::wait_quietly() noexcept {
  try {
    wait();
  } catch (...) {
  }
}

}  // namespace hs
