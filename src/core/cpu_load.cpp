#include "core/cpu_load.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

namespace hs {

int online_cpus() {
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 1;
}

int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return online_cpus();
}

int usable_cpus() {
  int n = affinity_cpus();
  // cgroup v2: "max 100000" (no quota) or "200000 100000" (two processors' worth).
  std::ifstream q("/sys/fs/cgroup/cpu.max");
  std::string quota;
  long long period = 0;
  if (q >> quota >> period && quota != "max" && period > 0) {
    const long long us = std::atoll(quota.c_str());
    if (us > 0) n = std::min<long long>(n, std::max<long long>(1, (us + period - 1) / period));
  }
  return n;
}

int parse_procs_running(std::istream& in) {
  std::string key;
  long long value = 0;
  while (in >> key) {
    if (key == "procs_running") return in >> value && value >= 0 ? static_cast<int>(value) : -1;
    in.ignore(1 << 20, '\n');
  }
  return -1;
}

int other_runnable_tasks(int readings, int spacing_ms) {
  int least = -1;
  for (int i = 0; i < std::max(1, readings); ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(spacing_ms));
    std::ifstream in("/proc/stat");
    const int n = parse_procs_running(in);
    if (n < 0) return -1;
    const int others = std::max(0, n - 1);  // the caller is running while it reads
    least = least < 0 ? others : std::min(least, others);
    if (least == 0) break;  // an idle machine is seen at once
  }
  return least;
}

int local_processes() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"})
    if (const char* e = std::getenv(v)) {
      const long n = std::strtol(e, nullptr, 10);
      if (n > 0 && n < (1 << 20)) return static_cast<int>(n);
    }
  return 1;
}

bool spin_while_waiting(int others, int threads, int usable, int online) {
  return others >= 0 && threads > 0 && threads <= usable && others + threads <= online;
}

}  // namespace hs
