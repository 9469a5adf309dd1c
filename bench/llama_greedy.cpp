// The llama.cpp side of bench/generate_bench.sh's sanity check that both engines run the same model: greedy
// generation from a prompt given as token ids (no tokenizer in the way), printing the new ids as one JSON line.
//   llama_greedy MODEL.gguf N_NEW THREADS ID,ID,...
// Built by generate_bench.sh against the llama.cpp it builds (the API of the vendored examples/simple/simple.cpp of
// llama-cpp-python 0.3.36: llama_batch_ext, llama_process); not part of hybridscan's build. End-of-generation ids
// do not stop it, as hybridscan's --ignore-eos.
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

static void set_tokens(llama_batch_ext* batch, const std::vector<llama_token>& ids, llama_pos pos0) {
  llama_batch_ext_clear(batch);
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t idx = llama_batch_ext_add_token(batch, 0, ids[i]);
    const llama_pos pos = pos0 + static_cast<llama_pos>(i);
    llama_batch_ext_set_pos(batch, idx, &pos);
  }
  llama_batch_ext_set_output_logits(batch, static_cast<int32_t>(ids.size()) - 1, true);
}

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s MODEL.gguf N_NEW THREADS ID,ID,...\n", argv[0]);
    return 2;
  }
  const int n_new = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  std::vector<llama_token> prompt;
  std::stringstream in(argv[4]);
  for (std::string item; std::getline(in, item, ',');) prompt.push_back(std::atoi(item.c_str()));
  if (prompt.empty() || n_new < 1) {
    std::fprintf(stderr, "llama_greedy: need a prompt and N_NEW >= 1\n");
    return 2;
  }
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) {
    std::fprintf(stderr, "llama_greedy: cannot load %s\n", argv[1]);
    return 1;
  }
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(prompt.size() + n_new + 1);
  cp.n_batch = static_cast<uint32_t>(prompt.size());
  cp.n_threads = cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) {
    std::fprintf(stderr, "llama_greedy: cannot make a context\n");
    return 1;
  }
  llama_sampler* smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
  llama_sampler_chain_add(smpl, llama_sampler_init_greedy());
  llama_batch_ext* batch = llama_batch_ext_init(ctx);
  set_tokens(batch, prompt, 0);
  llama_pos pos = static_cast<llama_pos>(prompt.size());
  std::string out = "{\"tokens\": [";
  for (int i = 0; i < n_new; ++i) {
    if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) {
      std::fprintf(stderr, "llama_greedy: decode failed\n");
      return 1;
    }
    const llama_token id = llama_sampler_sample(smpl, ctx, -1);
    out += (i ? ", " : "") + std::to_string(id);
    set_tokens(batch, {id}, pos++);
  }
  std::printf("%s]}\n", out.c_str());
  llama_batch_ext_free(batch);
  llama_sampler_free(smpl);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
