#include "cli/speculative_options.h"

#include <stdexcept>

#include "infer/speculative.h"

namespace hs::cli {

void add_speculative_options(CLI::App* c, SpeculativeArgs& a) {
  c->add_option("--speculative", a.speculative,
                "Speculative decoding: mtp (draft with the checkpoint's multi-token-prediction layer, verify the "
                "drafts with the model in one step; greedy output is plain decoding's, sampled output follows the "
                "model's distribution)");
  c->add_option("--draft", a.draft, "With --speculative: tokens drafted per step, 1 to 3 (default 1)");
}

int64_t speculative_draft(const SpeculativeArgs& a) {
  if (!a.speculative.empty() && a.speculative != "mtp")
    throw std::invalid_argument("--speculative '" + a.speculative + "' is not known (known: mtp, the checkpoint's "
                                "multi-token-prediction layer as the draft model)");
  if (a.speculative.empty() && a.draft != -1) throw std::invalid_argument("--draft needs --speculative mtp");
  const int64_t draft = a.speculative.empty() ? 0 : a.draft == -1 ? 1 : a.draft;
  if (!a.speculative.empty() && (draft < 1 || draft > infer::kMaxDraft))
    throw std::invalid_argument("--draft must be in [1, " + std::to_string(infer::kMaxDraft) + "] (got " +
                                std::to_string(draft) + ")");
  return draft;
}

}  // namespace hs::cli
