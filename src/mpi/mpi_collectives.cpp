#include "mpi/mpi_collectives.h"

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "core/settings.h"

namespace hs::mpi {

namespace {

using Clock = std::chrono::steady_clock;

std::string error_string(int rc) {
  char s[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, s, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(s, static_cast<size_t>(len));
}

MPI_Datatype mpi_type(DType t) {
  if (t == DType::F32) return MPI_FLOAT;
  if (t == DType::BF16) return MPI_UINT16_T;  // moved, never reduced by MPI
  throw std::invalid_argument("all_gather: only fp32 and bf16 tensors are gathered");
}

}  // namespace

bool launched_by_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr; }

Runtime::Runtime(int* argc, char*** argv) {
  int provided = 0;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
    throw std::runtime_error("MPI_Init_thread failed");
  if (provided < MPI_THREAD_SERIALIZED) {
    MPI_Finalize();
    throw std::runtime_error("this MPI library does not support MPI_THREAD_SERIALIZED");
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  if (const char* t = settings::value(settings::Setting::MpiTimeoutS)) timeout_s_ = std::atof(t);
  thread_ = std::thread([this] { loop(); });
}

Runtime::~Runtime() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  queued_.notify_all();
  thread_.join();
  MPI_Finalize();
}

std::shared_ptr<Runtime::Job> Runtime::submit(std::function<int(MPI_Request*)> start, std::string what) {
  auto job = std::make_shared<Job>();
  job->start = std::move(start);
  job->what = std::move(what);
  {
    std::lock_guard<std::mutex> l(mu_);
    queue_.push_back(job);
  }
  queued_.notify_one();
  return job;
}

void Runtime::wait(Job& job) {
  {
    std::unique_lock<std::mutex> l(mu_);
    finished_.wait(l, [&] { return job.done; });
  }
  if (job.rc != MPI_SUCCESS)
    throw std::runtime_error("rank " + std::to_string(rank_) + ": MPI " + job.what + " failed: " + error_string(job.rc));
}

void Runtime::call(const std::function<int()>& f, const std::string& what) {
  auto job = submit(
      [&f](MPI_Request* r) {
        *r = MPI_REQUEST_NULL;
        return f();
      },
      what);
  wait(*job);
}

void Runtime::abort(const std::string& message) {
  std::fprintf(stderr, "hybridscan: rank %d: %s\n", rank_, message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

void Runtime::loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> l(mu_);
      queued_.wait(l, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = queue_.front();
      queue_.pop_front();
    }
    MPI_Request req = MPI_REQUEST_NULL;
    int rc = job->start(&req);
    const auto t0 = Clock::now();
    // Test (which is what moves a non-blocking collective on) every 50 us, sleeping in between so that the compute
    // threads keep the cores. Measured on `small`, 2 ranks on 2 loaded cores: 50 us gave ~800 tokens/s; a 2 ms
    // spin with yield before the sleeps 390, 64 yields 470, 1 ms sleeps 490.
    while (rc == MPI_SUCCESS && req != MPI_REQUEST_NULL) {
      int flag = 0;
      rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
      if (flag || rc != MPI_SUCCESS) break;
      const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
      if (timeout_s_ > 0 && waited > timeout_s_) {
        char limit[32];
        std::snprintf(limit, sizeof limit, "%g", timeout_s_);
        abort("MPI " + job->what + " did not complete within " + limit +
              " s (HS_MPI_TIMEOUT_S): another rank has stopped taking part; ending the job");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      job->rc = rc;
      job->done = true;
    }
    finished_.notify_all();
  }
}

MpiCollectives::MpiCollectives(Runtime& rt, MPI_Comm comm, int size, int rank, std::string name)
    : Collectives(size, rank), rt_(rt), comm_(comm), name_(std::move(name)) {}

MpiCollectives::~MpiCollectives() {
  try {
    rt_.call([this] { return MPI_Comm_free(&comm_); }, "Comm_free");
  } catch (const std::exception&) {
    // Freeing a communicator only fails when the job is already failing; that error has been reported.
  }
}

std::unique_ptr<MpiCollectives> MpiCollectives::split(Runtime& rt, int color, const std::string& name) {
  MPI_Comm comm = MPI_COMM_NULL;
  int size = 0, rank = 0;
  rt.call(
      [&] {
        int rc = MPI_Comm_split(MPI_COMM_WORLD, color, rt.world_rank(), &comm);
        if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
        if (rc == MPI_SUCCESS) rc = MPI_Comm_size(comm, &size);
        if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(comm, &rank);
        return rc;
      },
      "Comm_split (" + name + ")");
  return std::unique_ptr<MpiCollectives>(new MpiCollectives(rt, comm, size, rank, name));
}

std::function<void()> MpiCollectives::start(std::function<int(MPI_Comm, MPI_Request*)> op, const std::string& what) {
  MPI_Comm comm = comm_;
  auto job = rt_.submit([op = std::move(op), comm](MPI_Request* r) { return op(comm, r); }, what + " (" + name_ + ")");
  return [this, job] {
    const auto t0 = Clock::now();
    rt_.wait(*job);
    exposed_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
  };
}

int MpiCollectives::count(int64_t elems, const char* what) const {
  if (elems > INT_MAX)
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(elems) +
                                " elements per rank exceed MPI's int counts; use more ranks");
  return static_cast<int>(elems);
}

Collectives::Request MpiCollectives::start_all_gather(const TensorView& shard, void* full, DType to, int64_t n) {
  const int64_t s = shard_elems(n, size());
  const int cnt = count(s, "all_gather");
  // This rank's shard goes (converted) straight into its place in the gathered tensor; the gather is in place.
  char* mine = static_cast<char*>(full) + static_cast<size_t>(rank() * s) * dtype_size(to);
  convert_elements(shard.data, shard.dtype, mine, to, s);
  const MPI_Datatype t = mpi_type(to);
  return Request(start(
      [full, cnt, t](MPI_Comm c, MPI_Request* r) {
        return MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, full, cnt, t, c, r);
      },
      "all_gather"));
}

