// A checkpoint's weights for inference, used where they lie whenever they can be: every stacked tensor whose layers
// are each one contiguous span of a file tensor stored in the dtype asked for is memory-mapped in place, native
// scanned ([block][local] stacks: one span per stack) and native unscanned or Hugging Face (per-layer tensors: one
// span per layer, the decoder's per-layer views point into the map) alike, single file or sharded. No copy, no
// conversion; resident memory is the pages decoding reads (file pages, outside the MemoryAccountant).
// A tensor is loaded into memory (MemCategory::Parameters) and converted only when it must be: another dtype than
// asked (--weight-dtype, or A_log / dt_bias, which the engine keeps in fp32, stored in bf16), a layer assembled from
// several file tensors or rows (Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba, its per-expert gate_proj /
// up_proj / down_proj fused into [E, 2I, H] / [E, H, I]), or a misaligned span. notes names each copied tensor and why.
//
// WeightsMemory::Copy reads every tensor but the embedding table once into anonymous memory of the engine's own
// (MemCategory::Parameters, 2 MiB-aligned buffers advised MADV_HUGEPAGE: core/memory.cpp), still in the dtype asked
// for (bf16 stays bf16), dropping the file pages as it goes: resident memory is still about the weights plus the
// caches, the streamed ones now in the accountant. The embedding stays mapped where it can (a step reads a row of it
// per sequence: nothing to stream, and a copy would add all of it to the resident set). Decode streams its weights
// faster from huge pages: the LM head's product (248320 x 2048 bf16, 2 threads) ran 10-18% faster than from the file
// mapping's 4 KiB page-cache pages, a plain read about 40% faster (bench/weight_pages_bench.cpp), a real-width decode
// step took about 20% less CPU time (bench/decode_step_bench.cpp). Auto copies when the weights fit comfortably in
// the memory available now (auto_copies).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/convert.h"
#include "core/memory.h"
#include "kernels/quant.h"
#include "model/params.h"

namespace hs::gguf {
class GgufReader;
}

namespace hs::infer {

enum class WeightsMemory { Map, Copy, Auto };
const char* weights_memory_name(WeightsMemory m);
// "map" | "copy" | "auto"; throws std::invalid_argument otherwise.
WeightsMemory parse_weights_memory(const std::string& s);
// The memory this process may still take: MemAvailable of /proc/meminfo, or less where a cgroup limit (a container) leaves
// less; 0 when unknown.
uint64_t available_memory_bytes();
// Auto's choice: copy when the weights plus a 1 GiB margin take at most half of the available memory (the rest stays
// for the caches, the workspace, the page cache and other processes); map when the available memory is unknown.
bool auto_copies(uint64_t weight_bytes, uint64_t available_bytes);

// A matrix kept in a GGUF file's quantized blocks, used where it lies in the mapped file: `rows` rows of `cols`
// elements, each row_bytes = ggml_row_bytes(type, cols) bytes, row r at data + r * row_bytes ([rows, cols] as the
// engine's [out, in] matrices are; a stacked expert tensor [E, F, cols] is E * F rows).
struct QuantMatrix {
  kernels::GgmlType type = kernels::GgmlType::Q8_0;
  const uint8_t* data = nullptr;
  int64_t rows = 0, cols = 0, row_bytes = 0;
  std::string name;  // the GGUF tensor
  // Columns stored in another order (Qwen3.5's V heads in the GDN's out projection): when col_hk > 0, native column
  // group h (col_block columns each; h = g * col_r + j) is the file's group j * col_hk + g, so the product takes its
  // activations permuted into the file's order.
  int64_t col_hk = 0, col_r = 0, col_block = 0;
  const uint8_t* row(int64_t r) const { return data + r * row_bytes; }
};
// The decoder's matrices that stay quantized (the rest of the model is in the ParamSet, converted to fp32; a
// quantized matrix's ParamSet view has no data). parts[i] of a layer is spec i's (layer_specs order): empty when the
// spec is not quantized, one matrix, or for the routed experts' gate_up two ([E, I, H] gate then up, when the file
// stores them apart; one [E, 2I, H] when fused).
struct QuantLayer {
  std::vector<std::vector<QuantMatrix>> parts;
  const QuantMatrix* one(size_t spec) const { return parts.at(spec).empty() ? nullptr : &parts[spec][0]; }
};
struct QuantWeights {
  std::vector<QuantLayer> layers;           // by decoder layer index (Hugging Face order)
  std::optional<QuantMatrix> embed, lm_head;  // rows dequantized on lookup; the head's product on the blocks
  uint64_t bytes = 0;                        // the quantized blocks used (file pages, outside the accountant)
};

struct InferenceWeights {
  MemoryAccountant shapes{/*planning=*/true};  // the ParamSet's bookkeeping for the mapped tensors (no memory)
  std::unique_ptr<checkpoint::CheckpointReader> reader;  // keeps the mapping alive
  std::unique_ptr<model::ParamSet> params;
  bool mapped = false;           // every tensor in place (nothing copied)
  uint64_t mapped_bytes = 0;     // bytes used in place from the files
  uint64_t copied_bytes = 0;     // bytes loaded into memory (in the accountant, MemCategory::Parameters)
  WeightsMemory memory = WeightsMemory::Map;  // as resolved: Map (in place where possible) or Copy (all copied)
  std::vector<std::string> notes;  // why tensors were copied, skipped tensors
  // A GGUF model read quantized (load_gguf_weights): the mapped file, the matrices used in its blocks, and the
  // converted tensors' memory (MemCategory::Parameters).
  std::unique_ptr<gguf::GgufReader> gguf;
  std::unique_ptr<QuantWeights> quant;
  std::vector<Buffer> owned;
  ~InferenceWeights();
};

// The dtype of the checkpoint's matrices as stored (the embedding's): F32 or BF16.
DType stored_weight_dtype(const checkpoint::CheckpointDir& d);

// dtype: the weights' dtype in memory (nullopt: as stored); how: where they live (Map: in place where possible, Copy:
// all in memory, Auto: auto_copies). Throws what open/load throw for a corrupt checkpoint.
std::unique_ptr<InferenceWeights> load_weights(const checkpoint::CheckpointDir& d, std::optional<DType> dtype,
                                               MemoryAccountant& mem, WeightsMemory how = WeightsMemory::Map);

// A .gguf model for decoding without dequantizing its matrices: every linear weight of the decoder stored in a
// quantized type the products take (kernels::quant_gemv_supports) -- attention q/k/v/o, the Gated DeltaNet
// projections, the dense or shared MLP, the routed experts, the LM head -- and the embedding stays in the mapped
// file's blocks (QuantWeights); the rest (norms, A_log, dt_bias, conv taps, the router, the shared expert's gate, and
// matrices stored as F32/F16/BF16, Qwen3-Next's ssm_ba) is converted to fp32 into memory (MemCategory::Parameters;
// notes name them). Qwen3.5's V-head order (k_heads != v_heads): the qkv and z projections' rows are copied, still
// quantized, into native order (MemCategory::Parameters); the out projection stays in place and its activations are
// permuted instead (QuantMatrix::col_hk). Decode with compute fp32 through Decoder(..., quant).
std::unique_ptr<InferenceWeights> load_gguf_weights(const std::string& path, MemoryAccountant& mem);

}  // namespace hs::infer
