// cli/gguf_options.h: how generate, eval, serve and plan --generate choose between a .gguf file's quantized blocks
// and its dequantized weights. Every branch of the choice, through the flags as CLI11 parses them.
#include "cli/gguf_options.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace hs::cli {
namespace {

GgufArgs parse(std::vector<std::string> args) {
  CLI::App app;
  GgufArgs a;
  add_gguf_options(&app, a);
  std::vector<std::string> rev(args.rbegin(), args.rend());
  app.parse(rev);
  return a;
}

TEST(GgufOptions, BlocksByDefaultUnlessAnOptionNeedsTheDequantizedWeights) {
  const std::string f = "model.gguf", dir = "some/checkpoint";
  EXPECT_TRUE(gguf_from_blocks(parse({}), f, {}, "test"));
  EXPECT_TRUE(gguf_from_blocks(parse({"--gguf-blocks"}), f, {}, "test"));
  EXPECT_FALSE(gguf_from_blocks(parse({"--gguf-dequantize"}), f, {}, "test"));
  // An option only the dequantized weights run: the default follows it (with a note on stderr) ...
  testing::internal::CaptureStderr();
  EXPECT_FALSE(gguf_from_blocks(parse({}), f, {"--speculative mtp"}, "test"));
  const std::string note = testing::internal::GetCapturedStderr();
  EXPECT_NE(note.find("test: model.gguf is dequantized at load: --speculative mtp needs the dequantized weights"),
            std::string::npos)
      << note;
  EXPECT_FALSE(gguf_from_blocks(parse({"--gguf-dequantize"}), f, {"--speculative mtp"}, "test"));
  // ... and --gguf-blocks refuses it, naming it.
  try {
    gguf_from_blocks(parse({"--gguf-blocks"}), f, {"--weight-dtype bf16", "--speculative mtp"}, "test");
    ADD_FAILURE() << "--gguf-blocks with options that need the dequantized weights was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--weight-dtype bf16, --speculative mtp needs the dequantized weights"),
              std::string::npos)
        << e.what();
  }
  // A checkpoint that is not a .gguf file: never the blocks, and either flag is an error.
  EXPECT_FALSE(gguf_from_blocks(parse({}), dir, {}, "test"));
  EXPECT_FALSE(gguf_from_blocks(parse({}), dir, {"--speculative mtp"}, "test"));
  EXPECT_THROW(gguf_from_blocks(parse({"--gguf-blocks"}), dir, {}, "test"), std::invalid_argument);
  EXPECT_THROW(gguf_from_blocks(parse({"--gguf-dequantize"}), dir, {}, "test"), std::invalid_argument);
  // Both flags at once: CLI11 refuses the command line.
  EXPECT_THROW(parse({"--gguf-blocks", "--gguf-dequantize"}), CLI::ParseError);
}

}  // namespace
}  // namespace hs::cli
