#include "distributed/gradient_flights.h"

#include <utility>

#include "core/profile.h"

namespace hs::distributed {

void GradientFlights::retire(GradientFlight& f) {
  profile::Scope profile_scope(profile::Phase::Communication, "reduce_scatter_wait");
  for (auto& q : f.requests) q.wait();
  f.requests.clear();
  if (f.done) f.done();
  f = {};
}

void GradientFlights::submit(GradientFlight next) {
  retire(in_flight_);
  if (overlap_) in_flight_ = std::move(next);
  else retire(next);
}

}  // namespace hs::distributed
