// The llama.cpp side of bench/speculative_llama_bench.sh: greedy decoding of prompts given as token ids, plainly or
// with llama.cpp's own speculative decoding (--spec-type draft-mtp: the MTP / nextn block inside the same GGUF),
// one JSON line per prompt with the new ids, the decode time and the draft counts.
//
//   llama_mtp_spec PROMPTS N_NEW LLAMA_ARGS...
//
//   PROMPTS     a file of prompts, one a line, each a comma-separated list of token ids
//   N_NEW       new tokens per prompt (end-of-generation ids do not stop it, as hybridscan's --ignore-eos)
//   LLAMA_ARGS  llama.cpp's own flags, parsed by its common_params_parse as examples/speculative-simple parses them:
//               -m FILE.gguf -t 2 -tb 2 -c 512 --temp 0 [--spec-type draft-mtp --spec-draft-n-max N]
//
// The speculative loop is examples/speculative-simple/speculative-simple.cpp of llama-cpp-python 0.3.36's vendored
// llama.cpp, step for step (draft, verify [id_last, drafts] in one llama_process, common_sampler_sample_and_accept_n,
// on a partial acceptance restore the checkpoint and replay the kept tokens when the context cannot drop positions,
// as a recurrent one cannot), with three changes: the prompt is ids, not text; every prompt starts from cleared
// memory and a new speculator; and the draft counts are our own: speculative-simple counts the replayed kept tokens
// of a partial acceptance as drafted and accepted, so its "accept" overstates the MTP layer's acceptance; here
// only the drafts the MTP layer proposed count (per position, as hybridscan's accepted_rate). The plain loop feeds
// the prompt but its last token, then one token a step, with the same sampler (greedy at --temp 0), so both loops
// time the same thing: N_NEW tokens from the moment the last prompt token is fed.
//
// Built by speculative_llama_bench.sh against a llama.cpp build tree (libllama, libllama-common); not part of
// hybridscan's build.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "arg.h"
#include "common.h"
#include "llama.h"
#include "log.h"
#include "sampling.h"
#include "speculative.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Result {
  std::vector<llama_token> tokens;
  double decode_s = 0;
  int steps = 0;                       // target llama_process calls while decoding (replays included)
  int replays = 0;                     // partial acceptances that restored the checkpoint
  int drafted = 0, accepted = 0;       // MTP drafts proposed / kept (fresh drafts only)
  std::vector<int> pos_drafted, pos_accepted;  // per draft position
  bool ok = true;
  std::string error;
};

bool process(llama_context* ctx, common_batch& batch) {
  return llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch.get()) == 0;
}

Result decode_plain(common_params& params, llama_context* ctx, const std::vector<llama_token>& inp, int n_new) {
  Result r;
  common_sampler_ptr smpl(common_sampler_init(llama_get_model(ctx), params.sampling));
  common_batch batch(ctx);
  for (size_t i = 0; i + 1 < inp.size(); ++i) batch.add(inp[i], (llama_pos)i, 0, false);
  if (batch.size() > 0 && !process(ctx, batch)) return {.ok = false, .error = "prefill failed"};
  llama_token id_last = inp.back();
  llama_pos n_past = (llama_pos)inp.size() - 1;
  const double t0 = now_s();
  while ((int)r.tokens.size() < n_new) {
    batch.clear();
    batch.add(id_last, n_past++, 0, true);
    if (!process(ctx, batch)) return {.ok = false, .error = "decode failed"};
    ++r.steps;
    id_last = common_sampler_sample(smpl.get(), ctx, 0);
    common_sampler_accept(smpl.get(), id_last, true);
    r.tokens.push_back(id_last);
  }
  r.decode_s = now_s() - t0;
  return r;
}

