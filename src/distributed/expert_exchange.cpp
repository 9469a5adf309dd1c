#include "distributed/expert_exchange.h"

#include <vector>

namespace hs::distributed {

void CollectivesRowExchange::exchange_counts(const int64_t* rows, int64_t* received, int64_t experts) {
  const int64_t ranks = group_.size(), Xl = experts / ranks;
  std::vector<int64_t> each(static_cast<size_t>(ranks), Xl), at;
  for (int64_t q = 0; q < ranks; ++q) at.push_back(q * Xl);
  group_.all_to_all_v(rows, each, at, received, each, at, sizeof(int64_t));
}

namespace {
// Rows (row_elems elements of elem_bytes each) to their owners (out) or back to their senders.
Pending move_rows(Collectives& group, const kernels::ExpertRowRoutes& R, const void* send, void* recv, int64_t row,
                  size_t elem, bool out) {
  std::vector<int64_t> sc, sd, rc, rd;
  for (size_t q = 0; q < R.send_rows.size(); ++q) {
    sc.push_back((out ? R.send_rows[q] : R.recv_rows[q]) * row);
    sd.push_back((out ? R.send_first[q] : R.recv_first[q]) * row);
    rc.push_back((out ? R.recv_rows[q] : R.send_rows[q]) * row);
    rd.push_back((out ? R.recv_first[q] : R.send_first[q]) * row);
  }
  return group.start_all_to_all_v(send, sc, sd, recv, rc, rd, elem);
}
}  // namespace

Pending CollectivesRowExchange::start_dispatch(const kernels::ExpertRowRoutes& routes, const void* send, void* recv,
                                               int64_t row_elems, size_t elem_bytes) {
  return move_rows(group_, routes, send, recv, row_elems, elem_bytes, true);
}

Pending CollectivesRowExchange::start_combine(const kernels::ExpertRowRoutes& routes, const void* send, void* recv,
                                              int64_t row_elems, size_t elem_bytes) {
  return move_rows(group_, routes, send, recv, row_elems, elem_bytes, false);
}

}  // namespace hs::distributed
