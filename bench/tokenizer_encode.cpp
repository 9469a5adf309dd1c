// Times hybridscan's encoder on a text file, loading excluded: the hybridscan side of bench/tokenizer_bench.sh.
//   tokenizer_encode TOKENIZER TEXT_FILE REPS THREADS...
// For each thread count, one untimed warm-up and then the best of REPS timed encodes of the whole file
// (encode() on 1 thread, encode_parallel() on more); prints one JSON line per thread count.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s TOKENIZER TEXT_FILE REPS THREADS...\n", argv[0]);
    return 2;
  }
  try {
    const auto tok = hs::tokenizer::Tokenizer::load(argv[1]);
    std::ifstream in(argv[2], std::ios::binary);
    if (!in) throw std::runtime_error(std::string("cannot read ") + argv[2]);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const int reps = std::atoi(argv[3]);
    for (int a = 4; a < argc; ++a) {
      const int threads = std::atoi(argv[a]);
      const auto run = [&] { return threads <= 1 ? tok.encode(text) : tok.encode_parallel(text, threads); };
      size_t tokens = run().size();
      double best = 1e30;
      for (int r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        tokens = run().size();
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::printf("{\"engine\": \"hybridscan\", \"threads\": %d, \"bytes\": %zu, \"tokens\": %zu, \"seconds\": %.6f}\n",
                  threads, text.size(), tokens, best);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenizer_encode: %s\n", e.what());
    return 1;
  }
  return 0;
}
