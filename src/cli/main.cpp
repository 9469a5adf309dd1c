#include <CLI/CLI.hpp>
#include <cstdio>

int main(int argc, char** argv) {
  CLI::App app{"hybridscan: train, convert and run Qwen3-Next / Qwen3.5 hybrid models"};
  app.set_version_flag("--version", std::string("hybridscan ") + HS_VERSION);
  app.require_subcommand(0, 1);
  CLI11_PARSE(app, argc, argv);
  if (argc == 1) std::printf("%s", app.help().c_str());
  return 0;
}
