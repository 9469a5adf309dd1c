#include "cli/threads.h"

#include <omp.h>

#include <cstdlib>
#include <stdexcept>

#include "core/cpu_load.h"

namespace hs::cli {

CLI::Option* add_threads_option(CLI::App* c, int& threads, const std::string& help) {
  return c->add_option("--threads", threads, help)->capture_default_str();
}

void apply_threads(int threads) {
  if (threads < 0) throw std::invalid_argument("--threads must be >= 0");
  if (threads > 0) omp_set_num_threads(threads);
}

int requested_threads(int argc, const char* const* argv) {
  int threads = positive_count(std::getenv("OMP_NUM_THREADS"));
  if (threads == 0) threads = affinity_cpus();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v = a == "--threads" && i + 1 < argc ? argv[i + 1] : a.rfind("--threads=", 0) == 0 ? argv[i] + 10 : nullptr;
    if (positive_count(v) > 0) threads = positive_count(v);
  }
  return threads;
}

}  // namespace hs::cli
