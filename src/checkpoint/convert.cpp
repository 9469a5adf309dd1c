#include "checkpoint/convert.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <set>
#include <stdexcept>

namespace hs::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

std::string format_name(Format f) { return f == Format::Native ? "native" : "huggingface"; }

HfLayout identity_layout(const model::ModelConfig& c) {
  HfLayout out;
  MemoryAccountant plan(true);
  model::ParamSet ps(c, DType::F32, plan, MemCategory::Parameters, false);
  for (const auto& p : ps.all()) {
    out.hf.push_back({p.name, p.tensor.shape(), {{out.stacked.size(), 0, 0, p.tensor.numel()}}});
    out.stacked.push_back({p.name, p.tensor.shape()});
  }
  return out;
}

namespace {

const char* kNativeFile = "hybridscan.json";
const char* kOptimizerFile = "optimizer.safetensors";
// The tokenizer files (and generation config) of a Hugging Face checkpoint: they travel with the weights through
// every conversion.
const char* const kTokenizerFiles[] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                       "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja"};

void copy_file_atomically(const fs::path& from, const fs::path& to) {
  std::ifstream f(from, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + from.string());
  AtomicFile out(to);
  std::vector<char> buf(size_t(1) << 20);
  while (f) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    out.write(std::as_bytes(std::span(buf.data(), static_cast<size_t>(f.gcount()))));
  }
  if (f.bad()) throw std::runtime_error("error reading " + from.string());
  out.commit();
}

json read_json(const fs::path& p) {
  std::ifstream f(p);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    throw std::runtime_error(p.string() + ": invalid JSON: " + e.what());
  }
}

std::string expert_layout_name(ExpertLayout e) { return e == ExpertLayout::Fused ? "fused" : "per_expert"; }
ExpertLayout parse_expert_layout(const std::string& s) {
  if (s == "fused") return ExpertLayout::Fused;
  if (s == "per_expert") return ExpertLayout::PerExpert;
  throw std::runtime_error("unknown expert layout '" + s + "' in hybridscan.json");
}

// A source checkpoint bound to the stacked coordinates: for every stacked tensor, the pieces of source tensors
// that cover it, sorted by stacked offset.
struct Piece {
  int64_t stacked_at, count;
  size_t source;  // index into layout.hf
  int64_t source_at;
};
struct Source {
  const CheckpointReader& reader;
  const HfLayout& layout;
  std::vector<const TensorInfo*> info;  // per layout.hf entry
  std::vector<const SafetensorsReader*> file;
  std::vector<std::vector<Piece>> pieces;  // per stacked tensor

  Source(const CheckpointReader& r, const HfLayout& l) : reader(r), layout(l), pieces(l.stacked.size()) {
    const std::string where = r.path().string();
    for (size_t i = 0; i < l.hf.size(); ++i) {
      const HfTensor& t = l.hf[i];
      if (!r.contains(t.name)) throw std::runtime_error(where + ": missing tensor '" + t.name + "'");
      const TensorInfo& ti = r.info(t.name);
      if (ti.shape != t.shape)
        throw std::runtime_error(where + ": tensor '" + t.name + "' has shape " + shape_str(ti.shape) + ", expected " +
                                 shape_str(t.shape) + " for this config");
      info.push_back(&ti);
      file.push_back(&r.file_of(t.name));
      for (const ElementRun& run : t.runs) pieces[run.stacked].push_back({run.stacked_at, run.count, i, run.hf_at});
    }
    for (auto& p : pieces)
      std::sort(p.begin(), p.end(), [](const Piece& a, const Piece& b) { return a.stacked_at < b.stacked_at; });
  }

  // Calls f(source index, element offset in the source, count) for the source elements that hold stacked
  // elements [at, at + count) of stacked tensor k, in order.
  template <typename F> void for_range(size_t k, int64_t at, int64_t count, F&& f) const {
    const auto& ps = pieces[k];
    auto it = std::upper_bound(ps.begin(), ps.end(), at, [](int64_t v, const Piece& p) { return v < p.stacked_at; });
    if (it != ps.begin()) --it;
    const int64_t end = at + count;
    for (; at < end; ++it) {
      if (it == ps.end() || it->stacked_at > at)
        throw std::logic_error("stacked element " + std::to_string(at) + " of " + layout.stacked[k].name + " has no source");
      const int64_t off = at - it->stacked_at;
      const int64_t n = std::min(end, it->stacked_at + it->count) - at;
      if (n <= 0) continue;
      f(it->source, it->source_at + off, n);
      at += n;
    }
  }
};