Result decode_spec(common_params& params, llama_context* ctx_tgt, llama_context* ctx_dft,
                   const std::vector<llama_token>& inp, int n_new) {
  Result r;
  const llama_seq_id seq_id = 0;
  const bool use_ckpt_tgt = common_context_can_seq_rm(ctx_tgt) == COMMON_CONTEXT_SEQ_RM_TYPE_FULL;
  const bool use_ckpt_dft = common_context_can_seq_rm(ctx_dft) == COMMON_CONTEXT_SEQ_RM_TYPE_FULL;
  common_sampler_ptr smpl(common_sampler_init(llama_get_model(ctx_tgt), params.sampling));
  common_speculative* spec = common_speculative_init(params.speculative, 1);
  if (!spec) return {.ok = false, .error = "common_speculative_init returned null (failed to initialize speculative decoding)"};
  {
    common_batch batch_prompt(ctx_tgt);
    for (size_t i = 0; i + 1 < inp.size(); ++i) batch_prompt.add(inp[i], (llama_pos)i, seq_id, false);
    if (batch_prompt.size() > 0) {
      if (!process(ctx_tgt, batch_prompt)) return {.ok = false, .error = "prefill failed"};
      if (!common_speculative_process(spec, batch_prompt)) return {.ok = false, .error = "common_speculative_process failed on the prompt"};
    }
  }
  llama_token id_last = inp.back();
  llama_tokens prompt_tgt(inp.begin(), inp.end() - 1);
  int n_past = (int)inp.size() - 1;
  common_speculative_begin(spec, seq_id, prompt_tgt);
  common_batch batch_tgt(ctx_tgt);
  llama_tokens draft;
  common_prompt_checkpoint ckpt;
  int n_predict = 0;
  const double t0 = now_s();
  while (true) {
    const bool fresh = draft.empty();
    if (fresh) {
      ckpt.update_pos(prompt_tgt.size(), llama_memory_seq_pos_min(llama_get_memory(ctx_tgt), seq_id),
                      llama_memory_seq_pos_max(llama_get_memory(ctx_tgt), seq_id));
      if (use_ckpt_dft) ckpt.update_dft(ctx_dft, seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
      int n_draft_max = (int)llama_n_ctx(ctx_tgt) - n_past - 2;
      n_draft_max = std::max(std::min(n_draft_max, n_new - n_predict - 1), 0);
      common_speculative_get_draft_params(spec, seq_id) = {
          /* .drafting = */ true, /* .n_max = */ n_draft_max, /* .pos0 = */ n_past,
          /* .id_last = */ id_last, /* .prompt = */ &prompt_tgt, /* .result = */ &draft};
      common_speculative_draft(spec);
      if (!draft.empty() && use_ckpt_tgt) ckpt.update_tgt(ctx_tgt, seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
      if (use_ckpt_dft) ckpt.load_dft(ctx_dft, seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
      llama_memory_seq_rm(llama_get_memory(ctx_dft), seq_id, ckpt.pos_max + 1, -1);
    }
    batch_tgt.clear();
    batch_tgt.add(id_last, n_past++, seq_id, true);
    for (size_t i = 0; i < draft.size(); ++i) batch_tgt.add(draft[i], n_past + (int)i, seq_id, true);
    if (!process(ctx_tgt, batch_tgt)) { r.ok = false; r.error = "verify decode failed"; break; }
    ++r.steps;
    if (!common_speculative_process(spec, batch_tgt)) { r.ok = false; r.error = "common_speculative_process failed"; break; }
    common_sampler_ptr smpl_save;
    if (use_ckpt_tgt) smpl_save.reset(common_sampler_clone(smpl.get()));
    const size_t n_draft = draft.size();
    auto ids = common_sampler_sample_and_accept_n(smpl.get(), ctx_tgt, draft);
    if (fresh) {
      const size_t kept = ids.size() - 1;
      r.drafted += (int)n_draft;
      r.accepted += (int)kept;
      if (r.pos_drafted.size() < n_draft) { r.pos_drafted.resize(n_draft); r.pos_accepted.resize(n_draft); }
      for (size_t k = 0; k < n_draft; ++k) { r.pos_drafted[k]++; if (k < kept) r.pos_accepted[k]++; }
    }
    if (use_ckpt_tgt && ids.size() - 1 < n_draft) {
      ++r.replays;
      draft = std::move(ids);
      ckpt.load_tgt(ctx_tgt, seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
      llama_memory_seq_rm(llama_get_memory(ctx_tgt), seq_id, ckpt.pos_max + 1, -1);
      ckpt.load_dft(ctx_dft, seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
      llama_memory_seq_rm(llama_get_memory(ctx_dft), seq_id, ckpt.pos_max + 1, -1);
      prompt_tgt.resize(ckpt.n_tokens);
      smpl = std::move(smpl_save);
      n_past = (int)prompt_tgt.size();
      continue;
    }
    common_speculative_accept(spec, seq_id, ids.size() - 1);
    n_past += ids.size() - 1;
    n_predict += ids.size();
    for (size_t i = 0; i < ids.size(); ++i) {
      prompt_tgt.push_back(id_last);
      id_last = ids[i];
      r.tokens.push_back(id_last);
    }
    draft.clear();
    llama_memory_seq_rm(llama_get_memory(ctx_tgt), seq_id, n_past, -1);
    llama_memory_seq_rm(llama_get_memory(ctx_dft), seq_id, n_past, -1);
    if (n_predict >= n_new) break;
  }
  r.decode_s = now_s() - t0;
  common_speculative_print_stats(spec);
  common_speculative_free(spec);
  return r;
}

std::string ints(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s PROMPTS N_NEW -m FILE.gguf [llama.cpp flags, e.g. --spec-type draft-mtp --spec-draft-n-max 2]\n", argv[0]);
    return 2;
  }
  std::vector<std::vector<llama_token>> prompts;
  {
    std::ifstream in(argv[1]);
    if (!in) { std::fprintf(stderr, "llama_mtp_spec: cannot read %s\n", argv[1]); return 2; }
    for (std::string line; std::getline(in, line);) {
      std::vector<llama_token> p;
      std::stringstream ls(line);
      for (std::string item; std::getline(ls, item, ',');) p.push_back(std::atoi(item.c_str()));
      if (!p.empty()) prompts.push_back(p);
    }
  }
  const int n_new = std::atoi(argv[2]);
  if (prompts.empty() || n_new < 1) { std::fprintf(stderr, "llama_mtp_spec: need prompts and N_NEW >= 1\n"); return 2; }
  std::vector<char*> args = {argv[0]};
  for (int i = 3; i < argc; ++i) args.push_back(argv[i]);
  common_params params;
  common_init();
  if (!common_params_parse((int)args.size(), args.data(), params, LLAMA_EXAMPLE_SPECULATIVE)) return 2;
  const bool spec_mtp = params.speculative.need_n_rs_seq() > 0;
  const auto limits = common_speculative_get_output_limits(params.n_batch, params.n_parallel,
                                                           common_speculative_n_max(&params.speculative));
  params.n_outputs_max = limits.total;
  params.n_outputs_max_per_seq = limits.per_seq;
  llama_backend_init();
  auto init_tgt = common_init_from_params(params);
  llama_context* ctx_tgt = init_tgt->context();
  if (!ctx_tgt) { std::fprintf(stderr, "llama_mtp_spec: cannot load the model or make its context\n"); return 1; }
  common_speculative_init_result_ptr spec_init;
  llama_context* ctx_dft = nullptr;
  if (spec_mtp) {
    common_params params_dft = common_base_params_to_speculative(params);
    spec_init = common_speculative_init_from_params(params_dft, init_tgt->model(), ctx_tgt);
    ctx_dft = spec_init->context();
    if (!ctx_dft) { std::fprintf(stderr, "llama_mtp_spec: no MTP draft context (common_speculative_init_from_params)\n"); return 1; }
    params.speculative.draft.ctx_tgt = ctx_tgt;
    params.speculative.draft.ctx_dft = ctx_dft;
  }
  std::fprintf(stderr, "llama_mtp_spec: n_rs_seq target %u, draft %u; seq_rm type target %d, draft %d\n",
               llama_n_rs_seq(ctx_tgt), ctx_dft ? llama_n_rs_seq(ctx_dft) : 0u, (int)common_context_can_seq_rm(ctx_tgt),
               ctx_dft ? (int)common_context_can_seq_rm(ctx_dft) : -1);
  for (const auto& p : prompts) {
    llama_memory_clear(llama_get_memory(ctx_tgt), true);
    if (ctx_dft) llama_memory_clear(llama_get_memory(ctx_dft), true);
    Result r = spec_mtp ? decode_spec(params, ctx_tgt, ctx_dft, p, n_new) : decode_plain(params, ctx_tgt, p, n_new);
    if (!r.ok) { std::fprintf(stderr, "llama_mtp_spec: %s\n", r.error.c_str()); return 1; }
    const int n_gen = (int)r.tokens.size();
    r.tokens.resize(std::min(n_gen, n_new));
    std::string toks;
    for (size_t i = 0; i < r.tokens.size(); ++i) toks += (i ? "," : "") + std::to_string(r.tokens[i]);
    std::printf("{\"mode\": \"%s\", \"draft\": %d, \"prompt_tokens\": %zu, \"generated\": %d, \"decode_s\": %.6f, "
                "\"decode_tokens_per_s\": %.3f, \"steps\": %d, \"replays\": %d, \"drafted\": %d, \"accepted\": %d, "
                "\"pos_drafted\": %s, \"pos_accepted\": %s, \"tokens\": [%s]}\n",
                spec_mtp ? "draft-mtp" : "plain", spec_mtp ? params.speculative.draft.n_max : 0, p.size(), n_gen,
                r.decode_s, n_gen / r.decode_s, r.steps, r.replays, r.drafted, r.accepted, ints(r.pos_drafted).c_str(),
                ints(r.pos_accepted).c_str(), toks.c_str());
    std::fflush(stdout);
  }
  llama_backend_free();
  return 0;
}
