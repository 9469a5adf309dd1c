// serve: an OpenAI-compatible HTTP server over a checkpoint (src/serve, docs/serving.md).
#include <omp.h>

#include <cstdio>
#include <fstream>
#include <memory>

#include "cli/commands.h"
#include "cli/gguf_options.h"
#include "cli/speculative_options.h"
#include "cli/step_options.h"
#include "cli/threads.h"
#include "core/memory.h"
#include "serve/server.h"

namespace hs::cli {

namespace {

struct ServeArgs {
  serve::ServeOptions opt;
  std::string api_key_file, cache_bytes = "1GiB", max_body = "1MiB";
  int threads = 0;
  SpeculativeArgs spec;
  GgufArgs gguf;  // --gguf-blocks, --gguf-dequantize
};

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' || s.back() == '\t')) s.pop_back();
  return s;
}

void run_serve(ServeArgs a) {
  apply_threads(a.threads);
  if (!a.api_key_file.empty()) {
    std::ifstream in(a.api_key_file);
    if (!in) throw std::invalid_argument("cannot read --api-key-file " + a.api_key_file);
    std::getline(in, a.opt.api_key);
    a.opt.api_key = trim(a.opt.api_key);
    if (a.opt.api_key.empty()) throw std::invalid_argument("--api-key-file " + a.api_key_file + " holds no key");
  }
  if (a.opt.engine.parallel <= 0) throw std::invalid_argument("--parallel must be at least 1");
  if (a.opt.engine.context < 0) throw std::invalid_argument("--ctx must be positive (0: the model's, at most 4096)");
  if (a.opt.engine.queue < 0) throw std::invalid_argument("--queue must be >= 0");
  if (a.opt.engine.prefill_chunk <= 0 || a.opt.engine.prefill_chunk % 64 != 0)
    throw std::invalid_argument("--prefill-chunk must be a positive multiple of 64 (the prefix cache's chunk)");
  if (a.opt.port < 0 || a.opt.port > 65535) throw std::invalid_argument("--port must be in [0, 65535] (0: any free)");
  a.opt.engine.draft = speculative_draft(a.spec);
  std::vector<std::string> needs_dequantized;
  if (a.opt.engine.draft > 0) needs_dequantized.push_back("--speculative mtp");
  if (!a.opt.weight_dtype.empty()) needs_dequantized.push_back("--weight-dtype " + a.opt.weight_dtype);
  a.opt.gguf_blocks = gguf_from_blocks(a.gguf, a.opt.checkpoint.string(), needs_dequantized, "serve");
  a.opt.engine.cache_bytes = parse_bytes(a.cache_bytes);
  a.opt.max_body = parse_bytes(a.max_body);
  a.opt.engine.threads = omp_get_max_threads();
  a.opt.on_listening = [](int port) {
    std::printf("listening on port %d\n", port);
    std::fflush(stdout);
  };
  const int rc = serve::run_server(a.opt);
  if (rc != 0) throw std::runtime_error("the HTTP listener stopped with an error");
}

}  // namespace

void register_serve(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  CLI::App* c = app.add_subcommand("serve", "Serve a checkpoint over an OpenAI-compatible HTTP API (docs/serving.md)");
  c->add_option("--checkpoint", a->opt.checkpoint,
                "Checkpoint directory (native or Hugging Face) or .gguf file (run from its quantized blocks unless "
                "--gguf-dequantize)")
      ->required()
      ->check(CLI::ExistingPath);
  add_gguf_options(c, a->gguf);
  c->add_option("--chat-template", a->opt.chat_template,
                "A chat template (.jinja file, or a directory holding one) for chat requests instead of the "
                "checkpoint's own (chat_template.jinja or tokenizer_config.json's chat_template)")
      ->check(CLI::ExistingPath);
  c->add_option("--host", a->opt.host, "Address to listen on")->capture_default_str();
  c->add_option("--port", a->opt.port, "Port (0: any free one, printed at start)")->capture_default_str();
  c->add_option("--parallel", a->opt.engine.parallel, "Slots: requests decoded together")->capture_default_str();
  c->add_option("--ctx", a->opt.engine.context,
                "Positions per slot, prompt and answer (0: the model's max_position_embeddings, at most 4096)")
      ->capture_default_str();
  auto* key = c->add_option("--api-key", a->opt.api_key, "Ask every /v1 request for 'Authorization: Bearer KEY'");
  c->add_option("--api-key-file", a->api_key_file, "Read the API key from this file's first line")->excludes(key);
  c->add_option("--cache-bytes", a->cache_bytes, "Prefix cache budget, e.g. 512MiB (0: no prefix cache)")
      ->capture_default_str();
  c->add_option("--queue", a->opt.engine.queue, "Requests that may wait for a slot (beyond them: 429)")
      ->capture_default_str();
  c->add_option("--prefill-chunk", a->opt.engine.prefill_chunk,
                "Prompt tokens prefilled between two decode steps (a multiple of 64)")
      ->capture_default_str();
  c->add_option("--max-body", a->max_body, "Largest request body (beyond it: 413)")->capture_default_str();
  c->add_option("--timeout", a->opt.read_timeout_s, "Seconds a client may stall sending or reading (then dropped)")
      ->capture_default_str();
  c->add_option("--request-timeout", a->opt.request_timeout_s,
                "Seconds a client has to send a whole request (from connecting, or from the previous answer on a "
                "kept-alive connection); then it is dropped, however it trickles")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  add_speculative_options(c, a->spec);
  add_dtype_option(c, "--weight-dtype", a->opt.weight_dtype, "Convert the weights at load: fp32 | bf16 (default: as stored)");
  c->add_option("--weights-memory", a->opt.weights_memory,
                "Where the weights live: map (in place from the files' mapping), copy (into memory), auto (as generate)")
      ->check(CLI::IsMember({"map", "copy", "auto"}))
      ->capture_default_str();
  add_threads_option(c, a->threads);
  c->callback([a] {
    a->opt.write_timeout_s = a->opt.read_timeout_s;
    run_serve(*a);
  });
}

}  // namespace hs::cli
