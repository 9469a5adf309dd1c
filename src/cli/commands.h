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
}  // namespace hs::cli
