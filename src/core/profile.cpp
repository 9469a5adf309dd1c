#include "core/profile.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <stdexcept>
#include <vector>

#include <omp.h>
#include <sys/resource.h>

#include "core/settings.h"

namespace hs::profile {

using Clock = std::chrono::steady_clock;

struct State {
  Clock::time_point start, last;
  Phase cur = Phase::Other;
  const char* label = nullptr;  // the current scope's label (null: its phase's name)
  std::vector<std::pair<Phase, const char*>> stack;  // the phases and labels of the open scopes below the current one
  std::vector<char> counted;  // per open scope: whether it was recorded (opened outside a parallel region)
  std::array<double, kNumPhases> seconds{};
  std::array<uint64_t, kNumPhases> calls{};
  double flops = 0;
  std::map<std::pair<std::string_view, Phase>, std::pair<uint64_t, double>> labels;  // calls, seconds
  std::map<MatmulShape, MatmulShapeTotals> shapes;
  rusage ru0{};
  void charge(Clock::time_point now) {
    const double dt = std::chrono::duration<double>(now - last).count();
    seconds[static_cast<size_t>(cur)] += dt;
    if (cur != Phase::Other) labels[{label ? std::string_view(label) : phase_name(cur), cur}].second += dt;
    last = now;
  }
};

namespace detail {
thread_local State* t_state = nullptr;
State* current() { return t_state; }

void enter(State* s, Phase p, const char* label) {
  // Inside a parallel region this thread is one of the workers: the region's time belongs to whoever opened it.
  if (omp_in_parallel()) {
    s->counted.push_back(0);
    return;
  }
  s->counted.push_back(1);
  s->charge(Clock::now());
  s->stack.emplace_back(s->cur, s->label);
  s->cur = p;
  s->label = label;
  ++s->calls[static_cast<size_t>(p)];
  ++s->labels[{label ? std::string_view(label) : phase_name(p), p}].first;
}
void leave(State* s) {
  if (s->counted.empty()) return;  // a scope opened before the session began
  const bool counted = s->counted.back();
  s->counted.pop_back();
  if (!counted) return;
  s->charge(Clock::now());
  std::tie(s->cur, s->label) = s->stack.back();
  s->stack.pop_back();
}
void add_flops(State* s, double f) { s->flops += f; }
void add_shape(State* s, const MatmulShape& m, double seconds) {
  if (omp_in_parallel()) return;
  if (m.M > 0 && m.N > 0 && m.K > 0) s->flops += 2.0 * double(m.M) * double(m.N) * double(m.K);
  MatmulShapeTotals& t = s->shapes[m];
  t.shape = m;
  ++t.calls;
  t.seconds += seconds;
}
}  // namespace detail

std::string_view phase_name(Phase p) {
  switch (p) {
    case Phase::Matmul: return "matmul";
    case Phase::DeltaRule: return "delta_rule";
    case Phase::Attention: return "attention";
    case Phase::MoeDispatch: return "moe_dispatch";
    case Phase::Elementwise: return "elementwise";
    case Phase::LossHead: return "loss_head";
    case Phase::Optimizer: return "optimizer";
    case Phase::Communication: return "communication";
    case Phase::Allocation: return "allocation";
    case Phase::Other: return "other";
    case Phase::kCount: break;
  }
  return "?";
}

double Totals::sum_seconds() const {
  double s = 0;
  for (double v : seconds) s += v;
  return s;
}

void accumulate(Totals& into, const Totals& t, bool subtract) {
  const double s = subtract ? -1.0 : 1.0;
  for (size_t i = 0; i < kNumPhases; ++i) {
    into.seconds[i] += s * t.seconds[i];
    into.calls[i] = subtract ? into.calls[i] - t.calls[i] : into.calls[i] + t.calls[i];
  }
  into.matmul_flops += s * t.matmul_flops;
  into.wall_seconds += s * t.wall_seconds;
  into.minor_faults += subtract ? -t.minor_faults : t.minor_faults;
  into.major_faults += subtract ? -t.major_faults : t.major_faults;
  std::map<MatmulShape, MatmulShapeTotals> m;
  for (const auto& x : into.matmul_shapes) m[x.shape] = x;
  for (const auto& x : t.matmul_shapes) {
    MatmulShapeTotals& y = m[x.shape];
    y.shape = x.shape;
    y.calls = subtract ? y.calls - x.calls : y.calls + x.calls;
    y.seconds += s * x.seconds;
  }
  into.matmul_shapes.clear();
  for (const auto& [k, v] : m)
    if (v.calls > 0) into.matmul_shapes.push_back(v);
  std::map<std::pair<std::string, Phase>, Totals::Label> l;
  for (const auto& x : into.labels) l[{x.name, x.phase}] = x;
  for (const auto& x : t.labels) {
    Totals::Label& y = l[{x.name, x.phase}];
    y.name = x.name;
    y.phase = x.phase;
    y.calls = subtract ? y.calls - x.calls : y.calls + x.calls;
    y.seconds += s * x.seconds;
  }
  into.labels.clear();
  for (const auto& [k, v] : l)
    if (v.calls > 0) into.labels.push_back(v);
}

bool enabled_by_env() {
  const char* v = settings::value(settings::Setting::Profile);
  return v && std::strcmp(v, "0") != 0;
}

Session::Session() : state_(new State) {
  if (detail::t_state) {
    delete state_;
    throw std::logic_error("profile::Session: this thread already has one");
  }
  getrusage(RUSAGE_SELF, &state_->ru0);
  state_->start = state_->last = Clock::now();
  state_->stack.reserve(16);
  state_->counted.reserve(16);
  detail::t_state = state_;
}

Session::~Session() {
  detail::t_state = nullptr;
  delete state_;
}

Totals Session::totals() const {
  State& s = *state_;
  const Clock::time_point now = Clock::now();
  s.charge(now);
  Totals t;
  t.seconds = s.seconds;
  t.calls = s.calls;
  t.matmul_flops = s.flops;
  for (const auto& [k, v] : s.shapes) t.matmul_shapes.push_back(v);
  for (const auto& [k, v] : s.labels) t.labels.push_back({std::string(k.first), k.second, v.first, v.second});
  t.wall_seconds = std::chrono::duration<double>(now - s.start).count();
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  t.minor_faults = ru.ru_minflt - s.ru0.ru_minflt;
  t.major_faults = ru.ru_majflt - s.ru0.ru_majflt;
  return t;
}

}  // namespace hs::profile
