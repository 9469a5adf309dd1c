// How the subcommands that run a model (generate, eval, serve, plan --generate) use a .gguf checkpoint's weights,
// declared once: from its quantized blocks in place (the default: infer::load_gguf_weights, docs/gguf.md) or
// dequantized to fp32 / bf16 at load. --gguf-blocks insists on the blocks, --gguf-dequantize on the dequantized
// weights; without either, the blocks unless an option given needs the dequantized weights, which is then said.
#pragma once
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace hs::cli {

struct GgufArgs {
  bool blocks = false;      // --gguf-blocks
  bool dequantize = false;  // --gguf-dequantize
};

void add_gguf_options(CLI::App* c, GgufArgs& a);

// True to run `path` from its quantized blocks. needs: the options given that only the dequantized weights run, as
// written on the command line (e.g. "--speculative mtp", "--compute-dtype bf16"). Throws std::invalid_argument for
// --gguf-blocks or --gguf-dequantize with a path that is not a .gguf file, and for --gguf-blocks with one of `needs`.
// command: the subcommand's name, for the note printed when `needs` turns the default to the dequantized weights.
bool gguf_from_blocks(const GgufArgs& a, const std::string& path, const std::vector<std::string>& needs,
                      const char* command);

}  // namespace hs::cli
