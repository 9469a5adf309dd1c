// Plain references for the embedding, norms, short conv, GDN gates and AdamW kernels: straight loops,
// every intermediate in double, the oracles for the fast kernels' tests.
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/conv.h"
#include "kernels/embedding.h"
#include "kernels/gdn_gates.h"
#include "kernels/norms.h"

namespace hs::kernels::reference {
namespace {

template <typename T> double ld(T x) { return static_cast<double>(to_f32(x)); }
template <typename T> T st(double x) {
  if constexpr (std::is_same_v<T, double>)
    return x;
  else
    return from_f32<T>(static_cast<float>(x));
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double silu(double x) { return x * sigmoid(x); }
double dsilu(double x) {
  const double s = sigmoid(x);
  return s * (1.0 + x * (1.0 - s));
}
// Same threshold as softplusf (PyTorch's default of 20).
double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

// Gradients that collect several contributions are summed in double and added to the caller's once.
template <typename P> void add_to(P* dst, const std::vector<double>& src) {
  for (size_t i = 0; i < src.size(); ++i) dst[i] += static_cast<P>(src[i]);
}

void check_ids(const int32_t* ids, int64_t n, int64_t vocab) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      throw std::out_of_range("embedding: token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                              " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

}  // namespace

// ---- embedding ----

template <typename TW, typename TA>
void embedding_forward(const int32_t* ids, int64_t n, const TW* table, int64_t vocab, int64_t dim, TA* out) {
  check_ids(ids, n, vocab);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < dim; ++c) out[i * dim + c] = st<TA>(ld(table[ids[i] * dim + c]));
}

template <typename P>
void embedding_backward(const int32_t* ids, int64_t n, const P* dout, int64_t vocab, int64_t dim, P* dtable) {
  check_ids(ids, n, vocab);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < dim; ++c) dtable[ids[i] * dim + c] += dout[i * dim + c];
}

// ---- norms ----

template <typename T, typename P>
void rmsnorm_forward(const T* x, const P* w, T* y, P* rstd, int64_t rows, int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    double ss = 0;
    for (int64_t c = 0; c < dim; ++c) ss += ld(xr[c]) * ld(xr[c]);
    const double rs = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
    for (int64_t c = 0; c < dim; ++c) y[r * dim + c] = st<T>(ld(xr[c]) * rs * (1.0 + static_cast<double>(w[c])));
    if (rstd) rstd[r] = static_cast<P>(rs);
  }
}

// With g = dy * scale (scale = 1 + w, or the gate product), y = x * rstd * scale and
// rstd = (mean(x^2) + eps)^-1/2: dx = rstd * (g - x * rstd^2 * mean(g * x)).
template <typename T, typename P>
void rmsnorm_backward(const T* x, const P* w, const P* rstd, const P* dy, P* dx, P* dw, int64_t rows, int64_t dim) {
  std::vector<double> dw_acc(static_cast<size_t>(dim));
  for (int64_t r = 0; r < rows; ++r) {
    const double rs = static_cast<double>(rstd[r]);
    double dot = 0;
    for (int64_t c = 0; c < dim; ++c)
      dot += static_cast<double>(dy[r * dim + c]) * (1.0 + static_cast<double>(w[c])) * ld(x[r * dim + c]);
    const double k = rs * rs * dot / static_cast<double>(dim);
    for (int64_t c = 0; c < dim; ++c) {
      const double xv = ld(x[r * dim + c]), g = static_cast<double>(dy[r * dim + c]);
      dx[r * dim + c] += static_cast<P>(rs * (g * (1.0 + static_cast<double>(w[c])) - xv * k));
      dw_acc[c] += g * xv * rs;
    }
  }
  add_to(dw, dw_acc);
}

template <typename T, typename P>
void gated_rmsnorm_forward(const T* x, const T* z, const P* w, T* y, P* rstd, int64_t rows, int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < dim; ++c) ss += ld(x[r * dim + c]) * ld(x[r * dim + c]);
    const double rs = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
    for (int64_t c = 0; c < dim; ++c)
      y[r * dim + c] = st<T>(static_cast<double>(w[c]) * ld(x[r * dim + c]) * rs * silu(ld(z[r * dim + c])));
    if (rstd) rstd[r] = static_cast<P>(rs);
  }
}

