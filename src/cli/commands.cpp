#include "cli/commands.h"

namespace hs::cli {

void register_commands(CLI::App& app) {
  register_train(app);
  register_plan(app);
}

}  // namespace hs::cli
