// How busy this machine's processors are with other work right now, for choosing how idle OpenMP threads wait.
#pragma once

namespace hs {

// Processors this process may run on (its affinity mask; the online count when that is unreadable).
int usable_cpus();

// Tasks (threads) on the machine that are runnable right now other than the calling one: the least of `readings`
// readings of /proc/stat's procs_running taken 1 ms apart (a task that is runnable at every reading is busy, one that
// shows at a single reading is passing), less the caller. -1 when /proc/stat is unreadable.
int other_runnable_tasks(int readings = 3);

// Whether `threads` OpenMP threads should spin briefly before sleeping when they wait (GOMP_SPINCOUNT) rather than
// sleep at once (OMP_WAIT_POLICY=passive): only when the processors left over by the other runnable tasks hold a
// thread each. A spinning thread that shares its processor keeps the thread it waits for off it.
// An unknown load (others < 0) counts as busy.
bool spin_while_waiting(int others, int threads, int cpus);

}  // namespace hs