template <typename T, typename P>
void gated_rmsnorm_backward(const T* x, const T* z, const P* w, const P* rstd, const P* dy, P* dx, P* dz, P* dw,
                            int64_t rows, int64_t dim) {
  std::vector<double> dw_acc(static_cast<size_t>(dim));
  for (int64_t r = 0; r < rows; ++r) {
    const double rs = static_cast<double>(rstd[r]);
    double dot = 0;
    for (int64_t c = 0; c < dim; ++c)
      dot += static_cast<double>(dy[r * dim + c]) * static_cast<double>(w[c]) * silu(ld(z[r * dim + c])) *
             ld(x[r * dim + c]);
    const double k = rs * rs * dot / static_cast<double>(dim);
    for (int64_t c = 0; c < dim; ++c) {
      const double xv = ld(x[r * dim + c]), zv = ld(z[r * dim + c]), g = static_cast<double>(dy[r * dim + c]);
      const double wv = static_cast<double>(w[c]);
      dx[r * dim + c] += static_cast<P>(rs * (g * wv * silu(zv) - xv * k));
      dz[r * dim + c] += static_cast<P>(g * wv * xv * rs * dsilu(zv));
      dw_acc[c] += g * xv * rs * silu(zv);
    }
  }
  add_to(dw, dw_acc);
}

template <typename T, typename P>
void l2norm_forward(const T* x, T* y, P* rstd, int64_t rows, int64_t dim, double eps, double scale) {
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < dim; ++c) ss += ld(x[r * dim + c]) * ld(x[r * dim + c]);
    const double rs = 1.0 / std::sqrt(ss + eps);
    for (int64_t c = 0; c < dim; ++c) y[r * dim + c] = st<T>(scale * ld(x[r * dim + c]) * rs);
    if (rstd) rstd[r] = static_cast<P>(rs);
  }
}

// y = scale * x * rstd, rstd = (sum(x^2) + eps)^-1/2: dx = scale * rstd * (dy - x * rstd^2 * sum(dy * x)).
template <typename T, typename P>
void l2norm_backward(const T* x, const P* rstd, const P* dy, P* dx, int64_t rows, int64_t dim, double scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const double rs = static_cast<double>(rstd[r]);
    double dot = 0;
    for (int64_t c = 0; c < dim; ++c) dot += static_cast<double>(dy[r * dim + c]) * ld(x[r * dim + c]);
    for (int64_t c = 0; c < dim; ++c)
      dx[r * dim + c] +=
          static_cast<P>(scale * rs * (static_cast<double>(dy[r * dim + c]) - ld(x[r * dim + c]) * rs * rs * dot));
  }
}

// ---- short conv ----

namespace {
template <typename T, typename P>
double conv_pre(const T* x, const P* w, int64_t b, int64_t t, int64_t c, int64_t seq, int64_t channels, int64_t width,
                const int32_t* positions) {
  double acc = 0;
  const int64_t start = document_start(positions, b * seq + t, t);
  for (int64_t j = 0; j < width; ++j) {
    const int64_t ts = t - width + 1 + j;
    if (ts >= start) acc += static_cast<double>(w[c * width + j]) * ld(x[(b * seq + ts) * channels + c]);
  }
  return acc;
}
}  // namespace

template <typename T, typename P>
void causal_conv_silu_forward(const T* x, const P* w, T* y, int64_t batch, int64_t seq, int64_t channels,
                              int64_t width, const int32_t* positions) {
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq; ++t)
      for (int64_t c = 0; c < channels; ++c)
        y[(b * seq + t) * channels + c] = st<T>(silu(conv_pre(x, w, b, t, c, seq, channels, width, positions)));
}

template <typename T, typename P>
void causal_conv_silu_backward(const T* x, const P* w, const P* dy, P* dx, P* dw, int64_t batch, int64_t seq,
                               int64_t channels, int64_t width, const int32_t* positions) {
  std::vector<double> dx_acc(static_cast<size_t>(batch * seq * channels)),
      dw_acc(static_cast<size_t>(channels * width));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq; ++t)
      for (int64_t c = 0; c < channels; ++c) {
        const int64_t o = (b * seq + t) * channels + c;
        const double dpre = static_cast<double>(dy[o]) * dsilu(conv_pre(x, w, b, t, c, seq, channels, width, positions));
        const int64_t start = document_start(positions, b * seq + t, t);
        for (int64_t j = 0; j < width; ++j) {
          const int64_t ts = t - width + 1 + j;
          if (ts < start) continue;
          const int64_t i = (b * seq + ts) * channels + c;
          dx_acc[i] += dpre * static_cast<double>(w[c * width + j]);
          dw_acc[c * width + j] += dpre * ld(x[i]);
        }
      }
  add_to(dx, dx_acc);
  add_to(dw, dw_acc);
}

// ---- GDN gates ----

template <typename T, typename P>
void gdn_gates_forward(const T* b, const T* a, const P* A_log, const P* dt_bias, P* beta, P* g, int64_t rows,
                       int64_t heads) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t i = r * heads + h;
      beta[i] = static_cast<P>(sigmoid(ld(b[i])));
      g[i] = static_cast<P>(-std::exp(static_cast<double>(A_log[h])) *
                            softplus(ld(a[i]) + static_cast<double>(dt_bias[h])));
    }
}

