// Writing a checkpoint as a GGUF file llama.cpp loads (its qwen3next / qwen35 / qwen35moe architectures, the
// converter's tensor names and transforms, tokenizer.* from tokenizer.json), quantized by our own ggml-compatible
// quantizers (kernels/quant.h): `hybridscan convert --quantize TYPE --to FILE.gguf`. docs/gguf.md.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "gguf/gguf_file.h"
#include "model/config.h"

namespace hs::gguf {

// f32 | f16 | bf16: every matrix in that type. q8_0 | q4_k | q5_k | q6_k: every matrix whose rows are whole blocks
// of that type (else the next type that fits: Q8_0, then F32). mixed: attention, the shared experts, the GDN
// projections (ssm_out included), the embedding and the LM head at Q8_0; routed experts (or a dense model's MLP) at
// Q4_K for gate/up and Q5_K for down. Vectors, the convolution, the routers and the shared-expert gate stay F32 in
// every scheme (llama-quantize keeps them so too).
enum class QuantScheme { F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K, Mixed };
QuantScheme parse_quant_scheme(const std::string& s);  // std::invalid_argument listing the schemes otherwise
std::string quant_scheme_name(QuantScheme s);

// The ggml type a tensor gets (GGUF name, e.g. "blk.3.ffn_up_exps.weight", and its row length ne0).
uint32_t tensor_type_for(QuantScheme s, const std::string& gguf_name, int64_t ne0, int64_t dims);

// The bytes of the model's tensors in a GGUF file of that scheme (what quantized storage will hold).
uint64_t quantized_weight_bytes(const model::ModelConfig& c, QuantScheme scheme);

// tokenizer.ggml.* and tokenizer.chat_template from dir's tokenizer.json and tokenizer_config.json (byte-level BPE),
// ids padded to `vocab` with "[PADn]" (unused); the 256-byte vocabulary when dir has no tokenizer.json.
void write_tokenizer(GgufWriter& w, const std::filesystem::path& dir, int64_t vocab, std::vector<std::string>& notes);

struct ExportReport {
  std::string architecture;
  size_t tensors = 0;
  uint64_t bytes = 0;  // tensor data written
  std::vector<std::string> notes;
};
// Reads the checkpoint directory `from` (native or Hugging Face) and writes `to` atomically.
ExportReport export_gguf(const std::filesystem::path& from, const std::filesystem::path& to, QuantScheme scheme);

}  // namespace hs::gguf
