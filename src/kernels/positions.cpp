// The packed-document positions' rule (kernels/common.h), checked once where a batch enters the kernels.
#include <string>

#include "kernels/common.h"

namespace hs::kernels {

void check_positions(const int32_t* positions, int64_t batch, int64_t seq, const char* what) {
  if (!positions) return;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq; ++t) {
      const int32_t p = positions[b * seq + t];
      const int32_t want = t == 0 ? 0 : positions[b * seq + t - 1] + 1;
      if (p != 0 && p != want)
        throw std::invalid_argument(std::string(what) + ": document position " + std::to_string(p) + " at sequence " +
                                    std::to_string(b) + ", token " + std::to_string(t) + " should be 0 (a document start) or " +
                                    std::to_string(want) + " (the previous token's plus one); every sequence starts a document");
    }
}

}  // namespace hs::kernels