// dbeta/db = beta (1 - beta); dg/da = dg/ddt_bias = -exp(A_log) sigmoid(a + dt_bias); dg/dA_log = g.
template <typename T, typename P>
void gdn_gates_backward(const T* b, const T* a, const P* A_log, const P* dt_bias, const P* dbeta, const P* dg, P* db,
                        P* da, P* dA_log, P* ddt_bias, int64_t rows, int64_t heads) {
  std::vector<double> dA_acc(static_cast<size_t>(heads)), ddt_acc(static_cast<size_t>(heads));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t i = r * heads + h;
      const double s = sigmoid(ld(b[i]));
      db[i] += static_cast<P>(static_cast<double>(dbeta[i]) * s * (1.0 - s));
      const double u = ld(a[i]) + static_cast<double>(dt_bias[h]);
      const double e = std::exp(static_cast<double>(A_log[h]));
      const double du = static_cast<double>(dg[i]) * -e * sigmoid(u);
      da[i] += static_cast<P>(du);
      ddt_acc[h] += du;
      dA_acc[h] += static_cast<double>(dg[i]) * -e * softplus(u);
    }
  add_to(dA_log, dA_acc);
  add_to(ddt_bias, ddt_acc);
}

// ---- AdamW ----

template <typename TW, typename P>
void adamw_update(TW* w, const P* grad, P* m, P* v, int64_t n, const AdamWParams& p, int64_t step) {
  if (step < 1) throw std::invalid_argument("adamw_update: step is 1-based, got " + std::to_string(step));
  const double lr = p.lr, b1 = p.beta1, b2 = p.beta2, eps = p.eps, wd = p.weight_decay;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
  for (int64_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(grad[i]) * static_cast<double>(p.grad_scale);
    const double mi = b1 * static_cast<double>(m[i]) + (1.0 - b1) * g;
    const double vi = b2 * static_cast<double>(v[i]) + (1.0 - b2) * g * g;
    const double wi = ld(w[i]);
    w[i] = st<TW>(wi - lr * ((mi / bc1) / (std::sqrt(vi / bc2) + eps) + wd * wi));
    m[i] = static_cast<P>(mi);
    v[i] = static_cast<P>(vi);
  }
}

template <typename P> double sum_squares(const P* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return s;
}

// ---- instantiations ----

#define HS_REF_TP(T, P)                                                                                              \
  template void rmsnorm_forward<T, P>(const T*, const P*, T*, P*, int64_t, int64_t, double);                         \
  template void rmsnorm_backward<T, P>(const T*, const P*, const P*, const P*, P*, P*, int64_t, int64_t);            \
  template void gated_rmsnorm_forward<T, P>(const T*, const T*, const P*, T*, P*, int64_t, int64_t, double);         \
  template void gated_rmsnorm_backward<T, P>(const T*, const T*, const P*, const P*, const P*, P*, P*, P*, int64_t,  \
                                             int64_t);                                                               \
  template void l2norm_forward<T, P>(const T*, T*, P*, int64_t, int64_t, double, double);                            \
  template void l2norm_backward<T, P>(const T*, const P*, const P*, P*, int64_t, int64_t, double);                   \
  template void causal_conv_silu_forward<T, P>(const T*, const P*, T*, int64_t, int64_t, int64_t, int64_t,          \
                                               const int32_t*);                                                      \
  template void causal_conv_silu_backward<T, P>(const T*, const P*, const P*, P*, P*, int64_t, int64_t, int64_t,     \
                                                int64_t, const int32_t*);                                            \
  template void gdn_gates_forward<T, P>(const T*, const T*, const P*, const P*, P*, P*, int64_t, int64_t);           \
  template void gdn_gates_backward<T, P>(const T*, const T*, const P*, const P*, const P*, const P*, P*, P*, P*, P*, \
                                         int64_t, int64_t);                                                          \
  template void adamw_update<T, P>(T*, const P*, P*, P*, int64_t, const AdamWParams&, int64_t);

HS_REF_TP(float, float)
HS_REF_TP(bf16, float)
HS_REF_TP(double, double)
#undef HS_REF_TP

template void embedding_forward<float, float>(const int32_t*, int64_t, const float*, int64_t, int64_t, float*);
template void embedding_forward<float, bf16>(const int32_t*, int64_t, const float*, int64_t, int64_t, bf16*);
template void embedding_forward<bf16, float>(const int32_t*, int64_t, const bf16*, int64_t, int64_t, float*);
template void embedding_forward<bf16, bf16>(const int32_t*, int64_t, const bf16*, int64_t, int64_t, bf16*);
template void embedding_forward<double, double>(const int32_t*, int64_t, const double*, int64_t, int64_t, double*);
template void embedding_backward<float>(const int32_t*, int64_t, const float*, int64_t, int64_t, float*);
template void embedding_backward<double>(const int32_t*, int64_t, const double*, int64_t, int64_t, double*);
template double sum_squares<float>(const float*, int64_t);
template double sum_squares<double>(const double*, int64_t);

}  // namespace hs::kernels::reference
