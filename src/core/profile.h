// Phase timing of a training step (issue 15): where the wall time of a step goes, by kind of work.
//
// Always compiled, off by default. While a Session lives on a thread, every profile::Scope that thread opens (outside
// OpenMP parallel regions) charges the wall time until the next scope opens or closes to its phase: time is
// exclusive, so a MoE kernel's own matmuls count as matrix products and only the rest as MoE dispatch/combine, and
// the phases plus `Other` (time in no scope) add up to the session's wall time exactly. Scopes opened on other
// threads, or inside a parallel region (where the calling thread is one of the workers), cost one thread-local load
// and a branch and record nothing; with no session that is all a Scope ever costs.
//
// Enabled by `train --profile` or the environment variable HS_PROFILE=1 (enabled_by_env()).
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace hs::profile {

enum class Phase : uint8_t {
  Matmul,         // oneDNN products (and the engine's own loops for skinny ones): kernels/matmul.cpp
  DeltaRule,      // the chunked gated delta rule, forward and backward
  Attention,      // the flash attention kernel, forward and backward
  MoeDispatch,    // MoE routing, gathers into expert rows, SwiGLU rows, combines (the products excluded)
  Elementwise,    // norms, gates, RoPE, conv, SwiGLU of the dense MLP, residual adds, casts, embedding
  LossHead,       // the LM head's softmax / cross-entropy around its products
  Optimizer,      // AdamW, gradient norm and clipping
  Communication,  // all-gathers, reduce-scatters, waits for them
  Allocation,     // the memory accountant's allocate and release (mapping, clearing)
  Other,          // time in no scope
  kCount
};
constexpr size_t kNumPhases = static_cast<size_t>(Phase::kCount);
std::string_view phase_name(Phase p);

// One matrix product's shape as kernels::matmul ran it (dtype codes: 0 fp32, 1 bf16).
struct MatmulShape {
  int64_t M = 0, N = 0, K = 0;
  bool trans_a = false, trans_b = false, accumulate = false, varying_rows = false;
  int in_dtype = 0, out_dtype = 0;
  auto operator<=>(const MatmulShape&) const = default;
};
struct MatmulShapeTotals {
  MatmulShape shape;
  uint64_t calls = 0;
  double seconds = 0;  // wall time of its calls, from the calling thread
};

struct Totals {
  std::array<double, kNumPhases> seconds{};
  std::array<uint64_t, kNumPhases> calls{};
  double matmul_flops = 0;  // 2 M N K summed over the products run (Matmul)
  double wall_seconds = 0;  // from the session's start to the snapshot
  long minor_faults = 0, major_faults = 0;  // the process's page faults over the session (getrusage)
  std::vector<MatmulShapeTotals> matmul_shapes;  // every distinct shape run, in shape order
  // The same exclusive time split finer, by the label each scope gives (the kernel's name; a scope without one counts
  // under its phase's name), in label order.
  struct Label {
    std::string name;
    Phase phase;
    uint64_t calls = 0;
    double seconds = 0;
  };
  std::vector<Label> labels;
  double sum_seconds() const;
};

struct State;
namespace detail {
// The calling thread's session, or null. A function (defined beside the thread_local) rather than the extern
// thread_local itself: other translation units would reach it through GCC's TLS wrapper, which UBSan's null check
// reports as a load through a null pointer. One call and a TLS load per scope: ~1 ns.
State* current();
void enter(State* s, Phase p, const char* label = nullptr);
void leave(State* s);
void add_flops(State* s, double f);
void add_shape(State* s, const MatmulShape& m, double seconds);
}  // namespace detail

// into += t (subtract: into -= t, to take a step back out of a sum it is part of); shapes are matched by value.
void accumulate(Totals& into, const Totals& t, bool subtract = false);

// True when HS_PROFILE is set to something other than "" or "0".
bool enabled_by_env();

// Profiles the calling thread from construction to totals() (or destruction). One per thread at a time.
class Session {
 public:
  Session();
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  // What was recorded so far (the open scope charged up to now).
  Totals totals() const;

 private:
  State* state_;
};

// Charges the time until the next scope event on this thread to `p` (and to `label`, a string literal naming the
// kernel, for the finer split of Totals::labels).
class Scope {
 public:
  explicit Scope(Phase p, const char* label = nullptr) {
    if (State* s = detail::current()) [[unlikely]] {
      s_ = s;
      detail::enter(s, p, label);
    }
  }
  ~Scope() {
    if (s_) [[unlikely]] detail::leave(s_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  State* s_ = nullptr;
};

// A matrix product: charged to Phase::Matmul like a Scope, and its shape, FLOPs (2 M N K) and wall time recorded.
class MatmulScope {
 public:
  explicit MatmulScope(const MatmulShape& m) {
    if (State* s = detail::current()) [[unlikely]] {
      s_ = s;
      shape_ = m;
      detail::enter(s, Phase::Matmul);
      t0_ = std::chrono::steady_clock::now();  // inside the phase's interval
    }
  }
  ~MatmulScope() {
    if (s_) [[unlikely]] {
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
      detail::leave(s_);
      detail::add_shape(s_, shape_, dt);
    }
  }
  MatmulScope(const MatmulScope&) = delete;
  MatmulScope& operator=(const MatmulScope&) = delete;

 private:
  State* s_ = nullptr;
  MatmulShape shape_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace hs::profile
