#include "model/mtp.h"

#include <cstring>

#include "core/compute.h"
#include "core/dtype.h"
#include "kernels/matmul.h"
#include "kernels/norms.h"

namespace hs::model {

int64_t mtp_shift(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq, int32_t* next_ids,
                  int32_t* mtp_targets) {
  int64_t counted = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq; ++t) {
      const int64_t i = b * seq + t;
      const bool last = t + 1 == seq;
      next_ids[i] = last ? (targets[i] >= 0 ? targets[i] : 0) : inputs[i + 1];
      // x_{t+2} counts only when x_{t+1} does too: a position whose next token is ignored ends its document (packed
      // documents) or precedes an untrained span, and the token after it belongs to what follows.
      mtp_targets[i] = last || targets[i] < 0 ? -1 : targets[i + 1];
      counted += mtp_targets[i] >= 0;
    }
  return counted;
}

namespace {

template <typename T> T* tp(const Buffer& b) { return static_cast<T*>(b.data()); }

}  // namespace

template <typename T>
void mtp_input_forward(MemoryAccountant& mem, const T* e, const T* h, const float* w_e, const float* w_h, const T* fc,
                       T* m, int64_t N, int64_t H, float eps, MtpInputSaved& s) {
  s.cat = mem.allocate_n<T>(static_cast<size_t>(N * 2 * H), MemCategory::Workspace, "mtp.cat");
  s.rstd_e = mem.allocate_n<float>(static_cast<size_t>(N), MemCategory::Workspace, "mtp.rstd_e");
  s.rstd_h = mem.allocate_n<float>(static_cast<size_t>(N), MemCategory::Workspace, "mtp.rstd_h");
  Buffer en = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "mtp.norm_e");
  Buffer hn = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "mtp.norm_h");
  compute(mem, [&] {
    kernels::rmsnorm_forward(e, w_e, tp<T>(en), tp<float>(s.rstd_e), N, H, eps);
    kernels::rmsnorm_forward(h, w_h, tp<T>(hn), tp<float>(s.rstd_h), N, H, eps);
    T* cat = tp<T>(s.cat);
    for (int64_t i = 0; i < N; ++i) {
      std::memcpy(cat + i * 2 * H, tp<T>(en) + i * H, static_cast<size_t>(H) * sizeof(T));
      std::memcpy(cat + i * 2 * H + H, tp<T>(hn) + i * H, static_cast<size_t>(H) * sizeof(T));
    }
    kernels::matmul(cat, fc, m, N, H, 2 * H, false, true);
  });
}

template <typename T>
void mtp_input_backward(MemoryAccountant& mem, const T* e, const T* h, const float* w_e, const float* w_h, const T* fc,
                        const MtpInputSaved& s, const float* dm, float* de, float* dh, float* dw_e, float* dw_h,
                        float* dfc, int64_t N, int64_t H) {
  // dm in T for the products (the layers round their output gradients the same way).
  Buffer dm_t = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "mtp.dm");
  Buffer dcat = mem.allocate_n<float>(static_cast<size_t>(N * 2 * H), MemCategory::Workspace, "mtp.dcat");
  Buffer dpart = mem.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "mtp.dnorm");
  compute(mem, [&] {
    T* dmt = tp<T>(dm_t);
    for (int64_t i = 0; i < N * H; ++i) dmt[i] = from_f32<T>(dm[i]);
    kernels::matmul(dmt, tp<T>(s.cat), dfc, H, 2 * H, N, true, false, /*accumulate=*/true);  // dfc += dm^T cat
    kernels::matmul(dmt, fc, tp<float>(dcat), N, 2 * H, H, false, false);                    // dcat = dm fc
    float* d = tp<float>(dpart);
    for (int64_t i = 0; i < N; ++i) std::memcpy(d + i * H, tp<float>(dcat) + i * 2 * H, static_cast<size_t>(H) * 4);
    kernels::rmsnorm_backward(e, w_e, tp<float>(s.rstd_e), d, de, dw_e, N, H, /*accumulate=*/false);
    for (int64_t i = 0; i < N; ++i) std::memcpy(d + i * H, tp<float>(dcat) + i * 2 * H + H, static_cast<size_t>(H) * 4);
    kernels::rmsnorm_backward(h, w_h, tp<float>(s.rstd_h), d, dh, dw_h, N, H, /*accumulate=*/true);
  });
}

#define HS_MTP_INST(T)                                                                                              \
  template void mtp_input_forward<T>(MemoryAccountant&, const T*, const T*, const float*, const float*, const T*,  \
                                     T*, int64_t, int64_t, float, MtpInputSaved&);                                 \
  template void mtp_input_backward<T>(MemoryAccountant&, const T*, const T*, const float*, const float*, const T*, \
                                      const MtpInputSaved&, const float*, float*, float*, float*, float*, float*,  \
                                      int64_t, int64_t);
HS_MTP_INST(float)
HS_MTP_INST(bf16)

}  // namespace hs::model
