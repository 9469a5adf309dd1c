#include "cli/commands.h"

namespace hs::cli {

void register_commands(CLI::App& app) {
  register_train(app);
  register_eval(app);
  register_tokenize(app);
  register_convert(app);
  register_inspect(app);
  register_plan(app);
  register_generate(app);
}

}  // namespace hs::cli
