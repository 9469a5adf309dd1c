#include "cli/gguf_options.h"

#include <cstdio>
#include <stdexcept>

#include "gguf/import.h"

namespace hs::cli {

void add_gguf_options(CLI::App* c, GgufArgs& a) {
  CLI::Option* blocks =
      c->add_flag("--gguf-blocks", a.blocks,
                  "With a .gguf file: run from its quantized blocks (the default; this flag makes a conflicting option "
                  "an error instead of a switch to --gguf-dequantize). Products on Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K "
                  "blocks: decode with activations quantized per row as llama.cpp does; prefill on dequantized "
                  "tiles, in bf16 where the CPU has bf16 products (docs/quantization.md); fp32 compute otherwise");
  c->add_flag("--gguf-dequantize", a.dequantize,
              "With a .gguf file: dequantize every tensor at load (fp32, bf16 where the file's embedding is BF16) and "
              "run as from any checkpoint: the weights take their fp32 size")
      ->excludes(blocks);
}

bool gguf_from_blocks(const GgufArgs& a, const std::string& path, const std::vector<std::string>& needs,
                      const char* command) {
  const bool gguf = gguf::is_gguf_path(path);
  if (a.blocks && !gguf)
    throw std::invalid_argument("--gguf-blocks runs a .gguf file from its quantized blocks; " + path + " is not one");
  if (a.dequantize && !gguf)
    throw std::invalid_argument("--gguf-dequantize dequantizes a .gguf file at load; " + path + " is not one");
  if (!gguf || a.dequantize) return false;
  std::string given;
  for (const std::string& n : needs) given += (given.empty() ? "" : ", ") + n;
  if (a.blocks && !given.empty())
    throw std::invalid_argument("--gguf-blocks: " + given + " needs the dequantized weights (leave out --gguf-blocks "
                                "to dequantize at load, or leave out " + given + ")");
  if (!given.empty()) {
    std::fprintf(stderr, "%s: %s is dequantized at load: %s needs the dequantized weights\n", command, path.c_str(),
                 given.c_str());
    return false;
  }
  return true;
}

}  // namespace hs::cli
