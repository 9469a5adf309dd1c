// convert, inspect and eval: the checkpoint-facing subcommands.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/convert.h"
#include "cli/commands.h"
#include "cli/gguf_options.h"
#include "cli/step_options.h"
#include "gguf/export.h"
#include "gguf/import.h"
#include "infer/decoder.h"
#include "infer/weights.h"
#include "train/data.h"
#include "train/evaluate.h"

namespace hs::cli {

namespace {
// eval --gguf-blocks: the windows of train::evaluate_tokens, each prefilled whole through the decoder on the file's
// quantized blocks (infer/quant_prefill.h) with the logits of every position; cross-entropy from each row's
// log-sum-exp in double. One window at a time (the decoder's one slot; --batch does not apply).
train::EvalResult evaluate_gguf_blocks(const infer::InferenceWeights& w, const dataset::TokenSource& tokens,
                                       int64_t seq, MemoryAccountant& mem) {
  const int64_t V = w.params->config().vocab;
  infer::Decoder dec(*w.params, DType::F32, 1, seq, mem, 512, w.quant.get());
  std::vector<float> logits(static_cast<size_t>(seq * V));
  train::EvalResult r;
  double sum = 0;
  const int64_t n = train::eval_batch_count(tokens.size(), seq, 1);
  for (int64_t i = 0; i < n; ++i) {
    const train::TokenBatch tb = train::eval_batch(tokens, seq, 1, i);
    dec.reset(0);
    dec.prefill(0, tb.inputs, logits.data(), /*all_logits=*/true);
    for (int64_t p = 0; p < tb.seq; ++p) {
      const int32_t t = tb.targets[static_cast<size_t>(p)];
      if (t < 0) continue;
      const float* row = logits.data() + p * V;
      const double mx = *std::max_element(row, row + V);
      double z = 0;
      for (int64_t v = 0; v < V; ++v) z += std::exp(double(row[v]) - mx);
      sum += std::log(z) + mx - double(row[t]);
      ++r.count;
      r.text_bytes += tokens.text_bytes(t);
    }
  }
  r.ce = r.count ? sum / static_cast<double>(r.count) : 0.0;
  r.bits_per_byte = r.text_bytes ? sum / std::log(2.0) / static_cast<double>(r.text_bytes) : 0.0;
  return r;
}
}  // namespace

void register_convert(CLI::App& app) {
  struct Args {
    std::string from, to, format = "native", layout = "scanned", max_shard = "5GB", quantize;
    bool overwrite = false, quiet = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* c = app.add_subcommand("convert",
                                   "Convert between a Hugging Face checkpoint (Qwen3-Next / Qwen3.5) and a native stacked one");
  c->add_option("--from", a->from, "Source checkpoint directory (format detected)")->required()->check(CLI::ExistingDirectory);
  c->add_option("--to", a->to, "Destination directory (must be new or empty unless --overwrite)")->required();
  c->add_option("--format", a->format, "Target format: native | hf")->check(CLI::IsMember({"native", "hf"}))->capture_default_str();
  c->add_option("--layout", a->layout, "Native layout: scanned ([block][local] stacks) | unscanned (one entry per layer)")
      ->check(CLI::IsMember({"scanned", "unscanned"}))->capture_default_str();
  c->add_option("--max-shard-size", a->max_shard, "Largest shard (tensor bytes), e.g. 5GB")->capture_default_str();
  c->add_flag("--overwrite", a->overwrite, "Replace a non-empty destination");
  c->add_flag("--quiet", a->quiet, "No progress lines");
  c->add_option("--quantize", a->quantize,
                "Write --to as one GGUF file llama.cpp loads: f32 | f16 | bf16 | q8_0 | q4_k | q5_k | q6_k | mixed "
                "(docs/gguf.md)");
  c->callback([a] {
    if (!a->quantize.empty()) {
      const gguf::QuantScheme s = gguf::parse_quant_scheme(a->quantize);
      if (!gguf::is_gguf_path(a->to)) throw std::invalid_argument("--quantize writes a GGUF file: --to must end in .gguf");
      if (std::filesystem::exists(a->to) && !a->overwrite)
        throw std::invalid_argument(a->to + " exists (--overwrite replaces it)");
      const gguf::ExportReport r = gguf::export_gguf(a->from, a->to, s);
      for (const auto& n : r.notes) std::fprintf(stderr, "convert: note: %s\n", n.c_str());
      std::printf("converted %s -> %s (gguf %s, %s): %zu tensors, %s\n", a->from.c_str(), a->to.c_str(),
                  r.architecture.c_str(), gguf::quant_scheme_name(s).c_str(), r.tensors,
                  format_bytes(double(r.bytes)).c_str());
      return;
    }
    checkpoint::ConvertOptions o;
    o.to = a->format == "hf" ? checkpoint::Format::HuggingFace : checkpoint::Format::Native;
    o.layout = a->layout == "scanned" ? checkpoint::Layout::Scanned : checkpoint::Layout::Unscanned;
    o.max_shard_bytes = parse_bytes(a->max_shard);
    o.overwrite = a->overwrite;
    if (!a->quiet) o.progress = [](const std::string& s) { std::fprintf(stderr, "convert: %s\n", s.c_str()); };
    checkpoint::ConvertReport r = checkpoint::convert_checkpoint(a->from, a->to, o);
    for (const auto& n : r.notes) std::fprintf(stderr, "convert: note: %s\n", n.c_str());
    std::printf("converted %s -> %s (%s%s): %zu tensors, %s in %.1f s\n", a->from.c_str(), a->to.c_str(), a->format.c_str(),
                o.to == checkpoint::Format::Native ? (", " + a->layout).c_str() : "", r.tensors,
                format_bytes(double(r.bytes)).c_str(), r.seconds);
  });
}

void register_inspect(CLI::App& app) {
  struct Args {
    std::string path;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* c = app.add_subcommand("inspect", "List a checkpoint's tensors, its layout, family and parameter count");
  c->add_option("path", a->path, "Checkpoint directory or .gguf file")->required()->check(CLI::ExistingPath);
  c->add_flag("--json", a->json, "Print JSON");
  c->callback([a] {
    const gguf::CheckpointPath source(a->path);  // a .gguf file is imported for the run
    checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(source.path());
    checkpoint::CheckpointReader r(d.path);
    nlohmann::json tensors = nlohmann::json::array();
    uint64_t elems = 0, bytes = 0, skipped = 0, mtp_elems = 0;
    std::set<std::string> known;  // the names the layout reads (mtp.* among them when the model has an MTP layer)
    for (const auto& t : d.tensors.hf) known.insert(t.name);
    for (const auto& n : r.tensor_names()) {
      const auto& t = r.info(n);
      tensors.push_back({{"name", n}, {"dtype", std::string(checkpoint::file_dtype_name(t.dtype))}, {"shape", t.shape}, {"bytes", t.nbytes()}});
      if (d.format == checkpoint::Format::HuggingFace && !known.count(n) && checkpoint::is_skipped_hf_tensor(n)) {
        ++skipped;
        continue;
      }
      elems += t.numel();
      bytes += t.nbytes();
      if (n.rfind("mtp.", 0) == 0) mtp_elems += t.numel();
    }
    const std::string layout = d.format == checkpoint::Format::Native
                                   ? (d.layout == checkpoint::Layout::Scanned ? "scanned" : "unscanned")
                                   : std::string("hugging face per-layer, prefix '") + d.hf.prefix + "', experts " +
                                         (d.hf.experts == checkpoint::ExpertLayout::Fused ? "fused" : "per-expert");
    if (a->json) {
      std::printf("%s\n", nlohmann::json({{"format", checkpoint::format_name(d.format)}, {"layout", layout},
                                          {"family", model::family_name(d.config.family)}, {"parameters", elems},
                                          {"mtp_layers", d.config.mtp_layers}, {"mtp_parameters", mtp_elems},
                                          {"bytes", bytes}, {"skipped_tensors", skipped}, {"tensors", tensors}})
                              .dump()
                              .c_str());
      return;
    }
    std::printf("%-72s %-5s %-28s %12s\n", "tensor", "dtype", "shape", "bytes");
    for (const auto& t : tensors)
      std::printf("%-72s %-5s %-28s %12s\n", t["name"].get<std::string>().c_str(), t["dtype"].get<std::string>().c_str(),
                  shape_str(t["shape"].get<Shape>()).c_str(), format_bytes(double(t["bytes"].get<uint64_t>())).c_str());
    std::printf("\nformat: %s, layout: %s\nmodel: %s\nparameters: %llu (%s)%s\n", checkpoint::format_name(d.format).c_str(),
                layout.c_str(), model::describe(d.config).c_str(), (unsigned long long)elems,
                format_bytes(double(bytes)).c_str(),
                skipped ? (", plus " + std::to_string(skipped) + " tensors outside the text decoder (mtp/visual)").c_str() : "");
    if (d.config.mtp_layers)
      std::printf("multi-token prediction: %lld layer, %llu parameters (mtp.*)\n", (long long)d.config.mtp_layers,
                  (unsigned long long)mtp_elems);
    if (d.format == checkpoint::Format::Native && d.native.contains("state"))
      std::printf("training state: step %lld\n", (long long)d.native["state"].value("step", int64_t(0)));
  });
}

void register_eval(CLI::App& app) {
  struct Args {
    std::string checkpoint, compute = "fp32";
    train::DataOptions data;
    int64_t seq = 512, batch = 8;
    GgufArgs gguf;
  };
  auto a = std::make_shared<Args>();
  CLI::App* c = app.add_subcommand("eval", "Cross-entropy and bits per byte of a checkpoint (native or Hugging Face) "
                                           "on a text or a token file");
  c->add_option("--checkpoint", a->checkpoint, "Checkpoint directory or .gguf file")->required()->check(CLI::ExistingPath);
  auto* text = c->add_option("--text", a->data.text,
                             "Text file: encoded by --tokenizer, else by the checkpoint's tokenizer.json, else byte tokens")
                   ->check(CLI::ExistingFile);
  c->add_option("--data", a->data.data, "Token file from 'hybridscan tokenize' (memory-mapped)")
      ->check(CLI::ExistingFile)
      ->excludes(text);
  c->add_option("--tokenizer", a->data.tokenizer, "tokenizer.json (or a directory holding one); must be the model's own")
      ->check(CLI::ExistingPath);
  c->add_option("--seq", a->seq, "Window: N+1 tokens, consecutive windows overlap by one")->capture_default_str();
  c->add_option("--batch", a->batch, "Windows per forward pass")->capture_default_str();
  add_dtype_option(c, "--compute-dtype", a->compute, "fp32 | bf16");
  add_gguf_options(c, a->gguf);
  c->callback([a] {
    if (a->data.text.empty() && a->data.data.empty())
      throw std::invalid_argument("eval needs --text FILE or --data TOKENS (from 'hybridscan tokenize')");
    std::vector<std::string> needs_dequantized;
    if (a->compute != "fp32") needs_dequantized.push_back("--compute-dtype " + a->compute);
    const bool blocks = gguf_from_blocks(a->gguf, a->checkpoint, needs_dequantized, "eval");
    // A .gguf file is imported for the run (its tensors only when they are dequantized).
    const gguf::CheckpointPath source(a->checkpoint, blocks ? gguf::CheckpointPath::Weights::FromBlocks
                                                            : gguf::CheckpointPath::Weights::Dequantized);
    checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(source.path());
    // The data is checked against the model before any weight is read.
    const train::Tokens t = train::load_tokens(a->data, {d.config.vocab, train::checkpoint_tokenizer(source.path())});
    MemoryAccountant mem;
    train::EvalResult e;
    if (blocks) {
      const auto w = infer::load_gguf_weights(a->checkpoint, mem);
      for (const auto& n : w->notes) std::fprintf(stderr, "eval: %s\n", n.c_str());
      e = evaluate_gguf_blocks(*w, t.tokens, a->seq, mem);
    } else {
      model::ParamSet params(d.config, DType::F32, mem, MemCategory::Parameters, false);
      for (const auto& n : checkpoint::load_parameters(d, params)) std::fprintf(stderr, "eval: %s\n", n.c_str());
      e = train::evaluate_tokens(params, t.tokens, a->seq, a->batch, parse_dtype(a->compute), mem);
    }
    nlohmann::json j = {{"cross_entropy", e.ce}, {"tokens", e.count}, {"text_bytes", e.text_bytes},
                        {"bits_per_byte", e.bits_per_byte}, {"checkpoint", a->checkpoint}, {"seq", a->seq},
                        {"gguf_blocks", blocks}};
    if (!a->data.text.empty()) j["text"] = a->data.text;
    if (!a->data.data.empty()) j["data"] = a->data.data;
    if (!t.tokenizer.empty()) j["tokenizer"] = t.tokenizer;
    std::printf("%s\n", j.dump().c_str());
  });
}

}  // namespace hs::cli
