// Decode (and prefill) tokens/s of a GGUF model run from its quantized blocks (infer::load_gguf_weights + the fused step on
// quant_gemv), at batch 1, for bench/qdecode_bench.sh (which runs llama-bench on the same file beside it).
//   qdecode_bench make-small q8_0|q4_k OUT.gguf   a random `small` model (seed 7) exported as GGUF of that type
//   qdecode_bench run FILE.gguf NEW [DEPTH]        DEPTH prompt tokens (default 1) then NEW timed decode steps;
//                                                  prints one JSON line: tokens/s, the quantized blocks used in place,
//                                                  the bytes copied (fp32 conversions + V-head-reordered quantized rows)
//   qdecode_bench prefill FILE.gguf N [MODE]       the prefill of an N-token prompt (after one untimed warm-up
//                                                  prefill), MODE chunked (default: in pieces through quant_matmul's
//                                                  Auto way), int8, dequantized (fp32) or bf16 (DequantizedBf16)
//                                                  forced, or tokens (a fused step per token); one JSON line with
//                                                  its tokens/s
//   qdecode_bench matmul q8_0|q4_k M N K WAY REPS  quant_matmul alone on random fp32 rows, WAY int8|dequantized|bf16|
//                                                  auto; the median GFLOP/s of REPS
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/convert.h"
#include "gguf/export.h"
#include "infer/decoder.h"
#include "infer/weights.h"
#include "kernels/quant_gemv.h"
#include "model/params.h"

