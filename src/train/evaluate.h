// Held-out evaluation: the mean cross-entropy and bits per byte of a model over a token source (train --eval-every,
// hybridscan eval).
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "core/memory.h"
#include "dataset/token_source.h"
#include "model/params.h"
#include "train/data.h"
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

// The held-out tokens of `train --eval-data PATH`, evaluated instead of a split-off tail of the training data: a
// token file (recognised by its HSTOKENS magic) or a text, in the ids of the training data. The training data is
// `train_data` (its token file; "" for a text or random tokens) whose ids belong to `tokenizer` ("" when unknown or
// byte tokens; `byte_tokens` says which). A text is encoded by that tokenizer (bytes for byte tokens); a token file
// must carry the training token file's or the tokenizer's vocabulary fingerprint. Refused (std::invalid_argument,
// dataset::TokenFileError) when the ids would not be the training data's: a token file against byte tokens, a text
// against a token file whose tokenizer is unknown, another fingerprint.
// A chat file (.jsonl, as train --chat reads) is where chat evaluation plugs in: refused until chat training exists.
Tokens load_eval_tokens(const std::string& path, const std::string& train_data, const std::string& tokenizer,
                        bool byte_tokens, const ModelVocabulary& vocab);

}  // namespace hs::train
