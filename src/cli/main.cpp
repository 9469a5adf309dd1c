// hybridscan: the command-line front end. Each subcommand parses its flags here and calls into the libraries.
#include <malloc.h>
#include <unistd.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string_view>
#include <nlohmann/json.hpp>

#include "cli/commands.h"

int main(int argc, char** argv) {
  // OpenMP threads that wait for work by spinning (libgomp's default, ~300k spins) lose most of their time when the
  // cores are shared with other work: measured on a loaded 2-core machine, `small` trained at ~250 tokens/s spinning
  // against ~2500 sleeping. Sleeping at once (OMP_WAIT_POLICY=passive) costs a futex wake-up per parallel region
  // instead, ~25% of a training step on an idle machine. A bounded spin, GOMP_SPINCOUNT=30000 (measured against
  // 1000-100000 on the idle machine: the fastest, within noise of 100000), covers the gaps between consecutive
  // parallel regions; on a busy machine OMP_WAIT_POLICY=passive is still better (README). libgomp reads these once,
  // when it is loaded, so set them by re-executing ourselves once; a policy or spin count the user set is kept.
  //
  // glibc's malloc is also asked to back its heap with transparent huge pages (glibc.malloc.hugetlb=1; THP in its
  // usual "madvise" mode only backs regions that ask, and glibc reads the tunable at startup). A step streams
  // hundreds of MB of weights, activations and gradients through the heap; with 4 KiB pages the `small` training
  // step ran ~16-19% slower on this machine (bench/README.md). Tunables the user set are kept as they are.
  //
  // `generate` sleeps at once (no spin count): a decode step is ~10 short parallel regions per layer, and a thread
  // that spins 30000 times at each while the cores are shared keeps the thread it waits for off the core. Measured
  // on the loaded 2-core machine, `small` decoded 87-135 tokens/s with the bounded spin against 435-622 passive.
  bool reexec = false;
  const bool generating = argc > 1 && std::string_view(argv[1]) == "generate";
  if (!std::getenv("OMP_WAIT_POLICY") && !std::getenv("GOMP_SPINCOUNT")) {
    setenv("OMP_WAIT_POLICY", "passive", 1);
    if (!generating) setenv("GOMP_SPINCOUNT", "30000", 1);
    reexec = true;
  }
  if (!std::getenv("GLIBC_TUNABLES")) {
    setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1", 1);
    reexec = true;
  }
  if (reexec) execv("/proc/self/exe", argv);  // only returns on failure: carry on with the defaults
  // A training step allocates and frees the same large buffers every step. Keep them in the heap instead of
  // returning them to the kernel (glibc maps blocks above 128 KiB-32 MiB fresh each time), so steps after the first
  // do not pay for zeroed pages again.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
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
