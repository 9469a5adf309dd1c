// How busy this machine's processors are with other work right now, for choosing how idle OpenMP threads wait.
#pragma once

#include <istream>

namespace hs {

// Processors in this process's affinity mask (the online count when that is unreadable): how many threads OpenMP
// starts by default.
int affinity_cpus();

// Processors' worth of time this process may use: affinity_cpus(), and no more than a CPU quota allows (rounded
// down, at least 1): cgroup v2's cpu.max of this process's cgroup and its parents, or cgroup v1's cpu.cfs_quota_us.
int usable_cpus();

// The processors' worth of a cgroup v2 cpu.max text ("max 100000": 0, none; "150000 100000": 1).
int parse_cpu_max(std::istream& cpu_max);

// Processors online on the machine (the ones /proc/stat's procs_running counts tasks for).
int online_cpus();

// The procs_running count of a /proc/stat text (-1 when it has none).
int parse_procs_running(std::istream& stat);

// Tasks (threads) on the machine that are runnable right now other than the calling one: the least of up to
// `readings` readings of /proc/stat's procs_running (less the caller) taken `spacing_ms` apart, stopping at the first
// at or below `enough` (the most the caller can live with). A task runnable at every reading is busy; one that shows
// at a few is passing (the other end of a pipeline starting with us: `python3 -c "import json"` takes ~170 ms to
// start here). So a machine that stays busier than `enough` costs (readings - 1) * spacing_ms of waiting, one within
// it nothing. -1 when /proc/stat is unreadable (or reads 0, which no real kernel shows: the reader is running).
int other_runnable_tasks(int readings = 5, int spacing_ms = 50, int enough = 0);

// A count in a text: its leading integer when that is 1..2^20 ("4,2": 4), else 0.
int positive_count(const char* text);

// Processes of one job on this machine (an MPI launch's local ranks: OMPI_COMM_WORLD_LOCAL_SIZE or MPI_LOCALNRANKS),
// 1 otherwise: each runs its own threads.
int local_processes();

// Whether `threads` OpenMP threads should spin briefly before sleeping when they wait (GOMP_SPINCOUNT) rather than
// sleep at once (OMP_WAIT_POLICY=passive): only when the machine's processors left over by the other runnable tasks
// hold a thread each (others + threads <= online) and this process may use that many (threads <= usable). A spinning
// thread that shares its processor keeps the thread it waits for off it. An unknown load (others < 0) counts as busy.
bool spin_while_waiting(int others, int threads, int usable, int online);

}  // namespace hs