// Every tensor of the checkpoint must be one the layout expects, or one that is deliberately skipped.
size_t check_no_strangers(const CheckpointReader& r, const HfLayout& l, Format f) {
  std::set<std::string> expected;
  for (const HfTensor& t : l.hf) expected.insert(t.name);
  size_t skipped = 0;
  for (const std::string& n : r.tensor_names()) {
    if (expected.count(n)) continue;
    if (f == Format::HuggingFace && is_skipped_hf_tensor(n)) {
      ++skipped;
      continue;
    }
    throw std::runtime_error(r.path().string() + ": unexpected tensor '" + n +
                             "': it does not belong to this config (wrong family, layer count or layout?)");
  }
  return skipped;
}

// Moves a finished temporary directory into place.
void install_directory(const fs::path& tmp, const fs::path& to, bool overwrite) {
  if (fs::exists(to)) {
    if (!fs::is_directory(to)) throw std::runtime_error("destination " + to.string() + " exists and is not a directory");
    if (!fs::is_empty(to) && !overwrite)
      throw std::runtime_error("destination " + to.string() + " exists and is not empty, and replacing it was not asked for");
    const fs::path old = to.parent_path() / ("." + to.filename().string() + ".old-" + std::to_string(getpid()));
    fs::rename(to, old);
    fs::rename(tmp, to);
    fs::remove_all(old);
  } else {
    fs::rename(tmp, to);
  }
  fsync_directory(to.parent_path().empty() ? fs::path(".") : to.parent_path());
}

fs::path temp_dir_for(const fs::path& to) {
  fs::path parent = to.parent_path().empty() ? fs::path(".") : to.parent_path();
  fs::create_directories(parent);
  return parent / ("." + to.filename().string() + ".tmp-" + std::to_string(getpid()));
}

// Removes the temporary directory unless released (all error paths).
struct TempDir {
  fs::path path;
  bool keep = false;
  ~TempDir() {
    if (!keep) {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  }
};

HfLayout layout_of(const CheckpointDir& d) {
  if (d.format == Format::HuggingFace) return hf_layout(d.config, d.hf.experts, d.hf.prefix);
  return d.layout == Layout::Scanned ? identity_layout(d.config) : unscanned_layout(d.config);
}

}  // namespace

CheckpointDir open_checkpoint_dir(const fs::path& path) {
  CheckpointDir d;
  d.path = path;
  if (fs::is_regular_file(path) && path.extension() == ".safetensors") d.path = path.parent_path();
  if (!fs::is_directory(d.path)) throw std::runtime_error(path.string() + " is not a checkpoint directory");
  if (!fs::exists(d.path / "config.json"))
    throw std::runtime_error(d.path.string() + " has no config.json: not a Hugging Face or hybridscan checkpoint");
  d.config_json = read_json(d.path / "config.json");
  try {
    d.config = model::config_from_hf_json(d.config_json, (d.path / "config.json").string());
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(e.what());
  }
  if (fs::exists(d.path / kNativeFile)) {
    d.format = Format::Native;
    d.native = read_json(d.path / kNativeFile);
    if (d.native.value("format", "") != "hybridscan-native")
      throw std::runtime_error((d.path / kNativeFile).string() + ": not a hybridscan checkpoint description");
    const std::string layout = d.native.value("layout", "scanned");
    if (layout != "scanned" && layout != "unscanned")
      throw std::runtime_error((d.path / kNativeFile).string() + ": unknown layout '" + layout + "'");
    d.layout = layout == "scanned" ? Layout::Scanned : Layout::Unscanned;
    const json hf = d.native.value("hf", json::object());
    d.hf.prefix = hf.value("prefix", hf_prefix(d.config.family));
    d.hf.experts = parse_expert_layout(hf.value("experts", expert_layout_name(default_expert_layout(d.config.family))));
    const json meta = hf.value("metadata", json::object());
    for (auto& [k, v] : meta.items()) d.hf_metadata[k] = v.get<std::string>();
  } else {
    d.format = Format::HuggingFace;
    d.layout = Layout::Unscanned;
    CheckpointReader r(d.path);
    try {
      d.hf = detect_hf_layout(r.tensor_names(), d.config);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(d.path.string() + ": " + e.what());
    }
    if (!r.files().empty()) d.hf_metadata = r.files().front().metadata();
    // A config that announces an MTP layer over files without one (a copy whose mtp.* tensors were dropped, as
    // transformers' save_pretrained does): the decoder alone, and config.json says so from here on.
    if (d.config.mtp_layers > 0) {
      const auto names = r.tensor_names();
      if (std::none_of(names.begin(), names.end(), [](const std::string& n) { return n.rfind("mtp.", 0) == 0; })) {
        d.config.mtp_layers = 0;
        nlohmann::json& t = d.config_json.contains("text_config") ? d.config_json["text_config"] : d.config_json;
        t[d.config.family == model::Family::Qwen3Next ? "num_nextn_predict_layers" : "mtp_num_hidden_layers"] = 0;
      }
    }
  }
  d.tensors = layout_of(d);
  return d;
}