Collectives::Request MpiCollectives::start_reduce_scatter(float* full, int64_t n, float* shard) {
  const int64_t s = shard_elems(n, size()), ranks = size();
  const int cnt = count(s, "reduce_scatter");
  std::function<void()> transfer = start(
      [full, cnt](MPI_Comm c, MPI_Request* r) {
        return MPI_Ialltoall(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, full, cnt, MPI_FLOAT, c, r);
      },
      "reduce_scatter");
  // After the exchange, full[j * s + i] is rank j's contribution to element i of this rank's shard.
  return Request([transfer = std::move(transfer), full, shard, s, ranks] {
    transfer();
#pragma omp parallel for schedule(static) if (s > 65536)
    for (int64_t i = 0; i < s; ++i) {
      float acc = shard[i];
      for (int64_t j = 0; j < ranks; ++j) acc += full[j * s + i];
      shard[i] = acc;
    }
  });
}

Collectives::Request MpiCollectives::start_reduce_scatter_to(float* full, int64_t n, std::vector<float*> dest) {
  const int64_t s = shard_elems(n, size()), ranks = size();
  if (static_cast<int64_t>(dest.size()) != ranks)
    throw std::invalid_argument("reduce_scatter_to: one destination a rank");
  const int cnt = count(s, "reduce_scatter");
  std::function<void()> transfer = start(
      [full, cnt](MPI_Comm c, MPI_Request* r) {
        return MPI_Ialltoall(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, full, cnt, MPI_FLOAT, c, r);
      },
      "reduce_scatter");
  // After the exchange, full[p * s + i] is rank p's contribution to element i of dest[p]; in rank order per element.
  return Request([transfer = std::move(transfer), full, dest = std::move(dest), s, ranks] {
    transfer();
#pragma omp parallel for schedule(static) if (s > 65536)
    for (int64_t i = 0; i < s; ++i)
      for (int64_t p = 0; p < ranks; ++p) dest[static_cast<size_t>(p)][i] += full[p * s + i];
  });
}

Collectives::Request MpiCollectives::start_all_gather_range(const TensorView& shard, int64_t n, int64_t begin,
                                                            int64_t end, void* out, DType to) {
  if (begin < 0 || begin > end || end > n)
    throw std::invalid_argument("all_gather_range: range outside the tensor");
  const int64_t ranks = size(), s = shard_elems(n, ranks);
  // MPI reads the count arrays until the operation completes: they live in the job.
  auto v = std::make_shared<std::vector<int>>(2 * static_cast<size_t>(ranks));
  for (int64_t q = 0; q < ranks; ++q) {
    const RangePart part = range_part(n, ranks, q, begin, end);
    (*v)[static_cast<size_t>(q)] = count(part.count, "all_gather_range");
    (*v)[static_cast<size_t>(ranks + q)] = count(part.first - begin, "all_gather_range");
  }
  // This rank's part goes (converted) straight into its place in the range; the gather is in place.
  const RangePart mine = range_part(n, ranks, rank(), begin, end);
  if (mine.count > 0)
    convert_elements(static_cast<const char*>(shard.data) + static_cast<size_t>(mine.first - rank() * s) *
                                                                dtype_size(shard.dtype),
                     shard.dtype, static_cast<char*>(out) + static_cast<size_t>(mine.first - begin) * dtype_size(to),
                     to, mine.count);
  const MPI_Datatype t = mpi_type(to);
  return Request(start(
      [out, v, t, ranks](MPI_Comm c, MPI_Request* r) {
        const int* a = v->data();
        return MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, a, a + ranks, t, c, r);
      },
      "all_gather_range"));
}

