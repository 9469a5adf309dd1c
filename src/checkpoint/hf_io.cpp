#include "checkpoint/hf_io.h"

#include <set>
#include <stdexcept>

namespace hs::checkpoint {

namespace {

void store(const TensorView& dst, int64_t at, const float* src, int64_t n) {
  if (dst.dtype == DType::F32) {
    std::copy(src, src + n, static_cast<float*>(dst.data) + at);
  } else {
    bf16* d = static_cast<bf16*>(dst.data) + at;
    for (int64_t i = 0; i < n; ++i) d[i] = bf16(src[i]);
  }
}

}  // namespace

std::vector<std::string> load_hf_params(const CheckpointReader& r, model::ParamSet& params) {
  const model::ModelConfig& c = params.config();
  const std::string where = r.path().string();
  DetectedHfLayout d = detect_hf_layout(r.tensor_names(), c);
  HfLayout lay = hf_layout(c, d.experts, d.prefix);
  std::vector<std::string> notes;
  std::set<std::string> expected;
  for (const HfTensor& t : lay.hf) expected.insert(t.name);
  size_t skipped = 0;
  for (const std::string& n : r.tensor_names()) {
    if (expected.count(n)) continue;
    if (is_skipped_hf_tensor(n)) {
      ++skipped;
      continue;
    }
    throw std::runtime_error(where + ": unexpected tensor '" + n + "' for " + model::describe(c) +
                             " (wrong family or config?)");
  }
  if (skipped) notes.push_back("skipped " + std::to_string(skipped) + " tensors that are not part of the text decoder (mtp.*, model.visual.*)");
  std::vector<float> buf;
  for (const HfTensor& t : lay.hf) {
    if (!r.contains(t.name)) throw std::runtime_error(where + ": missing tensor '" + t.name + "'");
    const TensorInfo& info = r.info(t.name);
    if (info.shape != t.shape)
      throw std::runtime_error(where + ": tensor '" + t.name + "' has shape " + shape_str(info.shape) + ", expected " +
                               shape_str(t.shape) + " for this config");
    buf.resize(static_cast<size_t>(numel(t.shape)));
    r.read_f32(t.name, buf);
    for (const ElementRun& run : t.runs) store(params.all()[run.stacked].tensor.view(), run.stacked_at, buf.data() + run.hf_at, run.count);
  }
  return notes;
}

std::vector<float> hf_tensor_from(const model::ParamSet& ps, const HfTensor& t) {
  std::vector<float> out(static_cast<size_t>(numel(t.shape)));
  for (const ElementRun& run : t.runs) {
    const TensorView& v = ps.all()[run.stacked].tensor.view();
    for (int64_t i = 0; i < run.count; ++i)
      out[static_cast<size_t>(run.hf_at + i)] = v.dtype == DType::F32 ? static_cast<const float*>(v.data)[run.stacked_at + i]
                                                                      : to_f32(static_cast<const bf16*>(v.data)[run.stacked_at + i]);
  }
  return out;
}

}  // namespace hs::checkpoint
