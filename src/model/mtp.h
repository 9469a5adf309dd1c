// The multi-token-prediction layer's own arithmetic (docs/model.md, "Multi-token prediction"): the inputs of depth 1
// (the next token's id and the token after it as the target) and the projection in front of its decoder layer,
//     m = fc([pre_fc_norm_embedding(embed(x_{t+1})) ; pre_fc_norm_hidden(h_t)]),
// forward and backward. The decoder layer after it is model::layer_forward / layer_backward on the MTP slot (a
// full-attention layer), its head the decoder's final-norm + LM-head code with mtp.norm: train/schedule.cpp runs
// the whole layer in Runner::mtp.
#pragma once
#include <cstdint>

#include "core/memory.h"

namespace hs::model {

// Depth-1 inputs of a batch of [batch, seq] inputs and targets (targets[t] = x_{t+1}, < 0 ignored): next_ids[t] =
// x_{t+1} (inputs[t+1]; at the last position the target, or 0 when that is ignored) and mtp_targets[t] = x_{t+2}
// (targets[t+1]; -1 at the last position, whose token after next is outside the sequence, and where targets[t] is
// ignored: the end of a packed document, whose token after next is another document's). Returns the number of
// counted MTP targets (>= 0).
int64_t mtp_shift(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq, int32_t* next_ids,
                  int32_t* mtp_targets);

// What the projection keeps for its backward (MemCategory::Workspace: it lives only while the MTP layer runs).
struct MtpInputSaved {
  Buffer cat;             // [N, 2H] in T: [norm(e) ; norm(h)]
  Buffer rstd_e, rstd_h;  // [N] fp32
};

// m [N, H] = cat fc^T with fc [H, 2H] in T; w_e, w_h the zero-centred norm weights [H] (fp32). Planning mode (mem
// planning): shapes only.
template <typename T>
void mtp_input_forward(MemoryAccountant& mem, const T* e, const T* h, const float* w_e, const float* w_h, const T* fc,
                       T* m, int64_t N, int64_t H, float eps, MtpInputSaved& saved);
// From dm [N, H] (fp32): de [N, H] written (the next tokens' embedding gradient), dh [N, H] accumulated (+=, the
// decoder's last hidden state), dw_e, dw_h [H] and dfc [H, 2H] accumulated (fp32).
template <typename T>
void mtp_input_backward(MemoryAccountant& mem, const T* e, const T* h, const float* w_e, const float* w_h, const T* fc,
                        const MtpInputSaved& saved, const float* dm, float* de, float* dh, float* dw_e, float* dw_h,
                        float* dfc, int64_t N, int64_t H);

}  // namespace hs::model
