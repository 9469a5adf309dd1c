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

namespace {
// Processors' worth of a CPU quota: floor(quota / period), at least 1; 0 for none.
int quota_cpus(long long quota, long long period) {
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>(std::max<long long>(1, quota / period));
}
int read_cpu_max(const std::string& path) {
  std::ifstream in(path);
  return in ? parse_cpu_max(in) : 0;
}
}  // namespace

int parse_cpu_max(std::istream& in) {
  std::string quota;
  long long period = 0;
  if (!(in >> quota >> period) || quota == "max") return 0;
  char* end = nullptr;
  const long long q = std::strtoll(quota.c_str(), &end, 10);
  return end != quota.c_str() && *end == 0 ? quota_cpus(q, period) : 0;
}

int usable_cpus() {
  int n = affinity_cpus();
  auto limit = [&](int q) {
    if (q > 0) n = std::min(n, q);
  };
  // cgroup v2: this process's cgroup ("0::/path" in /proc/self/cgroup) and every parent up to the root.
  std::ifstream self("/proc/self/cgroup");
  for (std::string line; std::getline(self, line);) {
    if (line.rfind("0::", 0) != 0) continue;
    std::string dir = "/sys/fs/cgroup" + line.substr(3);
    while (true) {
      limit(read_cpu_max(dir + "/cpu.max"));
      const size_t slash = dir.rfind('/');
      if (dir == "/sys/fs/cgroup" || slash == std::string::npos || slash < std::string("/sys/fs/cgroup").size()) break;
      dir = dir.substr(0, slash);
    }
  }
  limit(read_cpu_max("/sys/fs/cgroup/cpu.max"));  // a container's own root
  // cgroup v1: the cpu controller's quota as this process sees its mount (-1: none).
  for (const char* d : {"/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpu"}) {
    std::ifstream qf(std::string(d) + "/cpu.cfs_quota_us"), pf(std::string(d) + "/cpu.cfs_period_us");
    long long q = 0, p = 0;
    if (qf >> q && pf >> p) {
      limit(quota_cpus(q, p));
      break;
    }
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

int other_runnable_tasks(int readings, int spacing_ms, int enough) {
  int least = -1;
  for (int i = 0; i < std::max(1, readings); ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(spacing_ms));
    std::ifstream in("/proc/stat");
    const int n = parse_procs_running(in);
    if (n < 1) return -1;  // the reader itself is running: 0 is not a real kernel's count
    const int others = n - 1;
    least = least < 0 ? others : std::min(least, others);
    if (least <= enough) break;  // no later reading can change the answer
  }
  return least;
}

int positive_count(const char* text) {
  if (!text) return 0;
  char* end = nullptr;
  const long n = std::strtol(text, &end, 10);
  return end != text && n > 0 && n <= (1 << 20) ? static_cast<int>(n) : 0;
}

int local_processes() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"})
    if (const int n = positive_count(std::getenv(v)); n > 0) return n;
  return 1;
}

bool spin_while_waiting(int others, int threads, int usable, int online) {
  return others >= 0 && threads > 0 && threads <= usable && others + threads <= online;
}

}  // namespace hs
