// Ahead-of-time memory planning: the engine's own step schedule run over shapes only (a planning-mode
// MemoryAccountant and virtual collectives), for any model, cluster size and remat policy. The plan cannot drift from
// what the engine does because it is what the engine does, minus the arithmetic.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "core/memory.h"
#include "model/config.h"
#include "train/schedule.h"

namespace hs::planner {

struct PlanRequest {
  model::ModelConfig model;
  int64_t devices = 1;
  int64_t fsdp = 0;              // shards of parameters/gradients/optimizer state; 0: all devices
  int64_t batch_per_device = 1;
  int64_t seq = 1024;
  DType weight_dtype = DType::F32;
  DType moment_dtype = DType::F32;  // AdamW moments (OptimizerConfig::moment_dtype)
  bool update_in_backward = false;  // AdamW per gradient shard in the backward (train::Step)
  int64_t grad_accum = 1;           // micro-batches of batch_per_device sequences summed into one update (train::Step)
  // The schedule's options, as a training run's (train::TrainOptions::step): remat policy, compute dtype, expert
  // parallelism, prefetch, piece sizes, packed weights (this CPU's oneDNN packed forms: only meaningful for a run on
  // this machine), the delta rule's products. Its groups (comm, batch_group, ep_group, update) are the plan's own
  // virtual ones and must be left null.
  train::StepOptions step;
  size_t hbm_bytes = 0;          // 0: unknown (fits is then not judged)
};

struct PlanResult {
  train::RematPolicy remat;
  DType moment_dtype = DType::F32;
  bool update_in_backward = false;
  int64_t fsdp = 1;
  size_t argument_bytes = 0, output_bytes = 0, alias_bytes = 0, temp_bytes = 0, total_bytes = 0, hbm_bytes = 0;
  bool fits = true;
  MemorySnapshot peak;  // live bytes per category at the peak, and the largest buffers then
  double seconds = 0;   // time spent planning
};

PlanResult plan(const PlanRequest& r);
// HBM per chip by name (v5p 95 GiB, v6e 32 GiB, tpu7x 192 GiB, h100 80 GB, h200 141 GB); throws for unknown names.
size_t chip_hbm_bytes(const std::string& chip);
// --remat auto: the policy with the least recomputation whose plan fits `budget` (none, else sublayer, which plans
// above block only by the layer inputs it keeps); if nothing fits, sublayer with fits = false.
PlanResult plan_auto(PlanRequest r, size_t budget);

// Generation (hybridscan generate) on one device: `batch` sequences of up to `context` positions, weights stored and
// computed in weight_dtype, prompts prefilled `piece` tokens per pass. The decoder itself runs over shapes (the
// caches, a prompt of min(2 piece, context) tokens, one decode step of every sequence) with this process's thread
// count, so the total is the accountant peak generate() reaches when a prompt fills two pieces, and bounds it for
// shorter ones (a piece's workspace grows with its tokens). Memory-mapped weights are file pages: the total counts
// them as weights all the same.
//
// draft > 0: speculative decoding (generate --speculative mtp --draft N; the model needs an MTP layer): what
// infer::generate_speculative allocates, run over shapes by infer::speculative_over_shapes (the code the run
// allocates with): the decoder's caches with N more recurrent-state slots per sequence (counted in recurrent_state)
// and N more positions, the MTP layer's keys and values (mtp_kv_cache) and weight casts, B (N + 1) rows of logits and
// hidden states, prompts of min(2 piece, context - 1) tokens through both models a piece at a time, and the widest
// decode step (N - 1 MTP steps, the verification of N + 1 positions per sequence, the MTP catch-up on all of them).
// The total is the peak of a run whose prompts fill two pieces and bounds it otherwise (a step whose drafts are not
// all kept catches up on fewer rows).
struct GeneratePlanRequest {
  model::ModelConfig model;
  int64_t context = 4096, batch = 1, piece = 512;
  DType weight_dtype = DType::BF16;
  int64_t draft = 0;  // speculative decoding's draft tokens per step (0: plain decoding)
};
struct GeneratePlan {
  size_t weights = 0, kv_cache = 0, recurrent_state = 0, mtp_kv_cache = 0, workspace = 0, total = 0;
};
GeneratePlan plan_generate(const GeneratePlanRequest& r);
// The same for a .gguf model decoded from its quantized blocks (infer::load_gguf_weights): weights = the tensors
// converted to fp32 (in the accountant) + the quantized blocks used in place from the mapped file (quantized_bytes,
// file pages); total = what the accountant holds at its peak + quantized_bytes. r.model and r.weight_dtype are
// ignored (the file's configuration; compute fp32).
struct QuantizedGeneratePlan {
  GeneratePlan plan;
  size_t converted_bytes = 0, quantized_bytes = 0;
};
QuantizedGeneratePlan plan_generate_gguf(const std::string& gguf_path, const GeneratePlanRequest& r);
// The server (hybridscan serve): `parallel` slots of `context` positions, prompts prefilled in the prefix cache's
// 64-token pieces, a prefix cache of at most cache_bytes. What the server's scheduler allocates, over shapes: the
// decoder's caches, the logits of every slot, two prefill pieces (the flash kernel's, then one against the cache), a
// decode step of every slot, and the cache's budget, full. Weights count whole, as plan_generate counts them.
// draft > 0 (serve --speculative mtp --draft N): the decoder's N more recurrent-state slots per sequence and N more
// positions, the MTP drafter (its keys and values, weight casts, fused step), the rows of parallel * (N + 1)
// verified positions (logits, hidden) and of the MTP layer's steps, its prompt rows, and the widest speculative step.
// gguf_path set: the server of that .gguf run from its quantized blocks (infer::load_gguf_weights; model and
// weight_dtype are then the file's configuration and fp32 compute, and draft must be 0: serve runs --speculative on
// the dequantized weights). As plan_generate_gguf: weights = the tensors converted to fp32 + the quantized blocks used
// in place (file pages); total = the accountant's peak + quantized_bytes.
struct ServePlanRequest {
  model::ModelConfig model;
  int64_t context = 4096, parallel = 4, draft = 0;
  size_t cache_bytes = 0;
  DType weight_dtype = DType::BF16;
  std::string gguf_path;
};
struct ServePlan {
  size_t weights = 0, kv_cache = 0, recurrent_state = 0, prefix_cache = 0, workspace = 0, total = 0;
  size_t mtp_kv_cache = 0;  // the MTP drafter's keys and values (draft > 0)
  size_t converted_bytes = 0, quantized_bytes = 0;  // gguf_path: the weights' two parts
};
ServePlan plan_serve(const ServePlanRequest& r);
// plan --fit: every configuration of remat policy x AdamW moment dtype x update in backward for the request (its
// other settings kept), cheapest first: least recomputation (none; then sublayer and block, one extra forward each),
// then exact arithmetic (fp32 moments) before rounded (bf16), then the usual step (which can clip) before AdamW in
// the backward (which cannot), then least memory. `fits` is judged against
// `budget`; `why` says why each configuration is not the choice. The choice is the first that fits, if any.
struct FitCandidate {
  PlanResult plan;
  std::string why;  // empty for the choice
};
struct FitResult {
  std::vector<FitCandidate> candidates;  // cheapest first
  int choice = -1;                       // index into candidates; -1 when nothing fits
};
FitResult plan_fit(PlanRequest r, size_t budget);

}  // namespace hs::planner
