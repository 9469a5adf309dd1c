// hybridscan: the command-line front end. Each subcommand parses its flags here and calls into the libraries.
#include <malloc.h>
#include <unistd.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string_view>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/threads.h"
#include "core/cpu_load.h"
#include "kernels/cpu.h"
#include "kernels/paths.h"

int main(int argc, char** argv) {
  // OpenMP threads that wait for work by spinning (libgomp's default, ~300k spins) lose most of their time when the
  // cores are shared with other work: measured on a loaded 2-core machine, `small` trained at ~250 tokens/s spinning
  // against ~2500 sleeping. Sleeping at once (OMP_WAIT_POLICY=passive) costs a futex wake-up per parallel region
  // instead: ~25% of a training step, and of a `small` 512-token prefill 6900 against 8700-9500 tokens/s (medians of
  // 6-8 runs) on an idle machine. A bounded spin, GOMP_SPINCOUNT=30000 (measured against 1000-100000 on the idle
  // machine: the fastest, within noise of 100000), covers the gaps between consecutive parallel regions. So the
  // choice is made at start from the machine's load (core/cpu_load.h): spin when the processors not taken by other
  // runnable tasks hold one thread each, else sleep at once (with one busy process beside it on the 2-core machine,
  // the `small` prefill ran 5158 tokens/s sleeping, 1705 spinning 30000). libgomp reads these once, when it is loaded,
  // so set them by re-executing ourselves once; a policy or spin count the user set is kept. A decode step is one
  // parallel region whose threads wait for each other with their own short spin and a futex
  // (src/infer/fused_step.h), whichever is chosen here.
  //
  // glibc's malloc is also asked to back its heap with transparent huge pages (glibc.malloc.hugetlb=1; THP in its
  // usual "madvise" mode only backs regions that ask, and glibc reads the tunable at startup). A step streams
  // hundreds of MB of weights, activations and gradients through the heap; with 4 KiB pages the `small` training
  // step ran ~16-19% slower on this machine (bench/README.md). Tunables the user set are kept as they are.
  bool reexec = false, chose_wait = false;
  if (!std::getenv("OMP_WAIT_POLICY") && !std::getenv("GOMP_SPINCOUNT")) {
    const int usable = hs::usable_cpus();
    int threads = hs::cli::requested_threads(argc, argv);
    // An MPI launch's ranks on this machine each run `threads`, on the same processors.
    threads = static_cast<int>(std::min<long long>(1 << 20, static_cast<long long>(threads) * hs::local_processes()));
    const int online = hs::online_cpus();
    setenv("OMP_WAIT_POLICY", "passive", 1);
    // More threads than processors sleep whatever the load (no readings); else the load decides.
    if (threads <= usable && threads <= online &&
        hs::spin_while_waiting(hs::other_runnable_tasks(5, 50, online - threads), threads, usable, online))
      setenv("GOMP_SPINCOUNT", "30000", 1);
    reexec = chose_wait = true;
  }
  if (!std::getenv("GLIBC_TUNABLES")) {
    setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1", 1);
    reexec = true;
  }
  if (reexec) {
    execv("/proc/self/exe", argv);  // only returns on failure: carry on with the defaults
    if (chose_wait) {  // libgomp has read its defaults already: say so (generate --json's thread_wait)
      unsetenv("OMP_WAIT_POLICY");
      unsetenv("GOMP_SPINCOUNT");
    }
  }
  // A training step allocates and frees the same large buffers every step. Keep them in the heap instead of
  // returning them to the kernel (glibc maps blocks above 128 KiB-32 MiB fresh each time), so steps after the first
  // do not pay for zeroed pages again.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // A bad HS_MAX_ISA stops here, before any kernel chooses a path (kernels/cpu.h).
  if (const std::string bad = hs::kernels::cpu::cap_error(); !bad.empty()) {
    std::fprintf(stderr, "hybridscan: error: %s\n", bad.c_str());
    return 2;
  }
  CLI::App app{"hybridscan: train, convert, plan and run Qwen3-Next / Qwen3.5 hybrid models\n"
               "(Gated DeltaNet + gated attention + sparse MoE) as a nested block scan."};
  app.set_version_flag("--version", [] {
    return std::string("hybridscan ") + HS_VERSION + "\n" + hs::kernels::cpu::describe() + "\n" +
           hs::kernels::kernel_paths_report();
  });
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
