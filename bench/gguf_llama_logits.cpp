// The llama.cpp side of bench/gguf_logits.sh: the logits of every position of a prompt given as token ids, from one
// forward pass of libllama over a GGUF file, as one JSON line {"vocab": V, "logits": [[...], ...]}.
//   gguf_llama_logits MODEL.gguf THREADS ID,ID,...
// Built by gguf_logits.sh against the llama.cpp build it is given (the API of llama-cpp-python 0.3.36's vendored
// tree: llama_batch_ext, llama_process, as bench/llama_greedy.cpp); not part of hybridscan's build.
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s MODEL.gguf THREADS ID,ID,...\n", argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[2]);
  std::vector<llama_token> prompt;
  std::stringstream in(argv[3]);
  for (std::string item; std::getline(in, item, ',');) prompt.push_back(std::atoi(item.c_str()));
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) {
    std::fprintf(stderr, "gguf_llama_logits: llama.cpp cannot load %s\n", argv[1]);
    return 1;
  }
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(prompt.size() + 1);
  cp.n_batch = cp.n_ubatch = static_cast<uint32_t>(prompt.size());
  cp.n_threads = cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) {
    std::fprintf(stderr, "gguf_llama_logits: cannot make a context\n");
    return 1;
  }
  llama_batch_ext* batch = llama_batch_ext_init(ctx);
  for (size_t i = 0; i < prompt.size(); ++i) {
    const int32_t idx = llama_batch_ext_add_token(batch, 0, prompt[i]);
    const llama_pos pos = static_cast<llama_pos>(i);
    llama_batch_ext_set_pos(batch, idx, &pos);
    llama_batch_ext_set_output_logits(batch, idx, true);
  }
  if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) {
    std::fprintf(stderr, "gguf_llama_logits: decode failed\n");
    return 1;
  }
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  std::printf("{\"vocab\": %d, \"logits\": [", vocab);
  for (size_t i = 0; i < prompt.size(); ++i) {
    const float* l = llama_get_logits_ith(ctx, static_cast<int32_t>(i));
    std::printf("%s[", i ? ", " : "");
    for (int v = 0; v < vocab; ++v) std::printf("%s%.9g", v ? ", " : "", l[v]);
    std::printf("]");
  }
  std::printf("]}\n");
  llama_batch_ext_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
