// Generation: several prompts at once through one Decoder, each sequence ending on its own stop condition, and the
// sampler that picks each next token.
#pragma once
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "core/memory.h"
#include "infer/weights.h"
#include "model/params.h"

namespace hs::infer {

// temperature 0: greedy (the highest logit, the lowest id on a tie, as torch.argmax). Otherwise softmax(logits / T)
// restricted to the top_k most likely ids (0: all) and then to the smallest set whose probability reaches top_p
// (1: all), drawn with the sequence's generator.
struct Sampling {
  double temperature = 0;
  int64_t top_k = 0;
  double top_p = 1;
  uint64_t seed = 0;
};
// scratch is reused between calls (no allocation once it holds `vocab` entries).
int32_t sample_token(const float* logits, int64_t vocab, const Sampling& s, std::mt19937_64& rng,
                     std::vector<std::pair<float, int32_t>>& scratch);

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  Sampling sampling;
  std::vector<int32_t> stop_ids;  // a sequence ends after emitting one of these (it is kept in its tokens)
  DType compute = DType::F32;
  int64_t piece = 512;            // prefill tokens per pass
  const QuantWeights* quant = nullptr;  // a GGUF model's quantized matrices (load_gguf_weights; compute fp32)
};

struct GenerateResult {
  std::vector<std::vector<int32_t>> tokens;  // the new ids of each prompt
  int64_t prefill_tokens = 0, decode_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  size_t kv_cache_bytes = 0, recurrent_state_bytes = 0;  // the decoder's caches
  size_t peak_bytes = 0;  // the accountant's peak while generating (weights included), what plan_generate predicts
};

// The longest prompt's length, after checking what generate and generate_speculative ask of their arguments: throws
// std::invalid_argument for no prompts, an empty prompt or max_new_tokens <= 0.
int64_t longest_prompt(const std::vector<std::vector<int32_t>>& prompts, int64_t max_new_tokens);

// Prefills every prompt (each in its own slot), then decodes all unfinished sequences together, one token each per
// step. on_token(prompt index, id) sees every new id as it is chosen; returning false ends that sequence (a stop
// string). Sequence i draws from a generator seeded with sampling.seed + i, so its tokens do not depend on the other
// prompts. Restarts the accountant's peak (mem.reset_peak()). Throws std::invalid_argument for an empty prompt or
// max_new_tokens <= 0.
GenerateResult generate(const model::ParamSet& params, const std::vector<std::vector<int32_t>>& prompts,
                        const GenerateOptions& opt, MemoryAccountant& mem,
                        const std::function<bool(size_t, int32_t)>& on_token = {});

}  // namespace hs::infer
