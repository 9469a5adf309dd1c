// --threads: how many OpenMP threads a subcommand runs, declared once for every subcommand that takes it, and read
// from argv before parsing (main.cpp chooses how idle threads wait from it before CLI11 runs).
#pragma once
#include <CLI/CLI.hpp>
#include <string>

namespace hs::cli {

// Adds --threads N to `c` (0: OpenMP's default, all cores).
CLI::Option* add_threads_option(CLI::App* c, int& threads, const std::string& help = "OpenMP threads (0: all cores)");

// Applies a parsed --threads: N > 0 sets OpenMP's thread count, 0 leaves its default; negative is refused.
void apply_threads(int threads);

// The threads a subcommand will run: its last --threads N (or --threads=N) with N > 0, else OpenMP's default (the
// first value of OMP_NUM_THREADS when positive, else affinity_cpus(), whatever a CPU quota allows).
int requested_threads(int argc, const char* const* argv);

}  // namespace hs::cli
