// Checkpoint directories and the streaming converter between them.
//
// A native checkpoint directory holds:
//   hybridscan.json      format, layout (scanned | unscanned), training state (step, seed, options), and what the
//                        Hugging Face source looked like (tensor prefix, expert layout, file metadata) so that the
//                        export reproduces it byte for byte
//   config.json          the Hugging Face config (the source's own, verbatim, when converted from one)
//   model.safetensors    the parameters in the stacked layout ("local.*" [block, local, ...], "global.*" [block, ...],
//                        "remainder.*" [remainder, ...], the globals), or model-0000k-of-0000n + index when sharded
//   optimizer.safetensors  (training checkpoints) AdamW moments "m.<name>", "v.<name>" in fp32
//   tokenizer.json       (when the model has one) the tokenizer its ids belong to
// A Hugging Face directory holds config.json and model.safetensors (or shards + index) with per-layer names, and
// usually tokenizer.json (with tokenizer_config.json and the like). Conversion copies these tokenizer files along.
//
// Conversion streams: every target tensor is written as spans of the memory-mapped source (pure index arithmetic:
// see hf_layout.h), pages are dropped after use, so the working set stays bounded whatever the checkpoint size.
// Output goes to a temporary directory beside the destination and is renamed into place only when complete.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/hf_layout.h"
#include "checkpoint/sharded.h"
#include "model/params.h"

namespace hs::checkpoint {

enum class Format { Native, HuggingFace };
enum class Layout { Scanned, Unscanned };
std::string format_name(Format f);

struct CheckpointDir {
  std::filesystem::path path;
  Format format = Format::HuggingFace;
  Layout layout = Layout::Unscanned;
  model::ModelConfig config;
  nlohmann::json config_json;   // config.json as found
  nlohmann::json native;        // hybridscan.json (native only)
  DetectedHfLayout hf;          // the HF tensor layout (detected, or remembered by a native checkpoint)
  std::map<std::string, std::string> hf_metadata;  // __metadata__ of the HF files
  HfLayout tensors;             // this directory's tensors against the stacked coordinates
};

// Reads and classifies a checkpoint directory (native if it holds hybridscan.json, else Hugging Face).
// Throws std::runtime_error naming the path and the problem.
CheckpointDir open_checkpoint_dir(const std::filesystem::path& dir);

// Loads the parameters of any checkpoint directory into a stacked ParamSet of the given weight dtype.
// Returns notes (skipped tensors, ...). only: when given (one entry per stacked tensor), fills just the stacked
// tensors i with only[i] and reads no file tensor that feeds none of them; the whole checkpoint is validated either way
// (missing, unexpected or misshapen tensors throw).
std::vector<std::string> load_parameters(const CheckpointDir& dir, model::ParamSet& params,
                                         const std::vector<bool>* only = nullptr);

struct ConvertOptions {
  Format to = Format::Native;
  Layout layout = Layout::Scanned;       // native target only
  uint64_t max_shard_bytes = 5'000'000'000ull;
  bool overwrite = false;                // replace an existing non-empty destination
  std::function<void(const std::string&)> progress;  // one line per tensor batch; may be empty
};

struct ConvertReport {
  size_t tensors = 0;
  uint64_t bytes = 0;
  size_t skipped = 0;
  std::vector<std::string> notes;
  double seconds = 0;
};

ConvertReport convert_checkpoint(const std::filesystem::path& from, const std::filesystem::path& to,
                                 const ConvertOptions& opt);

// Native checkpoints from training: the parameters (stacked, in their storage dtype, so a resume is bit-exact),
// optionally the AdamW moments, and a training-state JSON. Written atomically (temporary directory, then rename).
struct TrainingState {
  const model::ParamSet* params = nullptr;
  const model::ParamSet* m = nullptr;
  const model::ParamSet* v = nullptr;
  nlohmann::json state;  // step, seed, options...
  std::filesystem::path tokenizer;  // a tokenizer.json to copy in beside the weights (empty: none)
};
void save_native(const std::filesystem::path& dir, const TrainingState& s, bool overwrite = true);
// Reads the AdamW moments of a native training checkpoint into m and v (fp32 ParamSets of the same config).
void load_optimizer_state(const CheckpointDir& dir, model::ParamSet& m, model::ParamSet& v);

// The stacked tensors named as themselves (the scanned native layout).
HfLayout identity_layout(const model::ModelConfig& c);

}  // namespace hs::checkpoint