Collectives::Request MpiCollectives::start_reduce_scatter_range(const float* full, int64_t n, int64_t begin,
                                                                int64_t end, float* shard, float* scratch) {
  if (begin < 0 || begin > end || end > n)
    throw std::invalid_argument("reduce_scatter_range: range outside the tensor");
  const int64_t ranks = size(), s = shard_elems(n, ranks), len = end - begin;
  const int64_t m = range_scratch_elems(len) / ranks;  // elements from each rank a round
  std::vector<RangePart> parts;
  int64_t most = 0;
  for (int64_t q = 0; q < ranks; ++q) {
    parts.push_back(range_part(n, ranks, q, begin, end));
    most = std::max(most, parts.back().count);
  }
  const RangePart mine = parts[static_cast<size_t>(rank())];
  // This rank's part of the range in its shard (nothing is written when it holds none of the range).
  float* into = mine.count > 0 ? shard + (mine.first - rank() * s) : shard;
  const int64_t rounds = (most + m - 1) / m;
  // MPI's int counts, checked before any round is posted (a throw after would leave rounds writing freed buffers).
  count(len, "reduce_scatter_range");
  count(ranks * m, "reduce_scatter_range");
  // Round t: every rank's elements [t m, (t + 1) m) of each rank's part. Adds round t's contributions (in the
  // scratch at p * m for rank p) into the shard in rank order.
  auto add = [into, scratch, m, ranks, mine](int64_t t, bool threads) {
    const int64_t c = std::clamp<int64_t>(mine.count - t * m, 0, m);
    float* dst = into + t * m;
#pragma omp parallel for schedule(static) if (threads && c > 65536)
    for (int64_t i = 0; i < c; ++i) {
      float acc = dst[i];
      for (int64_t p = 0; p < ranks; ++p) acc += scratch[p * m + i];
      dst[i] = acc;
    }
  };
  std::vector<std::function<void()>> waits;
  for (int64_t t = 0; t < rounds; ++t) {
    auto v = std::make_shared<std::vector<int>>(4 * static_cast<size_t>(ranks));
    const int64_t recv = std::clamp<int64_t>(mine.count - t * m, 0, m);
    for (int64_t q = 0; q < ranks; ++q) {
      const RangePart& part = parts[static_cast<size_t>(q)];
      const auto k = static_cast<size_t>(q), R = static_cast<size_t>(ranks);
      (*v)[k] = count(std::clamp<int64_t>(part.count - t * m, 0, m), "reduce_scatter_range");
      (*v)[R + k] = count(std::min(part.first - begin + t * m, len), "reduce_scatter_range");
      (*v)[2 * R + k] = count(recv, "reduce_scatter_range");
      (*v)[3 * R + k] = count(q * m, "reduce_scatter_range");
    }
    // The job of round t first sums round t - 1, which the communication thread has completed before it takes
    // this job: the scratch is free again.
    waits.push_back(start(
        [full, scratch, v, ranks, t, add](MPI_Comm c, MPI_Request* r) {
          if (t > 0) add(t - 1, false);
          const int* a = v->data();
          return MPI_Ialltoallv(full, a, a + ranks, MPI_FLOAT, scratch, a + 2 * ranks, a + 3 * ranks, MPI_FLOAT, c, r);
        },
        "reduce_scatter_range"));
  }
  return Request([waits = std::move(waits), add, rounds] {
    // Every round is waited for before an error is passed on: the later rounds still use the buffers.
    std::exception_ptr failed;
    for (const auto& w : waits) {
      try {
        w();
      } catch (...) {
        if (!failed) failed = std::current_exception();
      }
    }
    if (failed) std::rethrow_exception(failed);
    if (rounds > 0) add(rounds - 1, true);
  });
}

