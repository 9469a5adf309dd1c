// The plain matrix product, the oracle of the matmul tests: every sum in double, rounded once.
#include "kernels/matmul.h"

namespace hs::kernels {

template <typename TA, typename TC>
void matmul_reference(const TA* A, const TA* B, TC* C, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                      bool acc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = acc ? static_cast<double>(to_f32(C[i * N + j])) : 0.0;
      for (int64_t p = 0; p < K; ++p) {
        double a = to_f32(ta ? A[p * M + i] : A[i * K + p]);
        double b = to_f32(tb ? B[j * K + p] : B[p * N + j]);
        s += a * b;
      }
      C[i * N + j] = from_f32<TC>(static_cast<float>(s));
    }
}
template void matmul_reference<float, float>(const float*, const float*, float*, int64_t, int64_t, int64_t,
                                             bool, bool, bool);
template void matmul_reference<bf16, float>(const bf16*, const bf16*, float*, int64_t, int64_t, int64_t,
                                            bool, bool, bool);

}  // namespace hs::kernels
