#include "core/cpu_load.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

namespace hs {

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 1;
}

namespace {
int procs_running() {
  std::ifstream in("/proc/stat");
  std::string key;
  long long value = 0;
  while (in >> key) {
    if (key == "procs_running" && in >> value) return static_cast<int>(value);
    in.ignore(1 << 20, '\n');
  }
  return -1;
}
}  // namespace

int other_runnable_tasks(int readings) {
  int least = -1;
  for (int i = 0; i < std::max(1, readings); ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const int n = procs_running();
    if (n < 0) return -1;
    least = least < 0 ? n : std::min(least, n);
  }
  return std::max(0, least - 1);  // the caller is running while it reads
}

bool spin_while_waiting(int others, int threads, int cpus) {
  return others >= 0 && threads > 0 && others + threads <= cpus;
}

}  // namespace hs
