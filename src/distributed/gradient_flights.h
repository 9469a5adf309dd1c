// How gradients leave a rank during a backward: started reduce-scatters into this rank's shards, and what is handed
// over once one has finished (update in backward: the optimizer's sink gets the completed shards). Overlapping, one
// hand-over stays in flight while the next backward computes and is finished when the next is submitted; otherwise
// each is finished at once.
#pragma once
#include <functional>
#include <vector>

#include "core/memory.h"
#include "core/pending.h"

namespace hs::distributed {

// One hand-over: the buffers its transfers read (full-size gradients, scratch), the shards they complete, what to
// call once they have, and the transfers (declared last, so destroying a flight finishes them before any buffer is
// freed).
struct GradientFlight {
  std::vector<Buffer> full;
  std::vector<Buffer> shards;
  std::function<void()> done;
  std::vector<Pending> requests;
};

class GradientFlights {
 public:
  explicit GradientFlights(bool overlap = false) : overlap_(overlap) {}
  void set_overlap(bool overlap) { overlap_ = overlap; }
  // Finishes the flight in the air (waits, calls done, frees its buffers), then keeps `next` in the air
  // (overlapping) or finishes it too.
  void submit(GradientFlight next);
  // Finishes whatever is in the air (the step's last gradients).
  void finish() { submit({}); }

 private:
  static void retire(GradientFlight& f);
  bool overlap_;
  GradientFlight in_flight_;
};

}  // namespace hs::distributed
