// hybridscan: the command-line front end. Each subcommand parses its flags here and calls into the libraries.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"hybridscan: train, convert, plan and run Qwen3-Next / Qwen3.5 hybrid models\n"
               "(Gated DeltaNet + gated attention + sparse MoE) as a nested block scan."};
  app.set_version_flag("--version", std::string("hybridscan ") + HS_VERSION);
  app.require_subcommand(1);
  app.footer("Run 'hybridscan SUBCOMMAND --help' for the flags of each subcommand.");
  hs::cli::register_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hybridscan: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
