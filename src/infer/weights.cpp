#include "infer/weights.h"

#include <cstdint>
#include <stdexcept>

namespace hs::infer {

DType stored_weight_dtype(const checkpoint::CheckpointDir& d) {
  checkpoint::CheckpointReader r(d.path);
  const std::string suffix = "embed_tokens.weight";
  for (const std::string& n : r.tensor_names())
    if (n.size() >= suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0 &&
        n.rfind("mtp.", 0) != 0)
      return r.info(n).dtype == checkpoint::FileDType::BF16 ? DType::BF16 : DType::F32;
  throw std::runtime_error("checkpoint " + d.path.string() + " has no embed_tokens.weight");
}

namespace {

// Why the stacked tensor cannot be used in place ("" when it can).
std::string unmappable(const checkpoint::CheckpointReader& r, const model::StackedParam& sp) {
  if (!r.contains(sp.name)) return sp.name + " is missing";
  const checkpoint::TensorInfo& t = r.info(sp.name);
  if (t.shape != sp.full_shape) return sp.name + " has shape " + shape_str(t.shape);
  if (checkpoint::to_engine_dtype(t.dtype) != sp.dtype) return sp.name + " is stored as " + std::string(checkpoint::file_dtype_name(t.dtype));
  if (reinterpret_cast<uintptr_t>(r.bytes(sp.name).data()) % dtype_size(sp.dtype) != 0) return sp.name + " is not aligned";
  return "";
}

}  // namespace

std::unique_ptr<InferenceWeights> load_weights(const checkpoint::CheckpointDir& d, std::optional<DType> dtype,
                                               MemoryAccountant& mem) {
  auto w = std::make_unique<InferenceWeights>();
  const DType want = dtype ? *dtype : stored_weight_dtype(d);
  if (d.format == checkpoint::Format::Native && d.layout == checkpoint::Layout::Scanned) {
    auto reader = std::make_unique<checkpoint::CheckpointReader>(d.path);
    auto params = std::make_unique<model::ParamSet>(d.config, want, w->shapes, MemCategory::Parameters, false);
    std::string why;
    for (const model::StackedParam& sp : params->all())
      if (why.empty()) why = unmappable(*reader, sp);
    if (why.empty() && reader->tensor_names().size() != params->all().size()) why = "it holds other tensors too";
    if (why.empty()) {
      for (model::StackedParam& sp : params->all())
        sp.tensor = Tensor::borrowed(TensorView(const_cast<std::byte*>(reader->bytes(sp.name).data()), sp.dtype,
                                                sp.full_shape));
      w->reader = std::move(reader);
      w->params = std::move(params);
      w->mapped = true;
      return w;
    }
    w->notes.push_back("weights copied, not mapped: " + why);
  }
  w->params = std::make_unique<model::ParamSet>(d.config, want, mem, MemCategory::Parameters, false);
  for (auto& n : checkpoint::load_parameters(d, *w->params)) w->notes.push_back(std::move(n));
  return w;
}

}  // namespace hs::infer
