// Held-out evaluation: the mean cross-entropy and bits per byte of a model over a token source (train --eval-every,
// hybridscan eval).
#pragma once
#include <cstdint>

#include "core/memory.h"
#include "dataset/token_source.h"
#include "model/params.h"
#include "train/schedule.h"

namespace hs::train {

// Cross-entropy over `tokens` cut into windows of seq+1 that overlap by one token: the mean in nats per predicted
// token, their count, the bytes of original text they stand for, and bits per byte = total nats / ln 2 / those bytes.
// Sharded parameters: `shards` is their group, whose ranks all evaluate the same windows. `packing`: the windows'
// (train::eval_batch).
struct EvalResult {
  double ce = 0;
  int64_t count = 0, text_bytes = 0;
  double bits_per_byte = 0;
};
EvalResult evaluate_tokens(const model::ParamSet& params, const dataset::TokenSource& tokens, int64_t seq,
                           int64_t batch, DType compute, MemoryAccountant& mem, int64_t max_batches = -1,
                           Collectives* shards = nullptr, Packing packing = Packing::Stream);

}  // namespace hs::train
