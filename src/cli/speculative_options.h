// The flags of speculative decoding, declared once for the subcommands that run or plan it (generate, plan
// --generate): --speculative mtp and --draft N, with the same help and the same checks in both.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

namespace hs::cli {

struct SpeculativeArgs {
  std::string speculative;  // "" (off) or "mtp"
  int64_t draft = -1;       // -1: not given (1 with --speculative)
};

void add_speculative_options(CLI::App* c, SpeculativeArgs& a);
// The draft depth the flags ask for: 0 without --speculative, else --draft (default 1). Throws std::invalid_argument
// for an unknown --speculative, --draft without it, or a depth outside [1, infer::kMaxDraft].
int64_t speculative_draft(const SpeculativeArgs& a);

}  // namespace hs::cli
