// Expert parallelism's token exchange over a Collectives group: the implementation of the MoE kernel's
// kernels::ExpertRowExchange (the kernel decides which rows go where, this moves them by all-to-all).
#pragma once
#include <cstdint>
#include <optional>

#include "core/collectives.h"
#include "kernels/moe.h"

namespace hs::distributed {

class CollectivesRowExchange final : public kernels::ExpertRowExchange {
 public:
  explicit CollectivesRowExchange(Collectives& group) : group_(group) {}
  int64_t ranks() const override { return group_.size(); }
  void exchange_counts(const int64_t* rows, int64_t* received, int64_t experts) override;
  Pending start_dispatch(const kernels::ExpertRowRoutes& routes, const void* send, void* recv, int64_t row_elems,
                         size_t elem_bytes) override;
  Pending start_combine(const kernels::ExpertRowRoutes& routes, const void* send, void* recv, int64_t row_elems,
                        size_t elem_bytes) override;

 private:
  Collectives& group_;
};

// The exchange a layer's MoE kernel gets: over `group` when it has more than one rank, none otherwise (the
// single-rank path: no expert parallelism).
class TokenExchange {
 public:
  explicit TokenExchange(Collectives* group) {
    if (group && group->size() > 1) exchange_.emplace(*group);
  }
  kernels::ExpertRowExchange* get() { return exchange_ ? &*exchange_ : nullptr; }

 private:
  std::optional<CollectivesRowExchange> exchange_;
};

}  // namespace hs::distributed
