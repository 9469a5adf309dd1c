// A checkpoint's weights for inference. A native scanned checkpoint whose tensors are stored in the dtype asked for
// is used where it lies, memory-mapped: no copy, no conversion, and resident memory is the pages decoding reads (the
// mapped bytes are file pages, outside the MemoryAccountant). Any other checkpoint (Hugging Face, unscanned, another
// dtype) is loaded into memory (MemCategory::Parameters), each tensor converted.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/convert.h"
#include "core/memory.h"
#include "model/params.h"

namespace hs::infer {

struct InferenceWeights {
  MemoryAccountant shapes{/*planning=*/true};  // the mapped ParamSet's bookkeeping (no memory)
  std::unique_ptr<checkpoint::CheckpointReader> reader;  // keeps the mapping alive
  std::unique_ptr<model::ParamSet> params;
  bool mapped = false;
  std::vector<std::string> notes;  // why a checkpoint was copied, skipped tensors
};

// The dtype of the checkpoint's matrices as stored (the embedding's): F32 or BF16.
DType stored_weight_dtype(const checkpoint::CheckpointDir& d);

// dtype: the weights' dtype in memory (nullopt: as stored). Throws what open/load throw for a corrupt checkpoint.
std::unique_ptr<InferenceWeights> load_weights(const checkpoint::CheckpointDir& d, std::optional<DType> dtype,
                                               MemoryAccountant& mem);

}  // namespace hs::infer
