#include "infer/fused_step.h"

#include <omp.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "core/settings.h"
#include "kernels/decode.h"
#include "kernels/embedding.h"
#include "kernels/gdn_gates.h"
#include "kernels/gemv.h"
#include "kernels/mlp.h"
#include "kernels/moe.h"
#include "kernels/norms.h"
#include "kernels/quant_gemv.h"
#include "kernels/rope.h"
#include "model/layer_recipe.h"
#include "model/linear.h"

namespace hs::infer {

using model::LayerKind;
namespace p = model::p;

namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Pause instructions before a thread that waits for a phase sleeps (HS_FUSED_SPIN overrides, for measuring).
int spin_limit() {
  static const int n = [] {
    const char* e = settings::value(settings::Setting::FusedSpin);
    return e ? std::atoi(e) : 2000;
  }();
  return n;
}

void futex_wait(std::atomic<int>* a, int expected) {
  static_assert(sizeof(std::atomic<int>) == sizeof(int));
  syscall(SYS_futex, reinterpret_cast<int*>(a), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<int>* a) {
  syscall(SYS_futex, reinterpret_cast<int*>(a), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// One phase of a step: its work comes in `total` chunks that threads take in order (next) and count when finished
// (done). A thread moves on when every chunk is done, not when every thread has arrived: a thread descheduled on a
// shared machine holds up the others only while it holds a chunk, and when it runs again it finds the phases it
// missed complete and skips them. So what decides a phase's chunks (shapes, the MoE routing) is never overwritten
// within a step (the routing is kept per layer).
struct alignas(64) Phase {
  std::atomic<int64_t> next{0};
  alignas(64) std::atomic<int> done{0};
};

// Thread 0's clock over one step's phases while timing is on (fused_step_timing): each phase's span from the end of
// the one before (the step's from before the parallel region), in order.
struct PhaseClock {
  using Clock = std::chrono::steady_clock;
  Clock::time_point last = Clock::now();
  std::vector<std::pair<const char*, double>> spans;
  void stamp(const char* name) {
    const Clock::time_point now = Clock::now();
    spans.emplace_back(name, std::chrono::duration<double>(now - last).count());
    last = now;
  }
};

std::atomic<bool> g_timing{false};
std::atomic<QuantReference> g_quant_ref{QuantReference::Off};
std::mutex g_times_mu;
std::vector<FusedPhaseTime> g_times;

// One product of a phase: y[M, N] = x[M, K] W^T (x packed), y fp32 or T with row stride ldy.
template <typename T> struct Job {
  const T* x;
  const T* W;
  void* y;
  bool y_f32;
  int64_t M, N, K, ldy;
  int64_t chunk_rows = 0, chunks = 0;
  // A quantized weight (infer::QuantMatrix): W unused, the rows' blocks at Wq, y fp32; x is quantized into xq (the
  // step's shared rows for this job) by the phase's first part.
  const uint8_t* Wq = nullptr;
  kernels::GgmlType qt = kernels::GgmlType::Q8_0;
  kernels::QuantizedRows* xq = nullptr;
};

// A thread's view of the step: its id and the phases (every thread runs the same sequence of phases).
template <typename T> struct Team {
  int tid, nt;
  Phase* phases;
  int64_t nphases;
  std::atomic<int>& sleepers;
  kernels::cpu::Level isa;
  std::vector<kernels::QuantizedRows>* qpool = nullptr;  // activation rows quantized for a phase's quantized jobs
  PhaseClock* clock = nullptr;  // thread 0's, when timing is on (fused_step_timing)
  int64_t phase = 0;

  // Runs chunks f(c) of the next phase as they come, then waits until all `total` are done.
  template <typename F> void run_phase(const char* name, int64_t total, F&& f) {
    if (phase >= nphases) {  // a bug, inside the parallel region (where a throw would end the process unexplained)
      std::fprintf(stderr, "hybridscan: fused step: more phases than planned (%lld)\n", static_cast<long long>(nphases));
      std::abort();
    }
    struct Stamp {
      PhaseClock* c;
      const char* name;
      ~Stamp() {
        if (c) c->stamp(name);
      }
    } stamp{clock, name};
    Phase& ph = phases[phase++];
    for (int64_t c = ph.next.fetch_add(1, std::memory_order_relaxed); c < total;
         c = ph.next.fetch_add(1, std::memory_order_relaxed)) {
      f(c);
      if (ph.done.fetch_add(1, std::memory_order_seq_cst) + 1 == total &&
          sleepers.load(std::memory_order_seq_cst) > 0)
        futex_wake_all(&ph.done);
    }
    const int n = static_cast<int>(total);
    for (int i = 0, limit = spin_limit(); i < limit; ++i) {
      if (ph.done.load(std::memory_order_acquire) >= n) return;
      cpu_relax();
    }
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    for (int d; (d = ph.done.load(std::memory_order_seq_cst)) < n;) futex_wait(&ph.done, d);
    sleepers.fetch_sub(1, std::memory_order_relaxed);
  }
  // Work done by whichever thread comes first.
  template <typename F> void serial(const char* name, F&& f) {
    run_phase(name, 1, [&](int64_t) { f(); });
  }
  // f(u0, u1) over n units in chunks of `per` units.
  template <typename F> void units(const char* name, int64_t n, int64_t per, F&& f) {
    run_phase(name, (n + per - 1) / per, [&](int64_t c) { f(c * per, std::min(n, (c + 1) * per)); });
  }
  // The products of one phase, in chunks of ~kFusedChunkBytes of weight rows.
  void products(const char* name, Job<T>* jobs, int n) {
    // Quantized weights: the activation rows of each such job quantized first, by one thread, into shared rows.
    bool any_quant = false;
    for (int j = 0; j < n; ++j)
      if (jobs[j].Wq) {
        jobs[j].xq = &(*qpool)[static_cast<size_t>(j)];
        any_quant = true;
      }
    if (any_quant)
      serial("quantize_rows", [&] {
        for (int j = 0; j < n; ++j)
          if (jobs[j].Wq && jobs[j].M > 0) kernels::quantize_rows(jobs[j].qt, jobs[j].x, jobs[j].M, jobs[j].K, 0, *jobs[j].xq);
      });
    // Chunks of ~1/(8 threads) of the phase's weights, between kFusedChunkBytes and 32x that: small enough that the
    // threads finish together, large enough that taking one (two atomics) costs nothing next to streaming it.
    int64_t bytes = 0;
    auto row_bytes_of = [](const Job<T>& b) {
      return b.Wq ? kernels::ggml_row_bytes(b.qt, b.K) : b.K * static_cast<int64_t>(sizeof(T));
    };
    for (int j = 0; j < n; ++j) bytes += jobs[j].N * row_bytes_of(jobs[j]);
    const int64_t chunk_bytes = std::clamp<int64_t>(bytes / (8 * nt), kFusedChunkBytes, 32 * kFusedChunkBytes);
    int64_t total = 0;
    for (int j = 0; j < n; ++j) {
      Job<T>& b = jobs[j];
      const int64_t align = b.Wq ? 8 : kernels::gemv_row_align(b.M, isa);  // quantized: any split, the same bits
      const int64_t row_bytes = row_bytes_of(b);
      b.chunk_rows = std::max<int64_t>(align, chunk_bytes / std::max<int64_t>(row_bytes, 1) / align * align);
      b.chunks = b.M > 0 && b.N > 0 ? (b.N + b.chunk_rows - 1) / b.chunk_rows : 0;
      total += b.chunks;
    }
    int j = 0;
    int64_t base = 0;  // chunks of jobs before j
    run_phase(name, total, [&](int64_t c) {
      while (c >= base + jobs[j].chunks) base += jobs[j++].chunks;  // a thread's chunks come in ascending order
      const Job<T>& b = jobs[j];
      const int64_t n0 = (c - base) * b.chunk_rows, n1 = std::min(b.N, n0 + b.chunk_rows);
      if (b.Wq && g_quant_ref.load(std::memory_order_relaxed) != QuantReference::Off) {
        // Test aid: each weight row dequantized, the activations unrounded or their Q8 values (dot in double).
        const bool rounded = g_quant_ref.load(std::memory_order_relaxed) == QuantReference::RoundedActivations;
        thread_local std::vector<float> wrow, xrow;
        wrow.resize(static_cast<size_t>(b.K));
        xrow.resize(static_cast<size_t>(b.K));
        const int64_t rb = kernels::ggml_row_bytes(b.qt, b.K);
        for (int64_t r = n0; r < n1; ++r) {
          kernels::dequantize_row(b.qt, b.Wq + r * rb, wrow.data(), b.K);
          for (int64_t m = 0; m < b.M; ++m) {
            if (rounded) kernels::dequantize_quantized_row(*b.xq, m, xrow.data());
            else for (int64_t k = 0; k < b.K; ++k) xrow[static_cast<size_t>(k)] = float(b.x[m * b.K + k]);
            double acc = 0;
            for (int64_t k = 0; k < b.K; ++k) acc += double(wrow[static_cast<size_t>(k)]) * xrow[static_cast<size_t>(k)];
            static_cast<float*>(b.y)[m * b.ldy + r] = static_cast<float>(acc);
          }
        }
      } else if (b.Wq)
        kernels::quant_gemv_rows(*b.xq, b.Wq, static_cast<float*>(b.y), b.ldy, n0, n1, kernels::quant_gemv_level());
      else if (b.y_f32)
        kernels::gemv_rows(b.x, b.W, static_cast<float*>(b.y), b.M, b.N, b.K, 0, b.ldy, n0, n1, isa);
      else
        kernels::gemv_rows(b.x, b.W, static_cast<T*>(b.y), b.M, b.N, b.K, 0, b.ldy, n0, n1, isa);
    });
  }
};

template <typename T> Job<T> job(const T* x, const T* W, T* y, int64_t M, int64_t N, int64_t K, int64_t ldy = 0) {
  return {x, W, y, false, M, N, K, ldy ? ldy : N};
}
template <typename T> Job<T> job_f32(const T* x, const T* W, float* y, int64_t M, int64_t N, int64_t K) {
  return {x, W, y, true, M, N, K, N};
}

}  // namespace

template <typename T>
struct FusedStep<T>::Impl {
  const model::ParamSet& params;
  const model::ModelConfig& cfg;
  std::vector<model::LayerSlot> order;
  std::vector<model::LayerCache>& caches;
  MemoryAccountant& mem;
  const QuantWeights* quant;  // null: every matrix in the ParamSet
  std::vector<kernels::QuantizedRows> qpool;
  std::vector<model::LayerWeights> lw;
  std::vector<model::ComputeWeights<T>> cw;  // matrices in place, small vectors in fp32
  model::Converted<float> final_norm;
  std::vector<Phase> phases;
  std::atomic<int> sleepers{0};

  const StepExtras* ex = nullptr;  // the running step's (run)

  Impl(const model::ParamSet& ps, const std::vector<model::LayerSlot>& o, std::vector<model::LayerCache>& c,
       MemoryAccountant& m, const QuantWeights* q, const TensorView* fnorm)
      : params(ps), cfg(ps.config()), order(o), caches(c), mem(m), quant(q),
        phases(static_cast<size_t>((q ? 20 : 12) * ps.config().layers + 6)) {
    if (q && !std::is_same_v<T, float>) throw std::invalid_argument("fused step: quantized weights decode in fp32");
    for (const model::LayerSlot& s : order) {
      lw.push_back(params.layer(s));
      cw.push_back(model::compute_weights<T>(cfg, lw.back(), mem, nullptr));
    }
    final_norm = model::as_type<float>(fnorm ? *fnorm : params.global(model::g::kFinalNorm), mem,
                                       MemCategory::WeightCasts, "weight_cast");
  }

  // The product of layer li's matrix `spec` (part `part`, rows from `row0`): on its quantized blocks when it has them.
  const QuantMatrix* qmat(size_t li, size_t spec, size_t part = 0) const {
    if (!quant) return nullptr;
    const QuantLayer& ql = quant->layers[static_cast<size_t>(model::layer_of_slot(cfg, order[li]))];
    return part < ql.parts.at(spec).size() ? &ql.parts[spec][part] : nullptr;
  }
  static Job<T> qjob(const T* x, const QuantMatrix& m, int64_t row0, float* y, int64_t M, int64_t N, int64_t K,
                     int64_t ldy = 0) {
    Job<T> j{x, nullptr, y, true, M, N, K, ldy ? ldy : N};
    j.Wq = m.row(row0);
    j.qt = m.type;
    return j;
  }
  Job<T> mj(const T* x, size_t li, size_t spec, T* y, int64_t M, int64_t N, int64_t K, int64_t ldy = 0) const {
    if (const QuantMatrix* m = qmat(li, spec)) return qjob(x, *m, 0, reinterpret_cast<float*>(y), M, N, K, ldy);
    return job(x, cw[li].mat(spec), y, M, N, K, ldy);
  }

  // The buffers of one step of B rows, carved from one workspace allocation.
  struct Work {
    T *h, *hmid, *xn, *mix;
    // Gated DeltaNet
    T *qkv, *z, *b, *a, *q, *k, *v, *qn, *kn, *o, *y;
    float *rstd, *rstd2, *beta, *g;  // rstd2: the keys' (the queries' in rstd)
    // attention
    T *qg, *qraw, *gate, *kraw, *vv, *aq, *ak, *attn;
    float* scores;  // [threads, capacity]
    // FFN
    float *probs, *wts, *scale, *ye, *sum;
    int32_t *idx, *rslot;
    int64_t* off;
    T *xg, *gu, *act, *sgu, *sact, *sout, *ffn;
    T* xf;
  };
  Work carve(Carve& cv, int64_t B, int threads, int64_t capacity) const {
    const model::ModelConfig& c = cfg;
    const int64_t H = c.hidden, nH = c.q_heads, nKV = c.kv_heads, hd = c.head_dim;
    const int64_t k = std::max<int64_t>(c.top_k, 1), E = std::max<int64_t>(c.experts, 1);
    const int64_t I = c.moe() ? c.expert_inter : c.intermediate, Is = c.moe() ? c.shared_inter : 1;
    Work w{};
    w.h = cv.take<T>(B * H);
    w.hmid = cv.take<T>(B * H);
    w.xn = cv.take<T>(B * H);
    w.mix = cv.take<T>(B * H);
    w.qkv = cv.take<T>(B * c.conv_dim());
    w.z = cv.take<T>(B * c.value_dim());
    w.b = cv.take<T>(B * c.v_heads);
    w.a = cv.take<T>(B * c.v_heads);
    w.q = cv.take<T>(B * c.key_dim());
    w.k = cv.take<T>(B * c.key_dim());
    w.v = cv.take<T>(B * c.value_dim());
    w.qn = cv.take<T>(B * c.key_dim());
    w.kn = cv.take<T>(B * c.key_dim());
    w.o = cv.take<T>(B * c.value_dim());
    w.y = cv.take<T>(B * c.value_dim());
    w.rstd = cv.take<float>(B * std::max({c.k_heads, c.v_heads, nH, nKV, int64_t{1}}));
    w.rstd2 = cv.take<float>(B * std::max({c.k_heads, nKV, int64_t{1}}));
    w.beta = cv.take<float>(B * c.v_heads);
    w.g = cv.take<float>(B * c.v_heads);
    w.qg = cv.take<T>(B * nH * 2 * hd);
    w.qraw = cv.take<T>(B * nH * hd);
    w.gate = cv.take<T>(B * nH * hd);
    w.kraw = cv.take<T>(B * nKV * hd);
    w.vv = cv.take<T>(B * nKV * hd);
    w.aq = cv.take<T>(B * nH * hd);
    w.ak = cv.take<T>(B * nKV * hd);
    w.attn = cv.take<T>(B * nH * hd);
    w.scores = cv.take<float>(threads * capacity);
    w.probs = cv.take<float>(B * E);
    w.wts = cv.take<float>(B * k);
    w.scale = cv.take<float>(B);
    w.ye = cv.take<float>(B * k * H);
    w.sum = cv.take<float>(B * H);
    w.idx = cv.take<int32_t>(B * k);
    w.rslot = cv.take<int32_t>(B * k);
    w.off = cv.take<int64_t>((E + 1) * std::max<int64_t>(c.layers, 1));  // per layer (fused_step.cpp: Phase)
    w.xg = cv.take<T>(B * k * H);
    w.gu = cv.take<T>(B * k * 2 * I);
    w.act = cv.take<T>(B * k * I);
    w.sgu = cv.take<T>(B * 2 * Is);
    w.sact = cv.take<T>(B * Is);
    w.sout = cv.take<T>(B * H);
    w.ffn = cv.take<T>(B * H);
    w.xf = cv.take<T>(B * H);
    return w;
  }

  // The buffer of a recipe activation (model/layer_recipe.h) in this step's work.
  static T* act(const Work& w, model::recipe::Act x) {
    using model::recipe::Act;
    switch (x) {
      case Act::kXn: return w.xn;
      case Act::kQkv: return w.qkv;
      case Act::kZ: return w.z;
      case Act::kB: return w.b;
      case Act::kA: return w.a;
      case Act::kY: return w.y;
      case Act::kQGate: return w.qg;
      case Act::kKRaw: return w.kraw;
      case Act::kV: return w.vv;
      case Act::kAttn: return w.attn;
      case Act::kMix: return w.mix;
    }
    return nullptr;
  }

  // Thread 0's work before layer li's mixer products: its input norm of h into xn.
  void input_norm(const Work& w, size_t li, int64_t B) {
    kernels::rmsnorm_forward(w.h, cw[li].vec(p::kInputNorm), w.xn, w.rstd, B, cfg.hidden, float(cfg.rms_eps));
  }

  // Layer li's Gated DeltaNet mixer from xn (normed) to mix; ends after a barrier.
  void gdn(Team<T>& tm, const Work& w, size_t li, int64_t B, const int32_t* slots) {
    const model::ModelConfig& c = cfg;
    const model::ComputeWeights<T>& W = cw[li];
    model::LayerCache& cache = caches[li];
    const int64_t CD = c.conv_dim(), KD = c.key_dim(), VD = c.value_dim(), Hk = c.k_heads,
                  Hv = c.v_heads;
    Job<T> jobs[4];
    int n = 0;
    for (const model::recipe::Product& m : model::recipe::gdn_in(c))
      jobs[n++] = mj(act(w, m.in), li, static_cast<size_t>(m.weight), act(w, m.out), B, m.cols, m.depth);
    tm.products("gdn.in_proj", jobs, n);
    // The conv over each row's window, the q/k norms and the gates (thread 0: a few thousand values per row).
    const bool chained = ex && ex->state_slots;
    const int32_t* sslots = chained ? ex->state_slots : slots;
    tm.serial("gdn.conv_norms_gates", [&] {
      if (chained) {  // row by row in order, each from the window the row before it left (StepExtras)
        const int64_t hist = c.conv_width - 1;
        T* win = ptr<T>(cache.conv);
        for (int64_t r = 0; r < B; ++r) {
          if (ex->state_from[r] >= 0)
            std::copy_n(win + int64_t{ex->state_from[r]} * hist * CD, hist * CD, win + int64_t{sslots[r]} * hist * CD);
          const auto cols = kernels::ColumnBlocks<T>().add(w.q + r * KD, KD).add(w.k + r * KD, KD).add(w.v + r * VD, VD);
          kernels::causal_conv_silu_cached(w.qkv + r * CD, W.vec(p::kConv), cols, win, sslots + r, 1, 1, CD,
                                           c.conv_width);
        }
      } else {
        const auto cols = kernels::ColumnBlocks<T>().add(w.q, KD).add(w.k, KD).add(w.v, VD);
        kernels::causal_conv_silu_cached(w.qkv, W.vec(p::kConv), cols, ptr<T>(cache.conv), slots, B, 1, CD,
                                         c.conv_width);
      }
      model::recipe::gdn_norms_gates(c, W.vec(p::kALog), W.vec(p::kDtBias), w.q, w.k, w.b, w.a, w.qn, w.kn, w.rstd,
                                     w.rstd2, w.beta, w.g, B);
    });
    // Per (row, value head): the delta-rule step and the gated norm of its output.
    const kernels::DeltaRuleShape ds{B, 1, Hk, Hv, c.dk, c.dv};
    if (chained) {  // per (group, head): the group's rows in order, each from the state the row before it left
      const int64_t L = ex->chain, S = c.dk * c.dv;
      float* st = ptr<float>(cache.state);
      tm.units("gdn.delta_step_norm", B / L * Hv, 1, [&](int64_t g0, int64_t g1) {
        for (int64_t gu = g0; gu < g1; ++gu)
          for (int64_t j = 0; j < L; ++j) {
            const int64_t r = gu / Hv * L + j, hh = gu % Hv, u = r * Hv + hh;
            if (ex->state_from[r] >= 0)
              std::copy_n(st + (int64_t{ex->state_from[r]} * Hv + hh) * S, S, st + (int64_t{sslots[r]} * Hv + hh) * S);
            kernels::delta_rule_step_range(ds, w.qn, w.kn, w.v, w.beta, w.g, w.o, st, sslots, u, u + 1);
            kernels::gated_rmsnorm_forward(w.o + u * c.dv, w.z + u * c.dv, W.vec(p::kGdnNorm), w.y + u * c.dv,
                                           w.rstd + u, 1, c.dv, float(c.rms_eps));
          }
      });
    } else {
      tm.units("gdn.delta_step_norm", B * Hv, 1, [&](int64_t u0, int64_t u1) {
        kernels::delta_rule_step_range(ds, w.qn, w.kn, w.v, w.beta, w.g, w.o, ptr<float>(cache.state), slots, u0, u1);
        kernels::gated_rmsnorm_forward(w.o + u0 * c.dv, w.z + u0 * c.dv, W.vec(p::kGdnNorm), w.y + u0 * c.dv,
                                       w.rstd + u0, u1 - u0, c.dv, float(c.rms_eps));
      });
    }
    const model::recipe::Product m = model::recipe::gdn_out(c);
    const QuantMatrix* qo = qmat(li, static_cast<size_t>(m.weight));
    const T* yin = act(w, m.in);
    if (qo && qo->col_hk > 0) {  // the activations in the file's column order (QuantMatrix::col_hk)
      tm.serial("gdn.out_permute", [&] {
        for (int64_t row = 0; row < B; ++row)
          for (int64_t g = 0; g < qo->col_hk; ++g)
            for (int64_t j = 0; j < qo->col_r; ++j)
              std::copy_n(yin + row * VD + (g * qo->col_r + j) * qo->col_block, qo->col_block,
                          w.o + row * VD + (j * qo->col_hk + g) * qo->col_block);
      });
      yin = w.o;  // free after the gated norm
    }
    Job<T> out = mj(yin, li, static_cast<size_t>(m.weight), act(w, m.out), B, m.cols, m.depth);
    tm.products("gdn.out_proj", &out, 1);
  }

  // Layer li's gated attention from xn to mix; ends after a barrier.
  void attention(Team<T>& tm, const Work& w, size_t li, int64_t B, const int32_t* slots, const int32_t* positions) {
    const model::ModelConfig& c = cfg;
    const model::ComputeWeights<T>& W = cw[li];
    model::LayerCache& cache = caches[li];
    const int64_t nH = c.q_heads, nKV = c.kv_heads, hd = c.head_dim;
    Job<T> jobs[3];
    int n = 0;
    for (const model::recipe::Product& m : model::recipe::attention_in(c))
      jobs[n++] = mj(act(w, m.in), li, static_cast<size_t>(m.weight), act(w, m.out), B, m.cols, m.depth);
    tm.products("attn.qkv_proj", jobs, n);
    const kernels::KvCacheShape kc{nKV, hd, cache.capacity};
    tm.serial("attn.norms_rope_cache", [&] {
      model::recipe::split_query_gate(c, w.qg, w.qraw, w.gate, B);
      model::recipe::attention_norms_rope(c, W.vec(p::kQNorm), W.vec(p::kKNorm), w.qraw, w.kraw, w.aq, w.ak, w.rstd,
                                          w.rstd2, positions, B);
      kernels::kv_cache_write(kc, w.ak, w.vv, ptr<T>(cache.k), ptr<T>(cache.v), slots, positions, B, 1);
    });
    tm.units("attn.cached", B * nH, 1, [&](int64_t u0, int64_t u1) {
      kernels::attention_cached_range(kc, nH, w.aq, w.gate, ptr<T>(cache.k), ptr<T>(cache.v), w.attn, slots,
                                      positions, 1, u0, u1, w.scores + tm.tid * cache.capacity);
    });
    const model::recipe::Product m = model::recipe::attention_out(c);
    Job<T> out = mj(act(w, m.in), li, static_cast<size_t>(m.weight), act(w, m.out), B, m.cols, m.depth);
    tm.products("attn.o_proj", &out, 1);
  }

  // Router products at most this big run on thread 0 with the routing (one barrier fewer).
  static constexpr int64_t kSerialRouterBytes = int64_t{1} << 18;

  // Thread 0: the routing of the rows in xn (router logits when `router_done` is false, softmax, top-k, grouping by
  // expert, the shared expert's gate) and the gathered rows of each expert.
  void route(const Work& w, size_t li, int64_t B, bool logits_done) {
    const model::ModelConfig& c = cfg;
    const model::ComputeWeights<T>& W = cw[li];
    const int f = model::ffn_offset(lw[li].kind);
    const int64_t H = c.hidden, E = c.experts, k = c.top_k;
    if (!logits_done)
      kernels::gemv_rows(w.xn, W.mat(f + p::kRouter), w.probs, B, E, H, 0, 0, 0, E, kernels::gemv_level());
    kernels::pieces::moe_route(B, E, k, c.norm_topk_prob, w.probs, w.idx, w.wts);
    kernels::pieces::moe_group_by_expert(B * k, E, w.idx, w.off + li * (E + 1), w.rslot);
    kernels::pieces::moe_shared_scale(B, H, w.xn, W.vec(f + p::kSharedExpertGate), w.scale);
    for (int64_t r = 0; r < B * k; ++r) std::copy_n(w.xn + (w.rslot[r] / k) * H, H, w.xg + r * H);
  }

  // Layer li's feed-forward block after its mixer (mix ready), through h = hmid + ffn and the next layer's input norm
  // (or the final norm into xf after the last layer); ends after a barrier.
  void ffn(Team<T>& tm, const Work& w, size_t li, int64_t B) {
    const model::ModelConfig& c = cfg;
    const model::ComputeWeights<T>& W = cw[li];
    const int f = model::ffn_offset(lw[li].kind);
    const int64_t H = c.hidden;
    const bool serial_router = c.moe() && c.experts * H * int64_t(sizeof(T)) <= kSerialRouterBytes;
    const int64_t* off = w.off + li * (c.experts + 1);  // this layer's routing (see Phase)
    tm.serial("ffn.add_norm_route", [&] {
      model::recipe::residual_post_norm(c, W.vec(p::kPostNorm), w.h, w.mix, w.hmid, w.xn, w.rstd, B);
      if (serial_router) route(w, li, B, false);
    });
    if (!c.moe()) {
      const int64_t I = c.intermediate;
      Job<T> gu[2] = {mj(w.xn, li, f + p::kMlpGate, w.gu, B, I, H, 2 * I),
                      mj(w.xn, li, f + p::kMlpUp, w.gu + I, B, I, H, 2 * I)};
      tm.products("mlp.gate_up", gu, 2);
      tm.units("mlp.swiglu", B, 4, [&](int64_t r0, int64_t r1) {
        kernels::pieces::swiglu_act_rows(r1 - r0, I, w.gu + r0 * 2 * I, nullptr, w.act + r0 * I);
      });
      Job<T> down = mj(w.act, li, f + p::kMlpDown, w.ffn, B, H, I);
      tm.products("mlp.down", &down, 1);
    } else {
      const int64_t E = c.experts, k = c.top_k, I = c.expert_inter, Is = c.shared_inter;
      if (!serial_router) {
        Job<T> router = job_f32(w.xn, W.mat(f + p::kRouter), w.probs, B, E, H);
        tm.products("moe.router", &router, 1);
        tm.serial("moe.route", [&] { route(w, li, B, true); });
      }
      const T* gate_up = static_cast<const T*>(lw[li][static_cast<size_t>(f + p::kGateUp)].data);
      const T* down = static_cast<const T*>(lw[li][static_cast<size_t>(f + p::kDown)].data);
      // The experts with rows (at most B * k of them) and the shared expert's gate and up.
      thread_local std::vector<Job<T>> jobs;  // at most min(E, B k) + 2; grows once per thread
      jobs.resize(static_cast<size_t>(2 * std::min(E, B * k) + 2));
      int n = 0;
      auto add = [&](const Job<T>& j) { jobs[static_cast<size_t>(n++)] = j; };
      for (int64_t e = 0; e < E; ++e) {
        const int64_t a = off[e], m = off[e + 1] - a;
        if (m <= 0) continue;
        const QuantMatrix* g0 = qmat(li, f + p::kGateUp, 0);
        const QuantMatrix* g1 = qmat(li, f + p::kGateUp, 1);
        if (g1) {  // gate [E, I, H] and up [E, I, H] apart: each expert's rows of both
          add(qjob(w.xg + a * H, *g0, e * I, reinterpret_cast<float*>(w.gu + a * 2 * I), m, I, H, 2 * I));
          add(qjob(w.xg + a * H, *g1, e * I, reinterpret_cast<float*>(w.gu + a * 2 * I + I), m, I, H, 2 * I));
        } else if (g0) {
          add(qjob(w.xg + a * H, *g0, e * 2 * I, reinterpret_cast<float*>(w.gu + a * 2 * I), m, 2 * I, H));
        } else {
          add(job(w.xg + a * H, gate_up + e * 2 * I * H, w.gu + a * 2 * I, m, 2 * I, H));
        }
      }
      add(mj(w.xn, li, f + p::kSharedGate, w.sgu, B, Is, H, 2 * Is));
      add(mj(w.xn, li, f + p::kSharedUp, w.sgu + Is, B, Is, H, 2 * Is));
      tm.products("moe.gate_up", jobs.data(), n);
      tm.units("moe.swiglu", B * k + B, 4, [&](int64_t a0, int64_t a1) {  // the routed rows, then the shared expert's
        const int64_t e0 = std::min(a0, B * k), e1 = std::min(a1, B * k);
        if (e1 > e0) kernels::pieces::swiglu_act_rows(e1 - e0, I, w.gu + e0 * 2 * I, nullptr, w.act + e0 * I);
        const int64_t s0 = std::max(a0, B * k) - B * k, s1 = std::max(a1, B * k) - B * k;
        if (s1 > s0) kernels::pieces::swiglu_act_rows(s1 - s0, Is, w.sgu + s0 * 2 * Is, nullptr, w.sact + s0 * Is);
      });
      n = 0;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t a = off[e], m = off[e + 1] - a;
        if (m <= 0) continue;
        if (const QuantMatrix* d = qmat(li, f + p::kDown)) add(qjob(w.act + a * I, *d, e * H, w.ye + a * H, m, H, I));
        else add(job_f32(w.act + a * I, down + e * H * I, w.ye + a * H, m, H, I));
      }
      add(mj(w.sact, li, f + p::kSharedDown, w.sout, B, H, Is));
      tm.products("moe.down", jobs.data(), n);
    }
    tm.serial("ffn.combine_add_norm", [&] {
      if (c.moe())
        for (int64_t e = 0; e < c.experts; ++e) {
          const int64_t a = off[e], m = off[e + 1] - a;
          if (m > 0)
            kernels::pieces::moe_add_expert_rows(m, H, c.top_k, w.rslot + a, w.idx, w.wts, w.scale, w.sout,
                                                 w.ye + a * H, w.sum, w.ffn);
        }
      model::add(w.hmid, w.ffn, w.h, B * H);
      if (li + 1 < order.size()) input_norm(w, li + 1, B);
      else {
        kernels::rmsnorm_forward(w.h, final_norm.ptr, w.xf, w.rstd, B, H, float(c.rms_eps));
        if (ex && ex->hidden) std::copy_n(w.xf, B * H, static_cast<T*>(ex->hidden));
      }
    });
  }

  int64_t c_experts() const { return std::max<int64_t>(cfg.experts, 1); }

  void run(int64_t B, const int32_t* slots, const int32_t* positions, const int32_t* ids, float* logits,
           const StepExtras* extras) {
    ex = extras;
    if (ex && ex->state_slots && (ex->chain <= 0 || B % ex->chain != 0 || !ex->state_from))
      throw std::invalid_argument("fused step: chained rows come in whole groups, each row with a state_from");
    if (B <= 0 || B > kernels::kGemvMaxRows)
      throw std::invalid_argument("fused step: " + std::to_string(B) + " rows (1 to " +
                                  std::to_string(kernels::kGemvMaxRows) + ")");
    const int threads = omp_get_max_threads();
    const int64_t capacity = caches.empty() ? 0 : caches.front().capacity;
    Carve sizing(nullptr);
    carve(sizing, B, threads, capacity);
    Buffer ws = mem.allocate(sizing.bytes(), MemCategory::Workspace, "fused_step.workspace");
    if (mem.planning()) return;
    if (quant && qpool.empty()) qpool.resize(static_cast<size_t>(2 * std::max<int64_t>(std::min(c_experts(), kernels::kGemvMaxRows * std::max<int64_t>(cfg.top_k, 1)), 1) + 4));
    Carve cv(ws.data());
    const Work w = carve(cv, B, threads, capacity);
    for (Phase& ph : phases) {
      ph.next.store(0, std::memory_order_relaxed);
      ph.done.store(0, std::memory_order_relaxed);
    }
    const kernels::cpu::Level isa = kernels::gemv_level();
    const model::ModelConfig& c = cfg;
    const int64_t H = c.hidden, V = c.vocab;
    const TensorView& embed = params.global(model::g::kEmbed);
    const T* head = static_cast<const T*>(params.global(model::g::kLmHead).data);
    std::optional<PhaseClock> clock;
    if (g_timing.load(std::memory_order_relaxed)) clock.emplace().spans.reserve(phases.size());
#pragma omp parallel num_threads(threads)
    {
      Team<T> tm{omp_get_thread_num(), omp_get_num_threads(), phases.data(), static_cast<int64_t>(phases.size()), sleepers, isa,
                 &qpool};
      if (clock && tm.tid == 0) tm.clock = &*clock;
      // Shapes and positions are checked before the region (Decoder::step), so nothing in it throws on good input.
      tm.serial("embedding_norm", [&] {
        if (ex && ex->input) {  // the rows given (the MTP layer's projection)
          std::copy_n(static_cast<const T*>(ex->input), B * H, w.h);
        } else if (quant && quant->embed) {  // rows dequantized on lookup
          if constexpr (std::is_same_v<T, float>)
            for (int64_t b = 0; b < B; ++b)
              kernels::dequantize_row(quant->embed->type, quant->embed->row(ids[b]), w.h + b * H, H);
        } else if (embed.dtype == DType::F32)
          kernels::embedding_forward(ids, B, static_cast<const float*>(embed.data), V, H, w.h);
        else kernels::embedding_forward(ids, B, static_cast<const bf16*>(embed.data), V, H, w.h);
        if (!order.empty()) input_norm(w, 0, B);
        else kernels::rmsnorm_forward(w.h, final_norm.ptr, w.xf, w.rstd, B, H, float(c.rms_eps));
      });
      for (size_t i = 0; i < order.size(); ++i) {
        if (order[i].kind() == LayerKind::LinearAttention) gdn(tm, w, i, B, slots);
        else attention(tm, w, i, B, slots, positions);
        ffn(tm, w, i, B);
      }
      if (logits) {
        Job<T> lm = quant && quant->lm_head ? qjob(w.xf, *quant->lm_head, 0, logits, B, V, H)
                                            : job_f32(w.xf, head, logits, B, V, H);
        tm.products("lm_head", &lm, 1);
      }
    }
    if (clock) {
      std::lock_guard<std::mutex> lock(g_times_mu);
      for (const auto& [name, sec] : clock->spans) {
        auto it = std::find_if(g_times.begin(), g_times.end(), [&](const FusedPhaseTime& t) { return t.name == name; });
        if (it == g_times.end()) it = g_times.insert(g_times.end(), FusedPhaseTime{name, 0, 0});
        it->seconds += sec;
        ++it->count;
      }
    }
  }
};

void fused_step_quant_reference(QuantReference r) { g_quant_ref.store(r); }

void fused_step_timing(bool on) {
  std::lock_guard<std::mutex> lock(g_times_mu);
  g_times.clear();
  g_timing.store(on, std::memory_order_relaxed);
}

std::vector<FusedPhaseTime> fused_step_phase_times() {
  std::lock_guard<std::mutex> lock(g_times_mu);
  return g_times;
}

template <typename T>
bool FusedStep<T>::supported(const model::ParamSet& params, DType compute) {
  if (compute != dtype_of<T>() || params.shards() != 1) return false;
  const model::ModelConfig& c = params.config();
  if (params.global(model::g::kLmHead).dtype != compute) return false;
  if (c.dv > 512 || c.head_dim > 1024) return false;
  for (int64_t i = 0; i < c.layers; ++i) {
    const model::LayerSlot s = model::slot_of_layer(c, i);
    const model::LayerWeights lw = params.layer(s);
    const auto specs = model::layer_specs(c, s.kind());
    for (size_t j = 0; j < specs.size(); ++j)
      if (specs[j].is_matrix && lw[j].dtype != compute) return false;
  }
  return true;
}

template <typename T>
FusedStep<T>::FusedStep(const model::ParamSet& params, const std::vector<model::LayerSlot>& order,
                        std::vector<model::LayerCache>& caches, MemoryAccountant& mem, const QuantWeights* quant,
                        const TensorView* final_norm)
    : impl_(std::make_unique<Impl>(params, order, caches, mem, quant, final_norm)) {}

template <typename T> FusedStep<T>::~FusedStep() = default;

template <typename T>
void FusedStep<T>::run(int64_t B, const int32_t* slots, const int32_t* positions, const int32_t* ids, float* logits,
                       const StepExtras* extras) {
  impl_->run(B, slots, positions, ids, logits, extras);
}

template class FusedStep<float>;
template class FusedStep<bf16>;

}  // namespace hs::infer