using namespace hs;

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "make-small" && argc == 4) {
    MemoryAccountant mem;
    model::ParamSet ps(model::preset("small"), DType::F32, mem, MemCategory::Parameters, false);
    model::init_params(ps, 7);
    checkpoint::TrainingState st;
    st.params = &ps;
    st.state = nlohmann::json::object();
    const std::filesystem::path native = std::string(argv[3]) + ".native";
    checkpoint::save_native(native, st);
    gguf::export_gguf(native, argv[3], gguf::parse_quant_scheme(argv[2]));
    std::filesystem::remove_all(native);
    return 0;
  }
  if (cmd == "run" && (argc == 4 || argc == 5)) {
    const int64_t n_new = std::atoll(argv[3]), depth = argc == 5 ? std::atoll(argv[4]) : 1;
    MemoryAccountant mem;
    auto w = infer::load_gguf_weights(argv[2], mem);
    const model::ModelConfig& c = w->params->config();
    for (const std::string& n : w->notes) std::fprintf(stderr, "note: %s\n", n.c_str());
    infer::Decoder dec(*w->params, DType::F32, 1, depth + n_new + 1, mem, 512, w->quant.get());
    std::vector<float> logits(static_cast<size_t>(c.vocab));
    std::vector<int32_t> prompt(static_cast<size_t>(depth));
    for (int64_t i = 0; i < depth; ++i) prompt[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + 1) % c.vocab);
    dec.prefill(0, prompt, logits.data());
    const int32_t slot = 0;
    int32_t id = 1;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n_new; ++i) {
      dec.step({&slot, 1}, {&id, 1}, logits.data());
      id = static_cast<int32_t>((id * 31 + 7) % c.vocab);  // fixed ids: the speed does not depend on them
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("{\"file\": \"%s\", \"threads\": %d, \"new\": %lld, \"depth\": %lld, \"decode_tokens_per_s\": %.3f, "
                "\"quantized_bytes\": %llu, \"copied_bytes\": %llu}\n",
                std::filesystem::path(argv[2]).filename().c_str(), omp_get_max_threads(), static_cast<long long>(n_new),
                static_cast<long long>(depth), double(n_new) / s, static_cast<unsigned long long>(w->quant->bytes),
                static_cast<unsigned long long>(w->copied_bytes));
    return 0;
  }
  if (cmd == "prefill" && (argc == 4 || argc == 5)) {
    const int64_t n = std::atoll(argv[3]);
    const std::string mode = argc == 5 ? argv[4] : "chunked";
    if (n <= 0 || (mode != "chunked" && mode != "int8" && mode != "dequantized" && mode != "bf16" && mode != "tokens")) {
      std::fprintf(stderr, "qdecode_bench prefill: N > 0 and chunked|int8|dequantized|bf16|tokens\n");
      return 2;
    }
    MemoryAccountant mem;
    auto w = infer::load_gguf_weights(argv[2], mem);
    const model::ModelConfig& c = w->params->config();
    infer::Decoder dec(*w->params, DType::F32, 1, n, mem, 512, w->quant.get());
    if (mode == "tokens") dec.set_quant_prefill(infer::Decoder::QuantPrefill::TokenByToken);
    if (mode == "int8") dec.set_quant_prefill(infer::Decoder::QuantPrefill::Chunked, kernels::QuantMatmul::Int8);
    if (mode == "dequantized")
      dec.set_quant_prefill(infer::Decoder::QuantPrefill::Chunked, kernels::QuantMatmul::Dequantized);
    if (mode == "bf16")
      dec.set_quant_prefill(infer::Decoder::QuantPrefill::Chunked, kernels::QuantMatmul::DequantizedBf16);
    std::vector<float> logits(static_cast<size_t>(c.vocab));
    std::vector<int32_t> prompt(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) prompt[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + 1) % c.vocab);
    dec.prefill(0, prompt, logits.data());  // untimed warm-up (file pages, oneDNN primitives), as llama-bench's
    dec.reset(0);
    const auto t0 = std::chrono::steady_clock::now();
    dec.prefill(0, prompt, logits.data());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("{\"file\": \"%s\", \"threads\": %d, \"prompt\": %lld, \"mode\": \"%s\", "
                "\"prefill_tokens_per_s\": %.3f}\n",
                std::filesystem::path(argv[2]).filename().c_str(), omp_get_max_threads(), static_cast<long long>(n),
                mode.c_str(), double(n) / s);
    return 0;
  }
  if (cmd == "matmul" && argc == 8) {  // quant_matmul alone on random rows: TYPE M N K WAY REPS
    const kernels::GgmlType t = gguf::parse_quant_scheme(argv[2]) == gguf::QuantScheme::Q8_0 ? kernels::GgmlType::Q8_0
                                                                                               : kernels::GgmlType::Q4_K;
    const int64_t M = std::atoll(argv[3]), N = std::atoll(argv[4]), K = std::atoll(argv[5]);
    const std::string way = argv[6];
    const int reps = std::atoi(argv[7]);
    std::vector<float> w(static_cast<size_t>(K)), x(static_cast<size_t>(M * K)), y(static_cast<size_t>(M * N));
    std::vector<uint8_t> W(static_cast<size_t>(N * kernels::ggml_row_bytes(t, K)));
    uint32_t s = 1;
    auto rnd = [&] { s = s * 1664525u + 1013904223u; return float(int32_t(s >> 8) - (1 << 23)) / float(1 << 23); };
    for (int64_t n = 0; n < N; ++n) {
      for (float& v : w) v = rnd();
      kernels::quantize_row(t, w.data(), W.data() + n * kernels::ggml_row_bytes(t, K), K);
    }
    for (float& v : x) v = rnd();
    const kernels::QuantMatmul how = way == "int8"          ? kernels::QuantMatmul::Int8
                                     : way == "dequantized" ? kernels::QuantMatmul::Dequantized
                                     : way == "bf16"        ? kernels::QuantMatmul::DequantizedBf16
                                                            : kernels::QuantMatmul::Auto;
    kernels::quant_matmul(t, x.data(), W.data(), y.data(), M, N, K, 0, 0, how);  // warm-up
    std::vector<double> g;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      kernels::quant_matmul(t, x.data(), W.data(), y.data(), M, N, K, 0, 0, how);
      g.push_back(2.0 * M * N * K / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9);
    }
    std::sort(g.begin(), g.end());
    std::printf("{\"type\": \"%s\", \"M\": %lld, \"N\": %lld, \"K\": %lld, \"way\": \"%s\", \"gflops_median\": %.1f}\n",
                argv[2], (long long)M, (long long)N, (long long)K, way.c_str(), g[g.size() / 2]);
    return 0;
  }
  std::fprintf(stderr, "usage: qdecode_bench make-small q8_0|q4_k OUT.gguf | run FILE.gguf NEW [DEPTH] | "
                       "prefill FILE.gguf N [chunked|int8|dequantized|bf16|tokens]\n");
  return 2;
}
