// hybridscan's side of bench/gguf_logits.sh: the logits of every position of a prompt given as token ids, for a GGUF
// file imported as `generate` imports it (src/gguf: dequantized at load) and run through the full-sequence forward
// in fp32, as one JSON line {"vocab": V, "logits": [[...], ...]}.
//   gguf_logits MODEL.gguf ID,ID,...
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/convert.h"
#include "gguf/import.h"
#include "model/params.h"
#include "train/schedule.h"

int main(int argc, char** argv) {
  using namespace hs;
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s MODEL.gguf ID,ID,...\n", argv[0]);
    return 2;
  }
  std::vector<int32_t> ids;
  std::stringstream in(argv[2]);
  for (std::string item; std::getline(in, item, ',');) ids.push_back(std::atoi(item.c_str()));
  try {
    const gguf::CheckpointPath source(argv[1]);
    const checkpoint::CheckpointDir d = checkpoint::open_checkpoint_dir(source.path());
    MemoryAccountant mem;
    model::ParamSet ps(d.config, DType::F32, mem, MemCategory::Parameters, false);
    checkpoint::load_parameters(d, ps);
    const int64_t T = static_cast<int64_t>(ids.size()), V = d.config.vocab;
    std::vector<int32_t> targets(ids.size(), -1);
    std::vector<float> logits(static_cast<size_t>(T * V));
    train::forward_only(ps, train::Batch{ids.data(), targets.data(), 1, T}, DType::F32, mem, logits.data());
    std::printf("{\"vocab\": %lld, \"logits\": [", static_cast<long long>(V));
    for (int64_t t = 0; t < T; ++t) {
      std::printf("%s[", t ? ", " : "");
      for (int64_t v = 0; v < V; ++v) std::printf("%s%.9g", v ? ", " : "", logits[static_cast<size_t>(t * V + v)]);
      std::printf("]");
    }
    std::printf("]}\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gguf_logits: %s\n", e.what());
    return 1;
  }
  return 0;
}
