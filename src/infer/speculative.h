// Speculative decoding with the checkpoint's multi-token-prediction layer (docs/model.md, "Speculative decoding";
// `generate --speculative mtp --draft N`). Each step drafts N tokens with the MTP layer (depth 1, reused
// autoregressively on its own output), verifies the N + 1 positions [last token, drafts] with the target model in
// one fused step (Decoder::verify: every position computed exactly as a plain decode step computes it), keeps the
// longest agreeing prefix and the target's next token, and rolls the recurrent part back to the last kept position
// (the conv window and delta-rule state after each verified position are kept in slots of their own, so the
// roll-back is one copy; Decoder::accept). The keys and values past it are overwritten later.
//
// Greedy output is plain decoding's, token for token; sampled output follows the standard rejection rule (a draft d
// drawn from q is kept with probability min(1, p(d) / q(d)), else the token is drawn from norm(max(0, p - q))), so
// its distribution is the target model's p (p and q: the distributions Sampling defines over the logits).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "core/memory.h"
#include "infer/decoder.h"
#include "infer/generate.h"
#include "model/params.h"

namespace hs::infer {

inline constexpr int64_t kMaxDraft = 3;

// The MTP layer as a draft model: its own keys and values per slot, run from the decoder's hidden state h_t
// (the final norm's output) and the next token x_{t+1}: m = fc([norm(embed(x_{t+1})); norm(h_t)]), one full-attention
// decoder layer at position t, mtp.norm, the shared LM head. Throws std::invalid_argument when the checkpoint has
// no MTP layer or its weights are not stored in the compute dtype (the steps run fused).
class MtpDrafter {
 public:
  MtpDrafter(const model::ParamSet& params, DType compute, int64_t slots, int64_t capacity, MemoryAccountant& mem,
             int64_t piece = 512);
  ~MtpDrafter();
  // Positions [start, start + n) of a slot filled to `start`: h [n, H] (compute dtype) and next_ids [n]; with head,
  // logits [V] and the layer's normed output (mtp.norm's, what a further draft reads as h) [H] of the last position (hidden_last optional). A prompt fed
  // in pieces of at most `piece` positions (head on the last) has the bits of one call.
  void prefill(int64_t slot, int64_t start, const void* h, const int32_t* next_ids, int64_t n, float* logits,
               void* hidden_last, bool head = true);
  // R rows (several may be consecutive positions of one slot, in order): logits [R, V], hidden [R, H] (optional).
  void step(int64_t R, const int32_t* slots, const int32_t* positions, const void* h, const int32_t* next_ids,
            float* logits, void* hidden);
  size_t kv_cache_bytes() const;
  // Snapshots of a slot's keys and values, for the server's prefix cache (serve --speculative mtp): positions
  // [from, to) to / from out (kv_bytes_per_position() bytes per position), laid out as Decoder::save_kv's.
  size_t kv_bytes_per_position() const;
  void save_kv(int64_t slot, int64_t from, int64_t to, void* out) const;
  void load_kv(int64_t slot, int64_t from, int64_t to, const void* in);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The distribution sample_token draws from (temperature > 0): probs [V], zero outside the top-k / top-p set.
void sampling_probs(const float* logits, int64_t vocab, const Sampling& s, std::vector<double>& probs);

// One id drawn from weights w (not necessarily normalized; zero weights are never drawn): how a draft is drawn from
// its distribution q.
int32_t draw(const std::vector<double>& w, std::mt19937_64& rng);

// The rejection rule of one verification. p: n + 1 target distributions [n + 1][V] (rows 0..n), q: n draft
// distributions, drafts: n ids (drafts[j] drawn from q[j]). Appends to out the accepted drafts and one more token
// (the residual draw at the first rejection, or a draw from p[n] when all are accepted); returns the number of
// accepted drafts. resample_residual false draws the replacement from p instead of the residual (wrong: a test
// checks that it shows).
int64_t speculative_accept(const std::vector<std::vector<double>>& p, const std::vector<std::vector<double>>& q,
                           const int32_t* drafts, int64_t n, std::mt19937_64& rng, std::vector<int32_t>& out,
                           bool resample_residual = true);

// What one verification keeps, greedy or sampled, as plain decoding would choose: rows, the target's logits of the
// N + 1 verified positions [N + 1, V]; drafts, the N drafted ids. Greedy (temperature 0): the longest prefix of drafts
// equal to the target's argmax, then the target's token at the first disagreement (or after the last draft).
// Sampled: speculative_accept over the target's distributions (computed into p) and the drafts' q. emitted is cleared
// and gets the kept drafts and one more token; returns the number of kept drafts. Shared by generate_speculative and
// the server's step.
int64_t accept_drafts(const float* rows, int64_t vocab, const int32_t* drafts, int64_t n, const Sampling& s,
                      std::mt19937_64& rng, const std::vector<std::vector<double>>& q,
                      std::vector<std::vector<double>>& p, std::vector<std::pair<float, int32_t>>& scratch,
                      std::vector<int32_t>& emitted);

// What a speculative run holds from start to end, allocated (in this order) by generate_speculative and, over
// shapes, by speculative_over_shapes (the planner's): the decoder with `draft` more recurrent-state slots per
// sequence, the MTP drafter (its keys and values, its weight casts, its fused step), the logits and hidden rows of
// batch * (draft + 1) rows for the target and the MTP layer, the MTP layer's input rows, and the last layer's output of
// one prefill piece (the prompt goes through the decoder and the MTP layer a piece at a time).
struct SpeculativeRun {
  SpeculativeRun(const model::ParamSet& params, DType compute, int64_t batch, int64_t capacity, int64_t draft,
                 int64_t piece, int64_t longest, MemoryAccountant& mem);
  // Prefills prompt p into slot `slot` of both models, piece by piece. first(logits [V] of the prompt's last
  // position, id) picks the first new token and says whether the sequence goes on; if it does not, the MTP layer
  // skips the last piece. Returns what first returned. The MTP logits / output of the last position go to row
  // `slot` of mlogits / mhidden.
  bool prefill(int64_t slot, std::span<const int32_t> p, const std::function<bool(const float*, int32_t&)>& first);

