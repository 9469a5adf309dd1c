// hybridscan serve: an OpenAI-compatible HTTP server over the engine (docs/serving.md). HTTP is cpp-httplib
// (Debian's libcpp-httplib-dev): a thread per connection from a pool, which suits a server whose work happens on one
// scheduler thread anyway, with server-sent events through its chunked content provider.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

#include "serve/engine.h"

namespace hs::serve {

struct ServeOptions {
  std::filesystem::path checkpoint;  // a checkpoint directory or a .gguf file
  std::filesystem::path chat_template;  // a .jinja file for chat requests; empty: the checkpoint's own
  std::string host = "127.0.0.1";
  int port = 8080;
  EngineOptions engine;
  std::string api_key;            // empty: no key asked
  size_t max_body = 1 << 20;      // request bodies above this: 413
  int read_timeout_s = 10, write_timeout_s = 10;  // a client that stalls longer is dropped
  int request_timeout_s = 30;  // a request (line, headers, body) not all in within this from the connection's start
                               // or the previous answer: the connection is dropped
  std::string weight_dtype;       // empty: as stored
  // A .gguf checkpoint run from its quantized blocks (infer::load_gguf_weights, as generate does by default); without
  // it a .gguf file is dequantized at load (imported for the run). The command line sets it (cli/gguf_options.h).
  bool gguf_blocks = false;
  std::string weights_memory = "auto";  // map | copy | auto (infer::parse_weights_memory)
  // Called once the port is bound (the port is known then: `port` 0 asks for a free one).
  std::function<void(int port)> on_listening;
};

// Serves until SIGTERM or SIGINT, then stops admitting, lets the running requests finish and returns 0. Throws
// std::invalid_argument / std::runtime_error for a bad checkpoint or options, or a port it cannot bind.
int run_server(const ServeOptions& opt);

}  // namespace hs::serve