std::vector<std::string> load_parameters(const CheckpointDir& d, model::ParamSet& params, const std::vector<bool>* only) {
  CheckpointReader r(d.path);
  std::vector<std::string> notes;
  if (size_t skipped = check_no_strangers(r, d.tensors, d.format))
    notes.push_back("skipped " + std::to_string(skipped) + " tensors outside the text decoder (mtp.*, model.visual.*)");
  Source src(r, d.tensors);
  std::vector<float> buf;
  for (size_t i = 0; i < d.tensors.hf.size(); ++i) {
    const HfTensor& t = d.tensors.hf[i];
    auto wanted = [&](const ElementRun& run) { return !only || only->at(run.stacked); };
    if (std::none_of(t.runs.begin(), t.runs.end(), wanted)) continue;
    buf.resize(static_cast<size_t>(numel(t.shape)));
    r.read_f32(t.name, buf);
    for (const ElementRun& run : t.runs) {
      if (!wanted(run)) continue;
      const TensorView& dst = params.all()[run.stacked].tensor.view();
      if (dst.dtype == DType::F32) std::copy_n(buf.data() + run.hf_at, run.count, static_cast<float*>(dst.data) + run.stacked_at);
      else convert(buf.data() + run.hf_at, static_cast<bf16*>(dst.data) + run.stacked_at, static_cast<size_t>(run.count));
    }
    release_mapped_pages(r.bytes(t.name));
  }
  return notes;
}

