#pragma once
#include <CLI/CLI.hpp>

namespace hs::cli {
// Adds every subcommand (train, eval, ...) to the app; each runs from its callback.
void register_commands(CLI::App& app);
void register_train(CLI::App& app);
void register_plan(CLI::App& app);
void register_convert(CLI::App& app);
void register_inspect(CLI::App& app);
void register_eval(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_generate(CLI::App& app);
void register_serve(CLI::App& app);
// Says once, on stderr, that bf16 arithmetic is widened to fp32 on this CPU (no bf16 products under HS_MAX_ISA);
// `who` names the subcommand. Nothing where the CPU has them.
void note_bf16_widening(const char* who);
}  // namespace hs::cli