Collectives::Request MpiCollectives::start_all_to_all_v(const void* send, std::vector<int64_t> send_counts,
                                                        std::vector<int64_t> send_displs, void* recv,
                                                        std::vector<int64_t> recv_counts,
                                                        std::vector<int64_t> recv_displs, size_t elem_bytes) {
  const auto ranks = static_cast<size_t>(size());
  if (send_counts.size() != ranks || send_displs.size() != ranks || recv_counts.size() != ranks ||
      recv_displs.size() != ranks)
    throw std::invalid_argument("all_to_all_v: one count and one displacement a rank");
  MPI_Datatype t = MPI_DATATYPE_NULL;
  if (elem_bytes == 2) t = MPI_UINT16_T;
  if (elem_bytes == 4) t = MPI_UINT32_T;
  if (elem_bytes == 8) t = MPI_UINT64_T;
  if (t == MPI_DATATYPE_NULL) throw std::invalid_argument("all_to_all_v: elements of 2, 4 or 8 bytes");
  // MPI reads the count arrays until the operation completes: they live in the job.
  auto v = std::make_shared<std::vector<int>>(4 * ranks);
  for (size_t q = 0; q < ranks; ++q) {
    (*v)[q] = count(send_counts[q], "all_to_all_v");
    (*v)[ranks + q] = count(send_displs[q], "all_to_all_v");
    (*v)[2 * ranks + q] = count(recv_counts[q], "all_to_all_v");
    (*v)[3 * ranks + q] = count(recv_displs[q], "all_to_all_v");
  }
  return Request(start(
      [send, recv, v, t, ranks](MPI_Comm c, MPI_Request* r) {
        const int* a = v->data();
        return MPI_Ialltoallv(send, a, a + ranks, t, recv, a + 2 * ranks, a + 3 * ranks, t, c, r);
      },
      "all_to_all_v"));
}

void MpiCollectives::all_reduce_sum(double* x, int64_t n) {
  const int cnt = count(n, "all_reduce");
  std::vector<double> all(static_cast<size_t>(n * size()));
  start([x, cnt, &all](MPI_Comm c, MPI_Request* r) {
    return MPI_Iallgather(x, cnt, MPI_DOUBLE, all.data(), cnt, MPI_DOUBLE, c, r);
  }, "all_reduce")();
  for (int64_t i = 0; i < n; ++i) {
    double acc = 0;
    for (int64_t j = 0; j < size(); ++j) acc += all[static_cast<size_t>(j * n + i)];
    x[i] = acc;
  }
}

void MpiCollectives::all_reduce_sum(float* x, int64_t n, float* scratch) {
  // A reduce-scatter into this rank's slice, then an in-place gather of the slices: the same rank-order sums.
  if (size() == 1) return;  // the sum over one rank is x (and all_reduce_scratch_elems gave no scratch)
  const int64_t s = shard_elems(n, size()), padded = padded_elems(n);
  float* buf = scratch;
  float* mine = scratch + padded;
  std::memcpy(buf, x, static_cast<size_t>(n) * sizeof(float));
  std::fill(buf + n, buf + padded, 0.0f);
  std::fill(mine, mine + s, 0.0f);
  reduce_scatter(buf, n, mine);
  all_gather(TensorView(mine, DType::F32, {s}), buf, DType::F32, n);
  std::memcpy(x, buf, static_cast<size_t>(n) * sizeof(float));
}

void MpiCollectives::broadcast(void* data, size_t bytes, int64_t root) {
  const int cnt = count(static_cast<int64_t>(bytes), "broadcast");
  const int rt = static_cast<int>(root);
  start([data, cnt, rt](MPI_Comm c, MPI_Request* r) { return MPI_Ibcast(data, cnt, MPI_BYTE, rt, c, r); },
        "broadcast")();
}

Groups make_groups(Runtime& rt, int64_t fsdp, int64_t expert_parallel) {
  const int world = rt.world_size(), rank = rt.world_rank();
  if (fsdp <= 0) fsdp = world;
  if (fsdp > world || world % fsdp != 0)
    throw std::invalid_argument("an FSDP group of " + std::to_string(fsdp) + " ranks must divide the number of ranks (" +
                                std::to_string(world) + ")");
  const int g = static_cast<int>(fsdp);
  if (expert_parallel < 1 || g % expert_parallel != 0)
    throw std::invalid_argument("expert parallelism over " + std::to_string(expert_parallel) + " ranks" +
                                " must divide the FSDP group (" + std::to_string(g) + " ranks)");
  Groups gr;
  gr.world = MpiCollectives::split(rt, 0, "world");
  gr.fsdp = MpiCollectives::split(rt, rank / g, "fsdp group");
  gr.replicas = MpiCollectives::split(rt, rank % g, "replicas");
  // Made whatever E (a group of one for E = 1), so that every rank makes the same splits even when the ranks were
  // given different options, which the run then reports instead of hanging in a split only some ranks make.
  gr.experts = MpiCollectives::split(rt, rank / static_cast<int>(expert_parallel), "expert-parallel group");
  return gr;
}

}  // namespace hs::mpi
