#include "infer/weights.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>

namespace hs::infer {

const char* weights_memory_name(WeightsMemory m) {
  switch (m) {
    case WeightsMemory::Copy: return "copy";
    case WeightsMemory::Auto: return "auto";
    default: return "map";
  }
}

WeightsMemory parse_weights_memory(const std::string& s) {
  for (WeightsMemory m : {WeightsMemory::Map, WeightsMemory::Copy, WeightsMemory::Auto})
    if (s == weights_memory_name(m)) return m;
  throw std::invalid_argument("weights memory '" + s + "': use map, copy or auto");
}

namespace {
// The first number in a file (0 when it is missing or not a number, e.g. cgroup v2's "max").
uint64_t read_number(const char* path) {
  std::ifstream f(path);
  uint64_t v = 0;
  return (f >> v) ? v : 0;
}
}  // namespace

uint64_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t kib = 0, avail = 0;
  while (f >> key) {
    if (key == "MemAvailable:" && (f >> kib)) {
      avail = kib * 1024;
      break;
    }
    f.ignore(1 << 10, '\n');
  }
  // A container's limit (cgroup v2 memory.max, v1 memory.limit_in_bytes) is below the host's MemAvailable: what the
  // process may still take is the limit less what its group uses now.
  const uint64_t v2_max = read_number("/sys/fs/cgroup/memory.max");
  const uint64_t v1_max = read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes");
  const uint64_t limit = v2_max ? v2_max : v1_max;
  if (limit && limit < (uint64_t{1} << 60)) {  // v1 reports "no limit" as ~2^63
    const uint64_t used = v2_max ? read_number("/sys/fs/cgroup/memory.current")
                                 : read_number("/sys/fs/cgroup/memory/memory.usage_in_bytes");
    const uint64_t left = limit > used ? limit - used : 0;
    if (avail == 0 || left < avail) avail = left;
  }
  return avail;
}

bool auto_copies(uint64_t weight_bytes, uint64_t available_bytes) {
  return available_bytes > 0 && weight_bytes + (uint64_t{1} << 30) <= available_bytes / 2;
}

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

struct Span {
  const checkpoint::HfTensor* file;
  const checkpoint::ElementRun* run;
};

// Where each layer of stacked tensor sp lies in the files, or why one cannot be used in place ("" when all can).
std::string place_layers(const checkpoint::CheckpointReader& r, const model::StackedParam& sp,
                         const std::vector<Span>& spans, std::vector<void*>& at) {
  const int64_t per = numel(sp.spec.shape), layers = numel(sp.lead);
  const size_t es = dtype_size(sp.dtype);
  at.assign(static_cast<size_t>(layers), nullptr);
  for (int64_t j = 0; j < layers; ++j) {
    const Span* s = nullptr;
    for (const Span& c : spans)
      if (c.run->stacked_at <= j * per && j * per + per <= c.run->stacked_at + c.run->count) s = &c;
    if (!s) {
      std::vector<std::string> from;
      for (const Span& c : spans)
        if (c.run->stacked_at < (j + 1) * per && j * per < c.run->stacked_at + c.run->count &&
            std::find(from.begin(), from.end(), c.file->name) == from.end())
          from.push_back(c.file->name);
      if (from.empty()) return "a layer is missing";
      return "a layer is assembled from pieces of '" + from[0] + "'" +
             (from.size() > 1 ? " and " + std::to_string(from.size() - 1) + " more" : "");
    }
    const checkpoint::TensorInfo& t = r.info(s->file->name);
    if (checkpoint::to_engine_dtype(t.dtype) != sp.dtype)
      return "'" + s->file->name + "' is stored as " + std::string(checkpoint::file_dtype_name(t.dtype)) + ", wanted " +
             std::string(dtype_name(sp.dtype));
    // The layout config.json implies must lie inside the stored tensor: a smaller one (a config that does not match
    // the weights) is left to load_parameters, which names the shapes, before anything is read from it.
    const std::span<const std::byte> file = r.bytes(s->file->name);
    const size_t offset = static_cast<size_t>(s->run->hf_at + j * per - s->run->stacked_at) * es;
    if (s->run->hf_at + j * per - s->run->stacked_at < 0 || offset + static_cast<size_t>(per) * es > file.size())
      return "'" + s->file->name + "' is smaller than the layout needs";
    const std::byte* p = file.data() + offset;
    if (reinterpret_cast<uintptr_t>(p) % es != 0) return "'" + s->file->name + "' is not aligned";
    at[static_cast<size_t>(j)] = const_cast<std::byte*>(p);
  }
  return "";
}

}  // namespace

