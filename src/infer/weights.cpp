#include "infer/weights.h"

#include "gguf/gguf_file.h"
#include "gguf/import.h"
#include "kernels/quant_gemv.h"

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

namespace hs::infer {

InferenceWeights::~InferenceWeights() = default;

namespace {

bool quantized_type(uint32_t t) {
  const kernels::GgmlTypeInfo* info = kernels::ggml_type_info(t);
  return info && info->block_elems > 1 && kernels::quant_gemv_supports(info->type);
}

// The GGUF tensors `names` as one quantized [rows, cols] matrix each (rows: the tensor's outer elements), when every
// one is stored in a type the products take; nullopt otherwise. FormatError when the shapes disagree with `shape`.
std::optional<std::vector<QuantMatrix>> quant_parts(const gguf::GgufReader& r, const std::vector<std::string>& names,
                                                    const Shape& shape) {
  if (names.empty()) return std::nullopt;
  std::vector<QuantMatrix> out;
  int64_t rows = 0;
  const int64_t cols = shape.back();
  for (const std::string& n : names) {
    const gguf::TensorInfo* t = r.find_tensor(n);
    if (!t) throw gguf::FormatError("GGUF model " + r.label() + ": tensor '" + n + "' is missing");
    if (!quantized_type(t->type)) return std::nullopt;
    if (t->ne.empty() || t->ne[0] != cols)
      throw gguf::FormatError("GGUF model " + r.label() + ": tensor '" + n + "' has rows of " +
                              std::to_string(t->ne.empty() ? 0 : t->ne[0]) + " elements, the model's " +
                              std::to_string(cols));
    QuantMatrix m;
    m.type = static_cast<kernels::GgmlType>(t->type);
    m.cols = cols;
    m.rows = t->numel() / cols;
    m.row_bytes = kernels::ggml_row_bytes(m.type, cols);
    const std::span<const std::byte> b = r.bytes(*t);
    if (static_cast<int64_t>(b.size()) != m.rows * m.row_bytes)
      throw gguf::FormatError("GGUF model " + r.label() + ": tensor '" + n + "' holds " + std::to_string(b.size()) +
                              " bytes, its shape " + std::to_string(m.rows * m.row_bytes));
    m.data = reinterpret_cast<const uint8_t*>(b.data());
    m.name = n;
    rows += m.rows;
    out.push_back(std::move(m));
  }
  if (rows != numel(shape) / cols)
    throw gguf::FormatError("GGUF model " + r.label() + ": tensor '" + names[0] + "' has " + std::to_string(rows) +
                            " rows, the model " + std::to_string(numel(shape) / cols));
  return out;
}

}  // namespace

std::unique_ptr<InferenceWeights> load_gguf_weights(const std::string& path, MemoryAccountant& mem) {
  auto w = std::make_unique<InferenceWeights>();
  w->gguf = std::make_unique<gguf::GgufReader>(path);
  const gguf::GgufReader& r = *w->gguf;
  const model::ModelConfig c = gguf::config_from_gguf(r);
  auto params = std::make_unique<model::ParamSet>(c, DType::F32, w->shapes, MemCategory::Parameters, false);
  auto q = std::make_unique<QuantWeights>();
  q->layers.resize(static_cast<size_t>(c.layers));
  std::vector<std::string> converted;
  std::map<const uint8_t*, bool> counted;  // a tied head shares the embedding's blocks
  auto count = [&](const std::vector<QuantMatrix>& parts) {
    for (const QuantMatrix& m : parts)
      if (!counted[m.data]) {
        counted[m.data] = true;
        q->bytes += static_cast<uint64_t>(m.rows * m.row_bytes);
      }
  };
  // fp32 copy of native tensor `name` ([shape]) into memory of the engine's own.
  auto convert = [&](const std::string& name, const Shape& shape) -> void* {
    const std::vector<float> x = gguf::read_model_tensor(r, c, name);
    if (static_cast<int64_t>(x.size()) != numel(shape))
      throw gguf::FormatError("GGUF model " + r.label() + ": " + name + " has " + std::to_string(x.size()) +
                              " elements, the model " + std::to_string(numel(shape)));
    Buffer b = mem.allocate(x.size() * sizeof(float), MemCategory::Parameters, name);
    if (!mem.planning()) std::memcpy(b.data(), x.data(), x.size() * sizeof(float));
    void* p = b.data();
    w->copied_bytes += b.bytes();
    w->owned.push_back(std::move(b));
    converted.push_back(name);
    return p;
  };
  // Globals: the embedding and the head quantized where their file tensors are; the final norm converted.
  for (const model::g::Global g : {model::g::kEmbed, model::g::kFinalNorm, model::g::kLmHead}) {
    model::StackedParam& sp = params->all()[static_cast<size_t>(g)];
    const std::string name = g == model::g::kEmbed ? "embed_tokens.weight"
                             : g == model::g::kLmHead ? "lm_head.weight" : "norm.weight";
    std::optional<std::vector<QuantMatrix>> qm;
    if (g != model::g::kFinalNorm) qm = quant_parts(r, gguf::verbatim_sources(r, c, name), sp.spec.shape);
    if (qm) {
      count(*qm);
      (g == model::g::kEmbed ? q->embed : q->lm_head) = (*qm)[0];
      sp.tensor = Tensor::borrowed(TensorView(nullptr, DType::F32, sp.full_shape));
    } else {
      sp.tensor = Tensor::borrowed(TensorView(convert(name, sp.spec.shape), DType::F32, sp.full_shape));
    }
  }
  // Layers: each stacked tensor's layers point at converted memory, or at nothing for a quantized matrix.
  for (int64_t i = 0; i < c.layers; ++i) {
    const model::LayerSlot s = model::slot_of_layer(c, i);
    const auto specs = model::layer_specs(c, s.kind());
    QuantLayer& ql = q->layers[static_cast<size_t>(i)];
    ql.parts.resize(specs.size());
    for (size_t j = 0; j < specs.size(); ++j) {
      const model::ParamSpec& spec = specs[j];
      const std::string native = "layers." + std::to_string(i) + "." + spec.name;
      const model::StackedParam* csp = params->find(model::group_name(s.group) + "." + spec.name);
      if (!csp) throw std::logic_error("load_gguf_weights: no stack for " + native);
      auto& sp = const_cast<model::StackedParam&>(*csp);
      const int64_t per_block = sp.lead.size() > 1 ? sp.lead[1] : 1;
      const size_t at = static_cast<size_t>(s.block * per_block + s.local);
      if (sp.layers.empty()) sp.layers.assign(static_cast<size_t>(numel(sp.lead)), nullptr);
      const bool router = model::ffn_offset(s.kind()) + model::p::kRouter == static_cast<int>(j) && c.moe();
      std::optional<std::vector<QuantMatrix>> qm;
      if (spec.is_matrix && !router) qm = quant_parts(r, gguf::verbatim_sources(r, c, native), spec.shape);
      // Qwen3.5's V-head order (gguf/import.cpp, ungroup_v_heads): native head h = g * r + j is the file's j * hk + g.
      const bool reorder = c.family == model::Family::Qwen3_5 && c.k_heads != c.v_heads;
      const std::string b = "blk." + std::to_string(i) + ".";
      const int64_t hk = c.k_heads, rr = reorder ? c.v_heads / c.k_heads : 1, dv = c.dv;
      if (!qm && reorder && s.kind() == model::LayerKind::LinearAttention &&
          (j == model::p::kQkv || j == model::p::kZ)) {
        const int64_t first = j == model::p::kQkv ? 2 * c.key_dim() : 0;  // the rows before the value heads
        qm = quant_parts(r, {b + (j == model::p::kQkv ? "attn_qkv.weight" : "attn_gate.weight")}, spec.shape);
        if (qm) {  // rows copied into native order, still quantized
          QuantMatrix& m = (*qm)[0];
          Buffer buf = mem.allocate(static_cast<size_t>(m.rows * m.row_bytes), MemCategory::Parameters,
                                    native + " (quantized, V heads reordered)");
          if (!mem.planning()) {
            auto* dst = static_cast<uint8_t*>(buf.data());
            std::memcpy(dst, m.data, static_cast<size_t>(first * m.row_bytes));
            for (int64_t g = 0; g < hk; ++g)
              for (int64_t jj = 0; jj < rr; ++jj)
                std::memcpy(dst + (first + (g * rr + jj) * dv) * m.row_bytes,
                            m.data + (first + (jj * hk + g) * dv) * m.row_bytes, static_cast<size_t>(dv * m.row_bytes));
          }
          m.data = static_cast<const uint8_t*>(buf.data());
          w->copied_bytes += buf.bytes();
          w->owned.push_back(std::move(buf));
          ql.parts[j] = std::move(*qm);
          continue;
        }
      }
      if (!qm && reorder && s.kind() == model::LayerKind::LinearAttention && j == model::p::kOut) {
        qm = quant_parts(r, {b + "ssm_out.weight"}, spec.shape);
        if (qm) {
          (*qm)[0].col_hk = hk;
          (*qm)[0].col_r = rr;
          (*qm)[0].col_block = dv;
        }
      }
      if (qm) {
        count(*qm);
        ql.parts[j] = std::move(*qm);
      } else {
        sp.layers[at] = convert(native, spec.shape);
      }
    }
  }
  w->quant = std::move(q);
  w->mapped_bytes = w->quant->bytes;
  w->mapped = w->copied_bytes == 0;
  if (!converted.empty()) {
    std::string list;
    for (const std::string& n : converted) list += (list.empty() ? "" : ", ") + n;
    w->notes.push_back("converted to fp32 (small, or not stored verbatim in a quantized type): " + list);
  }
  w->params = std::move(params);
  return w;
}

}  // namespace hs::infer
