#include "train/evaluate.h"

#include <algorithm>
#include <cmath>

#include "train/data.h"
#include "train/schedule.h"

namespace hs::train {

EvalResult evaluate_tokens(const model::ParamSet& params, const dataset::TokenSource& tokens, int64_t seq,
                           int64_t batch, DType compute, MemoryAccountant& mem, int64_t max_batches,
                           Collectives* shards, Packing packing) {
  EvalResult r;
  double sum = 0;
  int64_t n = eval_batch_count(tokens.size(), seq, batch);
  if (max_batches >= 0) n = std::min(n, max_batches);
  for (int64_t i = 0; i < n; ++i) {
    const TokenBatch tb = eval_batch(tokens, seq, batch, i, packing);
    Batch b{tb.inputs.data(), tb.targets.data(), tb.batch, tb.seq, tb.positions_or_null()};
    StepResult s = forward_only(params, b, compute, mem, nullptr, shards);
    sum += s.ce_sum;
    r.count += s.count;
    for (int32_t t : tb.targets)
      if (t >= 0) r.text_bytes += tokens.text_bytes(t);
  }
  r.ce = r.count ? sum / static_cast<double>(r.count) : 0.0;
  r.bits_per_byte = r.text_bytes ? sum / std::log(2.0) / static_cast<double>(r.text_bytes) : 0.0;
  return r;
}

}  // namespace hs::train
