// How busy this machine's processors are with other work right now, for choosing how idle OpenMP threads wait.
#pragma once

#include <istream>

namespace hs {

// Processors in this process's affinity mask (the online count when that is unreadable): how many threads OpenMP
// starts by default.
int affinity_cpus();

// Processors' worth of time this process may use: affinity_cpus(), and no more than a cgroup v2 CPU quota allows
// (cpu.max "quota period", rounded up).
int usable_cpus();

// Processors online on the machine (the ones /proc/stat's procs_running counts tasks for).
int online_cpus();

// The procs_running count of a /proc/stat text (-1 when it has none).
int parse_procs_running(std::istream& stat);

// Tasks (threads) on the machine that are runnable right now other than the calling one: the least of up to
// `readings` readings of /proc/stat's procs_running (less the caller) taken `spacing_ms` apart, stopping at the first
// that shows none. A task runnable at every reading is busy; one that shows at a few is passing (the other end of a
// pipeline starting with us: `python3 -c "import json"` takes ~170 ms to start here). So a busy machine costs up to
// (readings - 1) * spacing_ms of waiting, an idle one nothing. -1 when /proc/stat is unreadable.
int other_runnable_tasks(int readings = 5, int spacing_ms = 50);

// Processes of one job on this machine (an MPI launch's local ranks: OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS or
// SLURM_NTASKS_PER_NODE), 1 otherwise: each runs its own threads.
int local_processes();

// Whether `threads` OpenMP threads should spin briefly before sleeping when they wait (GOMP_SPINCOUNT) rather than
// sleep at once (OMP_WAIT_POLICY=passive): only when the machine's processors left over by the other runnable tasks
// hold a thread each (others + threads <= online) and this process may use that many (threads <= usable). A spinning
// thread that shares its processor keeps the thread it waits for off it. An unknown load (others < 0) counts as busy.
bool spin_while_waiting(int others, int threads, int usable, int online);

}  // namespace hs