ConvertReport convert_checkpoint(const fs::path& from, const fs::path& to, const ConvertOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  CheckpointDir src = open_checkpoint_dir(from);
  if (fs::exists(to) && fs::equivalent(src.path, to))
    throw std::runtime_error("source and destination are the same directory: " + to.string());
  CheckpointReader reader(src.path);
  ConvertReport rep;
  rep.skipped = check_no_strangers(reader, src.tensors, src.format);
  if (rep.skipped)
    rep.notes.push_back("skipped " + std::to_string(rep.skipped) +
                        " tensors that are not part of the text decoder (mtp.*, model.visual.*)");
  Source source(reader, src.tensors);

  HfLayout target;
  if (opt.to == Format::HuggingFace) target = hf_layout(src.config, src.hf.experts, src.hf.prefix);
  else target = opt.layout == Layout::Scanned ? identity_layout(src.config) : unscanned_layout(src.config);

  // Each target tensor takes the dtype of its source elements, which must agree (a stacked tensor gathers the same
  // tensor of every layer).
  std::vector<TensorDecl> decls;
  std::map<std::string, size_t> target_index;
  for (size_t i = 0; i < target.hf.size(); ++i) {
    const HfTensor& t = target.hf[i];
    std::optional<FileDType> dt;
    std::string first;
    for (const ElementRun& run : t.runs)
      source.for_range(run.stacked, run.stacked_at, run.count, [&](size_t s, int64_t, int64_t) {
        FileDType d = source.info[s]->dtype;
        if (!dt) {
          dt = d;
          first = src.tensors.hf[s].name;
        } else if (*dt != d) {
          throw std::runtime_error(src.path.string() + ": '" + first + "' is " + std::string(file_dtype_name(*dt)) +
                                   " but '" + src.tensors.hf[s].name + "' is " + std::string(file_dtype_name(d)) +
                                   "; they are stacked into one tensor and must share a dtype");
        }
      });
    decls.push_back({t.name, dt.value_or(FileDType::F32), t.shape});
    target_index[t.name] = i;
  }
  if (opt.to == Format::HuggingFace) sort_like_reference_writer(decls);

  std::map<std::string, std::string> metadata = src.hf_metadata;
  if (opt.to == Format::HuggingFace && metadata.empty()) metadata["format"] = "pt";
  if (opt.to == Format::Native) metadata = {{"format", "hybridscan"}};

  TempDir tmp{temp_dir_for(to)};
  fs::remove_all(tmp.path);
  {
    ShardedWriter w(tmp.path, decls, opt.max_shard_bytes, metadata);
    size_t done = 0;
    for (const TensorDecl& d : decls) {
      const HfTensor& t = target.hf[target_index.at(d.name)];
      const size_t es = file_dtype_size(d.dtype);
      for (const ElementRun& run : t.runs)
        source.for_range(run.stacked, run.stacked_at, run.count, [&](size_t s, int64_t at, int64_t n) {
          auto bytes = source.file[s]->bytes(*source.info[s]).subspan(static_cast<size_t>(at) * es, static_cast<size_t>(n) * es);
          w.write(d.name, bytes);
          release_mapped_pages(bytes);
        });
      rep.bytes += d.nbytes();
      ++rep.tensors;
      if (opt.progress && (++done % 64 == 0 || done == decls.size()))
        opt.progress("wrote " + std::to_string(done) + "/" + std::to_string(decls.size()) + " tensors, " +
                     format_bytes(double(rep.bytes)));
    }
    w.commit();
  }
  write_file_atomically(tmp.path / "config.json", src.config_json.dump(2) + "\n");
  if (opt.to == Format::Native) {
    json hf = {{"prefix", src.hf.prefix}, {"experts", expert_layout_name(src.hf.experts)}, {"metadata", src.hf_metadata}};
    json native = {{"format", "hybridscan-native"},
                   {"version", 1},
                   {"layout", opt.layout == Layout::Scanned ? "scanned" : "unscanned"},
                   {"family", model::family_name(src.config.family)},
                   {"hf", hf},
                   {"source", src.path.string()}};
    if (src.format == Format::Native && src.native.contains("state")) native["state"] = src.native["state"];
    write_file_atomically(tmp.path / kNativeFile, native.dump(2) + "\n");
  }
  for (const char* name : kTokenizerFiles)
    if (fs::is_regular_file(src.path / name)) copy_file_atomically(src.path / name, tmp.path / name);
  install_directory(tmp.path, to, opt.overwrite);
  tmp.keep = true;
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

void save_native(const fs::path& dir, const TrainingState& s, bool overwrite) {
  const model::ParamSet& ps = *s.params;
  const model::ModelConfig& c = ps.config();
  TempDir tmp{temp_dir_for(dir)};
  fs::remove_all(tmp.path);
  auto write_set = [](const fs::path& dir_or_file, const std::vector<std::pair<std::string, const model::ParamSet*>>& sets,
                      bool sharded) {
    std::vector<TensorDecl> decls;
    for (const auto& [prefix, set] : sets)
      for (const auto& p : set->all()) decls.push_back({prefix + p.name, to_file_dtype(p.tensor.dtype()), p.tensor.shape()});
    auto emit = [&](auto& w) {
      for (const auto& [prefix, set] : sets)
        for (const auto& p : set->all())
          w.write(prefix + p.name, std::span(static_cast<const std::byte*>(p.tensor.data()), p.tensor.nbytes()));
    };
    if (sharded) {
      ShardedWriter w(dir_or_file, decls, 5'000'000'000ull, {{"format", "hybridscan"}});
      emit(w);
      w.commit();
    } else {
      SafetensorsWriter w(dir_or_file, decls, {{"format", "hybridscan"}});
      emit(w);
      w.commit();
    }
  };
  write_set(tmp.path, {{"", &ps}}, true);
  if (s.m && s.v) write_set(tmp.path / kOptimizerFile, {{"m.", s.m}, {"v.", s.v}}, false);
  json cfg = s.state.contains("config_json") ? s.state["config_json"] : model::config_to_hf_json(c);
  write_file_atomically(tmp.path / "config.json", cfg.dump(2) + "\n");
  json native = {{"format", "hybridscan-native"}, {"version", 1}, {"layout", "scanned"},
                 {"family", model::family_name(c.family)}};
  json state = s.state;
  state.erase("config_json");
  if (state.contains("hf")) {
    native["hf"] = state["hf"];
    state.erase("hf");
  }
  native["state"] = state;
  write_file_atomically(tmp.path / kNativeFile, native.dump(2) + "\n");
  if (!s.tokenizer.empty()) copy_file_atomically(s.tokenizer, tmp.path / "tokenizer.json");
  install_directory(tmp.path, dir, overwrite);
  tmp.keep = true;
}

void load_optimizer_state(const CheckpointDir& d, model::ParamSet& m, model::ParamSet& v) {
  const fs::path p = d.path / kOptimizerFile;
  if (!fs::exists(p)) throw std::runtime_error(d.path.string() + " holds no optimizer state (" + kOptimizerFile + ")");
  SafetensorsReader r(p);
  for (auto [prefix, set] : {std::pair<const char*, model::ParamSet*>{"m.", &m}, {"v.", &v}})
    for (auto& t : set->all()) {
      const TensorInfo& info = r.at(prefix + t.name);
      if (info.shape != t.tensor.shape() || info.dtype != to_file_dtype(t.tensor.dtype()))
        throw std::runtime_error(p.string() + ": '" + prefix + t.name + "' has the wrong shape or dtype");
      auto bytes = r.bytes(info);
      std::memcpy(t.tensor.data(), bytes.data(), bytes.size());
    }
}

}  // namespace hs::checkpoint