  int64_t draft, piece;
  size_t hidden_row_bytes;
  Decoder dec;
  MtpDrafter mtp;
  Buffer logits, mlogits, hidden, mhidden, mh_in, phid;
};

// generate_speculative over shapes (mem in planning mode, holding the weights): a SpeculativeRun for `batch` prompts
// of `prompt` tokens (at most context - 1) and `context` positions (prompt + new tokens, as generate's), the prefill
// of every prompt, then the widest decode step: draft - 1 MTP steps of every sequence, the verification of draft + 1
// positions each, and the MTP layer's catch-up on all of them (every draft kept: the most rows a step can have).
struct SpeculativeShapes {
  size_t kv_cache = 0, recurrent_state = 0, mtp_kv_cache = 0;
};
SpeculativeShapes speculative_over_shapes(const model::ParamSet& params, DType compute, int64_t batch, int64_t context,
                                          int64_t prompt, int64_t draft, int64_t piece, MemoryAccountant& mem);

struct SpeculativeStats {
  int64_t draft = 0;
  int64_t steps = 0;                   // verifications (one per sequence and step)
  std::vector<int64_t> accepted;       // per draft position k (0-based): steps whose drafts 1..k+1 were all kept
  int64_t emitted = 0;                 // tokens taken from verifications
  double draft_seconds = 0, verify_seconds = 0;
};

// generate() (generate.h) with speculative decoding at depth `draft` (1 to kMaxDraft). Throws std::invalid_argument
// for a draft outside that range, a checkpoint without an MTP layer, quantized weights, weights the fused step
// cannot run, and what generate() refuses.
GenerateResult generate_speculative(const model::ParamSet& params, const std::vector<std::vector<int32_t>>& prompts,
                                    const GenerateOptions& opt, int64_t draft, MemoryAccountant& mem,
                                    const std::function<bool(size_t, int32_t)>& on_token = {},
                                    SpeculativeStats* stats = nullptr);

}  // namespace hs::infer
