// GGUF models of llama.cpp's qwen3next, qwen35 and qwen35moe architectures read into hybridscan's model: the
// configuration from the metadata, the tensors renamed and the converter's transforms undone (docs/gguf.md), the
// tokenizer and chat template from tokenizer.* metadata.
//
// A command opens a GGUF model in one of two ways (docs/gguf.md): from its quantized blocks (infer::load_gguf_weights,
// the default of generate, eval, serve and plan --generate), with import_gguf writing only the configuration and the
// tokenizer into a temporary native checkpoint; or dequantized, with import_gguf writing every tensor as fp32 / bf16
// into it, which the command then opens as any checkpoint. The per-tensor reads (read_model_tensor) are the one place
// that turns GGUF blocks into values.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "gguf/gguf_file.h"
#include "model/config.h"

namespace hs::gguf {

// The engine's configuration from {arch}.* metadata. FormatError for another architecture (naming it and the three
// that load), a missing key, or values that disagree with each other (recurrent_layers against the interval).
// with_mtp: the multi-token-prediction layer (nextn_predict_layers, its blk.{layers}.nextn.* tensors) becomes the
// config's mtp_layers; without, it is left out (decoding from the quantized blocks has no use for it).
model::ModelConfig config_from_gguf(const GgufReader& r, bool with_mtp = false);
// config.json for the imported model: config_to_hf_json(c) plus the context length and end-of-sequence id.
nlohmann::json hf_config_json(const GgufReader& r, const model::ModelConfig& c);

// True for the ggml types the importer reads: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K.
bool is_loadable_type(uint32_t type);
// The elements of a tensor as fp32. FormatError naming the tensor for a type outside is_loadable_type.
std::vector<float> dequantize_tensor(const GgufReader& r, const TensorInfo& t);

// One tensor of the native unscanned layout ("layers.{i}.linear_attn.in_proj_qkv.weight", "embed_tokens.weight",
// "mtp.layers.0.self_attn.q_proj.weight", "mtp.fc.weight", ...), built from the GGUF tensors it comes from with the converter's transforms undone, as fp32, in the native
// shape. FormatError naming the GGUF tensor when it is missing or its shape disagrees with the metadata.
std::vector<float> read_model_tensor(const GgufReader& r, const model::ModelConfig& c, const std::string& name);

// The GGUF tensors that hold a native tensor as it is, rows in the native order, with no transform: one name, or for
// the routed experts' gate_up the gate and up tensors when the file stores them apart (their rows concatenated per
// expert). Empty when the native tensor is rebuilt (Qwen3.5's V-head reorder when k_heads != v_heads, Qwen3-Next's
// ssm_ba, +1 norms, A_log) and must go through read_model_tensor. Decoding reads the matrices named here in their
// quantized blocks (infer::load_gguf_weights).
std::vector<std::string> verbatim_sources(const GgufReader& r, const model::ModelConfig& c, const std::string& name);

// tokenizer.json equivalent to tokenizer.ggml.* (byte-level BPE: model "gpt2", pre-tokenizers "qwen2", "qwen35" and
// the others whose split regex is Qwen's); nullopt when the file has no tokenizer. FormatError for another kind.
std::optional<nlohmann::json> tokenizer_json_from_gguf(const GgufReader& r);

struct ImportReport {
  model::ModelConfig config;
  std::string architecture;
  std::vector<std::string> notes;
};
// Writes a native unscanned checkpoint of the GGUF model into `dir` (which must not exist or be empty): config.json,
// hybridscan.json, model.safetensors (fp32; bf16 for tensors stored in BF16), tokenizer.json and tokenizer_config.json
// (with the chat template) when the file has a tokenizer. tensors false: all but model.safetensors (the configuration
// and the tokenizer of a model whose weights are read from the file itself).
ImportReport import_gguf(const std::filesystem::path& gguf, const std::filesystem::path& dir, bool tensors = true);

bool is_gguf_path(const std::string& path);

// A checkpoint named on a command line: a directory as it is, or a .gguf file imported into a temporary directory
// that lives as long as this object (with its tensors dequantized, or without them when the command reads the
// weights from the file's blocks). The one lookup generate, eval, serve and inspect make.
class CheckpointPath {
 public:
  enum class Weights { Dequantized, FromBlocks };
  explicit CheckpointPath(const std::string& path_or_gguf, Weights weights = Weights::Dequantized);
  ~CheckpointPath();
  CheckpointPath(const CheckpointPath&) = delete;
  CheckpointPath& operator=(const CheckpointPath&) = delete;
  const std::string& path() const { return dir_; }  // the directory to open
  bool imported() const { return !temp_.empty(); }

 private:
  std::string dir_;
  std::filesystem::path temp_;
};

}  // namespace hs::gguf
