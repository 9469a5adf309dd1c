// The gated delta rule, the recurrence at the heart of the Gated DeltaNet layer (docs/model.md,
// "Gated DeltaNet" step 5 and "Chunked form"). Per (batch, value head), with state S [dk, dv] zero at
// sequence start:
//   S = exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S = S + k_t delta^T;  o_t = S^T q_t.
// The fast kernels use the chunked (WY) form with chunk C = 64; the references run it token by token.
#pragma once
#include <cstdint>

#include "kernels/common.h"

namespace hs::kernels {

inline constexpr int64_t kDeltaRuleChunk = 64;

struct DeltaRuleShape {
  int64_t batch, seq, k_heads, v_heads, dk, dv;  // r = v_heads / k_heads (integer)
  // Packed documents (kernels/common.h; null: one document a sequence): the state restarts from zero at every
  // document start, also in the middle of a chunk (the chunked form's "Packed documents" in docs/model.md).
  const int32_t* positions = nullptr;
  int64_t ratio() const { return v_heads / k_heads; }
  int64_t chunks() const { return (seq + kDeltaRuleChunk - 1) / kDeltaRuleChunk; }
  int64_t padded_seq() const { return chunks() * kDeltaRuleChunk; }
};

// What the forward keeps for the backward, all fp32:
//   tinv [B, Hv, nchunks, 64, 64]: per chunk (I + M)^-1 (unit lower triangular);
//   gcum [B, Hv, Tpad]: the gate's cumulative sum restarted at every chunk (G of the chunked form);
//   only with keep_chunk_states (else empty, and the backward recomputes them from the above):
//   W [B, Hv, nchunks, 64, dkp], vn [B, Hv, nchunks, 64, dvp] and S [B, Hv, nchunks, dkp, dvp], every chunk's W,
//   V_new and start state (dkp, dvp: dk, dv rounded up to 16; slot 0, chunk 0's zero start state, stays unwritten).
struct DeltaRuleSaved {
  Buffer tinv;
  Buffer gcum;
  Buffer W, vn, S;
};

// The inputs of the chunked kernels' matrix products (their sums are fp32 either way; the state S, the gates' cumulative
// sums, Tinv's solve and every elementwise step stay fp32):
//   Fp32: every product in fp32 (bf16 storage widened exactly on load) - the default.
//   Bf16: with bf16 storage (T = bf16) on a CPU with AVX-512-BF16, every product rounds its two operands to bf16
//         (nearest even) and multiplies them with vdpbf16ps into fp32 sums, as flash-linear-attention's kernels run
//         tl.dot on bf16 inputs; the operands derived in fp32 (Tinv, W, V_new, S, the scaled q and k, the gradients)
//         lose their low 16 bits there. Elsewhere (fp32 storage, or a CPU without AVX-512-BF16) it runs Fp32.
enum class DeltaRuleProducts { Fp32, Bf16 };

// Whether this CPU runs the Bf16 products (else Bf16 falls back to Fp32); HS_DELTA_RULE_BF16_PRODUCTS=off forces the
// fallback (read at every call).
bool delta_rule_bf16_products_available();

// q, k: [B, T, Hk, dk] (q already L2-normalised and scaled by dk^-0.5, k L2-normalised, by the caller);
// v, o: [B, T, Hv, dv]; beta, g: [B, T, Hv] fp32 (g <= 0 is the log-decay). Value head h reads key
// head h / r (repeat_interleave). saved == nullptr: inference, keep nothing.
// keep_chunk_states (with saved): also keep every chunk's W, V_new and start state, which the backward then reads
// instead of recomputing (~(dk + dv) * 4 + dk * dv * 4 / 64 bytes more per token and value head: remat none).
template <typename T>
void delta_rule_forward(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta,
                        const float* g, T* o, DeltaRuleSaved* saved, MemoryAccountant& mem,
                        bool keep_chunk_states = false, DeltaRuleProducts products = DeltaRuleProducts::Fp32);

// Inference that continues sequences (src/infer's prefill): the same chunked forward, nothing saved, starting from
// state[slots[b]] ([slots, Hv, dk, dv] fp32, one [dk, dv] state per value head) instead of zero, and leaving each
// sequence's end state there, so a sequence processed in pieces gives what it gives processed at once.
template <typename T>
void delta_rule_forward_cached(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta,
                               const float* g, T* o, float* state, const int32_t* slots, MemoryAccountant& mem,
                               DeltaRuleProducts products = DeltaRuleProducts::Fp32);

// Accumulates (+=) into dq, dk [B, T, Hk, dk], dv [B, T, Hv, dv], dbeta, dg [B, T, Hv] (all fp32; with accumulate
// false it writes them, so the caller clears nothing; the same bits as adding to zeros), given
// d_o [B, T, Hv, dv]. Recomputes W, U and the chunk-start states from `saved` unless the forward kept them (g
// itself is not read: saved holds its cumulative sums). Workspace, per thread and for the one head it is working
// on: 64-row tiles and, when recomputing, W and V_new (T (dk + dv) floats) and the chunk-start states
// (T/64 dk dv); plus, only when r > 1 and there
// are fewer (batch, key head) pairs than threads, per-value-head dq, dk partials (2 B T Hv dk). Results are
// deterministic and independent of the thread count.
template <typename T>
void delta_rule_backward(const DeltaRuleShape& s, const T* q, const T* k, const T* v, const float* beta,
                         const float* g, const DeltaRuleSaved& saved, const float* d_o, float* dq, float* dk,
                         float* dv, float* dbeta, float* dg, MemoryAccountant& mem, bool accumulate = true,
                         DeltaRuleProducts products = DeltaRuleProducts::Fp32);

namespace detail {
// One of the kernels' own register-blocked products, Cm[M, N] = A[M, K] B[K, N] (row-major, leading dimensions K, N
// and N; M % 4 == 0, N and K multiples of 16), with the products' input kind (Bf16 includes packing both operands;
// it throws where the CPU lacks AVX-512-BF16). For bench/delta_rule_bench's peak figures and the tests.
void delta_rule_product(int64_t M, int64_t N, int64_t K, const float* A, const float* B, float* Cm,
                        DeltaRuleProducts products);
}  // namespace detail

// Defined in src/kernels/reference/ (hs_kernel_references: tests and benchmarks link it, the engine does not).
namespace reference {

// The recurrent (token by token) form, the oracle. Same layouts as above; R in {float, double}.
template <typename R>
void delta_rule_recurrent_forward(const DeltaRuleShape& s, const R* q, const R* k, const R* v, const R* beta,
                                  const R* g, R* o);
// Accumulates (+=) into every gradient. Keeps every token's state of one head (T x dk x dv): a test oracle.
template <typename R>
void delta_rule_recurrent_backward(const DeltaRuleShape& s, const R* q, const R* k, const R* v, const R* beta,
                                   const R* g, const R* d_o, R* dq, R* dk, R* dv, R* dbeta, R* dg);

}  // namespace reference
}  // namespace hs::kernels
