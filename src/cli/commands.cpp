#include "cli/commands.h"

#include <cstdio>

#include "kernels/cpu.h"
#include "kernels/paths.h"

namespace hs::cli {

void register_commands(CLI::App& app) {
  register_train(app);
  register_eval(app);
  register_tokenize(app);
  register_convert(app);
  register_inspect(app);
  register_plan(app);
  register_generate(app);
  register_serve(app);
}

void note_bf16_widening(const char* who) {
  if (kernels::matmul_bf16_on_onednn()) return;
  std::fprintf(stderr,
               "%s: this CPU has no bf16 products (level %s): bf16 tensors stay bf16 in memory and are widened to fp32 "
               "for the arithmetic (hybridscan --version lists each kernel's path)\n",
               who, kernels::cpu::level_name(kernels::cpu::level()));
}

}  // namespace hs::cli
