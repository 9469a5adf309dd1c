// A checkpoint's weights for inference, used where they lie whenever they can be: every stacked tensor whose layers
// are each one contiguous span of a file tensor stored in the dtype asked for is memory-mapped in place, native
// scanned ([block][local] stacks: one span per stack) and native unscanned or Hugging Face (per-layer tensors: one
// span per layer, the decoder's per-layer views point into the map) alike, single file or sharded. No copy, no
// conversion; resident memory is the pages decoding reads (file pages, outside the MemoryAccountant).
// A tensor is loaded into memory (MemCategory::Parameters) and converted only when it must be: another dtype than
// asked (--weight-dtype, or A_log / dt_bias, which the engine keeps in fp32, stored in bf16), a layer assembled from
// several file tensors or rows (Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba, its per-expert gate_proj /
// up_proj / down_proj fused into [E, 2I, H] / [E, H, I]), or a misaligned span. notes names each copied tensor and why.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/convert.h"
#include "core/memory.h"
#include "model/params.h"

namespace hs::infer {

struct InferenceWeights {
  MemoryAccountant shapes{/*planning=*/true};  // the ParamSet's bookkeeping for the mapped tensors (no memory)
  std::unique_ptr<checkpoint::CheckpointReader> reader;  // keeps the mapping alive
  std::unique_ptr<model::ParamSet> params;
  bool mapped = false;           // every tensor in place (nothing copied)
  uint64_t mapped_bytes = 0;     // bytes used in place from the files
  uint64_t copied_bytes = 0;     // bytes loaded into memory (in the accountant, MemCategory::Parameters)
  std::vector<std::string> notes;  // why tensors were copied, skipped tensors
};

// The dtype of the checkpoint's matrices as stored (the embedding's): F32 or BF16.
DType stored_weight_dtype(const checkpoint::CheckpointDir& d);

// dtype: the weights' dtype in memory (nullopt: as stored). Throws what open/load throw for a corrupt checkpoint.
std::unique_ptr<InferenceWeights> load_weights(const checkpoint::CheckpointDir& d, std::optional<DType> dtype,
                                               MemoryAccountant& mem);

}  // namespace hs::infer