std::unique_ptr<InferenceWeights> load_weights(const checkpoint::CheckpointDir& d, std::optional<DType> dtype,
                                               MemoryAccountant& mem, WeightsMemory how) {
  auto w = std::make_unique<InferenceWeights>();
  const DType want = dtype ? *dtype : stored_weight_dtype(d);
  auto reader = std::make_unique<checkpoint::CheckpointReader>(d.path);
  auto params = std::make_unique<model::ParamSet>(d.config, want, w->shapes, MemCategory::Parameters, false);
  std::vector<std::vector<Span>> spans(params->all().size());
  for (const checkpoint::HfTensor& t : d.tensors.hf) {
    if (!reader->contains(t.name)) continue;  // load_parameters below names it
    for (const checkpoint::ElementRun& run : t.runs) spans.at(run.stacked).push_back({&t, &run});
  }
  if (how == WeightsMemory::Auto)
    how = auto_copies(params->nbytes(), available_memory_bytes()) ? WeightsMemory::Copy : WeightsMemory::Map;
  w->memory = how;
  std::vector<bool> copy(params->all().size(), false);
  std::map<std::string, std::vector<std::string>> why_copied;  // reason -> tensors
  for (size_t i = 0; i < params->all().size(); ++i) {
    model::StackedParam& sp = params->all()[i];
    std::vector<void*> at;
    const std::string why = place_layers(*reader, sp, spans[i], at);
    if (why.empty() && how == WeightsMemory::Copy && i != static_cast<size_t>(model::g::kEmbed)) {
      // In the dtype asked for already, each layer one span: a byte copy in pieces, each piece's file pages dropped
      // after it (the resident set grows by the copy only). The embedding table stays mapped: a step reads one row
      // of it per sequence, and a copy would only add its whole size to the resident set.
      sp.tensor = Tensor::empty(mem, MemCategory::Parameters, sp.dtype, sp.full_shape, sp.name);
      const size_t layer_bytes = static_cast<size_t>(numel(sp.spec.shape)) * dtype_size(sp.dtype);
      constexpr size_t kPiece = size_t{64} << 20;
      auto* dst = static_cast<std::byte*>(sp.tensor.view().data);
      for (size_t j = 0; j < at.size(); ++j)
        for (size_t o = 0; o < layer_bytes; o += kPiece) {
          const size_t n = std::min(kPiece, layer_bytes - o);
          std::memcpy(dst + j * layer_bytes + o, static_cast<const std::byte*>(at[j]) + o, n);
          checkpoint::release_mapped_pages({static_cast<const std::byte*>(at[j]) + o, n});
        }
      w->copied_bytes += sp.tensor.nbytes();
      continue;
    }
    if (!why.empty()) {
      copy[i] = true;
      sp.tensor = Tensor::empty(mem, MemCategory::Parameters, sp.dtype, sp.full_shape, sp.name);
      w->copied_bytes += sp.tensor.nbytes();
      why_copied[why].push_back(sp.name);
      continue;
    }
    // One block of memory (a native scanned stack, a global): the stacked tensor itself; else a view per layer.
    const size_t layer_bytes = static_cast<size_t>(numel(sp.spec.shape)) * dtype_size(sp.dtype);
    bool contiguous = true;
    for (size_t j = 1; j < at.size(); ++j)
      contiguous = contiguous && static_cast<std::byte*>(at[j]) == static_cast<std::byte*>(at[0]) + j * layer_bytes;
    if (contiguous) sp.tensor = Tensor::borrowed(TensorView(at[0], sp.dtype, sp.full_shape));
    else sp.layers = std::move(at);
    w->mapped_bytes += layer_bytes * static_cast<size_t>(numel(sp.lead));
  }
  // Validates the whole checkpoint (missing, unexpected, misshapen tensors) and fills the copied tensors only.
  for (auto& n : checkpoint::load_parameters(d, *params, &copy)) w->notes.push_back(std::move(n));
  for (const auto& [why, names] : why_copied) {
    std::string list;
    for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
    w->notes.push_back("copied, not mapped (" + why + "): " + list);
  }
  w->mapped = w->copied_bytes == 0;
  if (w->mapped_bytes == 0) reader.reset();  // nothing points into the files: unmap them
  w->reader = std::move(reader);
  w->params = std::move(params);
  return w;
}

}  // namespace hs::infer
