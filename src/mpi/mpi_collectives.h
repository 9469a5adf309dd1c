// The MPI backend of Collectives (OpenMPI): the step schedule's gathers, reduce-scatters and sums between processes
// started by `mpirun`.
//
// Every MPI call after initialisation is made by one communication thread per process, in the order the program
// asks for them: collectives then run while the compute threads work (OpenMPI makes no progress on a non-blocking
// collective outside MPI calls, so a thread that keeps testing it is what makes the overlap real), and every rank
// issues the same collectives in the same order on every communicator, which MPI requires. The thread waits for a
// collective for at most HS_MPI_TIMEOUT_S seconds (default 300) before it aborts the job: a rank that stopped
// without dying (a dead one is reported by mpirun, naming its rank) cannot hang the others.
//
// Reductions are deterministic: a reduce-scatter is an in-place all-to-all of the ranks' contributions followed by
// a sum in rank order, never MPI's own reduction, whose order depends on the algorithm OpenMPI picks for the size.
#pragma once
#include <mpi.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/collectives.h"

namespace hs::mpi {

// True when this process was started by mpirun (OpenMPI's environment is present).
bool launched_by_mpirun();

// MPI for this process: initialised on construction (MPI_THREAD_SERIALIZED: the communication thread makes the
// calls), finalised on destruction.
class Runtime {
 public:
  Runtime(int* argc, char*** argv);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  int world_rank() const { return rank_; }
  int world_size() const { return size_; }

  // A job for the communication thread: `start` begins one non-blocking MPI operation and returns its error code.
  struct Job {
    std::function<int(MPI_Request*)> start;
    std::string what;
    bool done = false;
    int rc = MPI_SUCCESS;
  };
  std::shared_ptr<Job> submit(std::function<int(MPI_Request*)> start, std::string what);
  // Blocks until the job is done; throws std::runtime_error naming the operation and this rank if it failed.
  void wait(Job& job);
  // Runs f on the communication thread and waits (for the calls that set communicators up).
  void call(const std::function<int()>& f, const std::string& what);
  // Ends the job from any rank with a message (mpirun then stops every rank).
  [[noreturn]] void abort(const std::string& message);

 private:
  void loop();
  int rank_ = 0, size_ = 1;
  double timeout_s_ = 300;
  std::mutex mu_;
  std::condition_variable queued_, finished_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

class MpiCollectives final : public Collectives {
 public:
  // The ranks of MPI_COMM_WORLD with the same `color`, in world-rank order.
  static std::unique_ptr<MpiCollectives> split(Runtime& rt, int color, const std::string& name);
  ~MpiCollectives() override;
  using Collectives::all_reduce_sum;

  Request start_all_gather(const TensorView& shard, void* full, DType to, int64_t n) override;
  Request start_reduce_scatter(float* full, int64_t n, float* shard) override;
  Request start_reduce_scatter_to(float* full, int64_t n, std::vector<float*> dest) override;
  // MPI_Iallgatherv in place, each rank's part of the range as its count.
  Request start_all_gather_range(const TensorView& shard, int64_t n, int64_t begin, int64_t end, void* out,
                                 DType to) override;
  // Rounds of MPI_Ialltoallv into the scratch (at most max(1, len / size) elements from each rank a round), each
  // round's rank-order sum made by the communication thread before it posts the next round (the last one's in
  // wait()), so the rounds run while the compute threads work.
  Request start_reduce_scatter_range(const float* full, int64_t n, int64_t begin, int64_t end, float* shard,
                                     float* scratch) override;
  Request start_all_to_all_v(const void* send, std::vector<int64_t> send_counts, std::vector<int64_t> send_displs,
                             void* recv, std::vector<int64_t> recv_counts, std::vector<int64_t> recv_displs,
                             size_t elem_bytes) override;
  void all_reduce_sum(double* x, int64_t n) override;
  void all_reduce_sum(float* x, int64_t n, float* scratch) override;
  void broadcast(void* data, size_t bytes, int64_t root) override;
  double exposed_seconds() const override { return exposed_s_; }

 private:
  MpiCollectives(Runtime& rt, MPI_Comm comm, int size, int rank, std::string name);
  // Submits a job on this communicator; the returned function waits for it (and counts the wait as exposed).
  std::function<void()> start(std::function<int(MPI_Comm, MPI_Request*)> op, const std::string& what);
  int count(int64_t elems, const char* what) const;

  Runtime& rt_;
  MPI_Comm comm_;
  std::string name_;
  double exposed_s_ = 0;
};

// The communicators of a training run under mpirun: the world (the global batch is split over it), the FSDP group
// of this rank (`fsdp` consecutive world ranks share the shards of one model copy), the replicas of this rank's
// shards across groups (data parallel) and, with expert parallelism, the `expert_parallel` consecutive ranks that
// exchange their tokens' rows (rank r of it owns the r-th 1/expert_parallel of the routed experts; the ranks of an
// FSDP group with the same rank in their expert-parallel groups own the same experts; a group of one without).
struct Groups {
  std::unique_ptr<MpiCollectives> world, fsdp, replicas, experts;
};
// Throws std::invalid_argument when fsdp does not divide the world size or expert_parallel the FSDP group.
Groups make_groups(Runtime& rt, int64_t fsdp, int64_t expert_parallel = 1);

}  // namespace hs::mpi
