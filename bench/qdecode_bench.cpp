// Decode (and prefill) tokens/s of a GGUF model run from its quantized blocks (infer::load_gguf_weights + the fused step on
// quant_gemv), at batch 1, for bench/qdecode_bench.sh (which runs llama-bench on the same file beside it).
//   qdecode_bench make-small q8_0|q4_k OUT.gguf   a random `small` model (seed 7) exported as GGUF of that type
//   qdecode_bench run FILE.gguf NEW [DEPTH [BATCH]] BATCH sequences (default 1) of DEPTH prompt tokens (default 1),
//                                                  then NEW timed decode steps of all of them; prints one JSON line:
//                                                  tokens/s (all sequences), the quantized blocks used in place, the
//                                                  bytes copied (fp32 conversions + V-head-reordered quantized rows),
//                                                  the model bytes a batch-1 step reads (bytes_read_per_token)
//   qdecode_bench prefill FILE.gguf N [MODE [BATCH]] the prefill of BATCH (default 1) N-token prompts, one after
//                                                  another (after one untimed warm-up prefill; tokens/s of all),
//                                                  MODE chunked (default: in pieces through quant_matmul's
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
#include <set>
#include <string>
#include <vector>

#include "checkpoint/convert.h"
#include "gguf/export.h"
#include "infer/decoder.h"
#include "infer/weights.h"
#include "kernels/quant_gemv.h"
#include "model/params.h"

using namespace hs;

// The model bytes a batch-1 decode step reads: every quantized matrix whole, except the routed experts' stacks
// ("*_exps": top_k of their experts' rows), the embedding's one row, and every parameter held in memory as fp32
// (norms, the router, matrices the file stores unquantized). copied_bytes holds those fp32 tensors and also the
// quantized rows copied into native order (Qwen3.5's V heads): the quantized matrices not among the file's mapped
// blocks (quant->bytes) are those copies, counted once, with the matrices. The decode's bandwidth bound is the
// machine's read bandwidth over this.
double bytes_read_per_token(const infer::InferenceWeights& w) {
  const model::ModelConfig& c = w.params->config();
  std::set<const uint8_t*> seen;  // a tied head shares the embedding's blocks
  double all_quantized = 0, read = 0;
  auto add = [&](const infer::QuantMatrix& m, double share) {
    if (!seen.insert(m.data).second) return;
    const double bytes = double(m.rows) * double(m.row_bytes);
    all_quantized += bytes;
    read += bytes * share;
  };
  for (const infer::QuantLayer& l : w.quant->layers)
    for (const auto& part : l.parts)
      for (const infer::QuantMatrix& m : part)
        add(m, m.name.find("_exps") != std::string::npos && c.experts > 0 ? double(c.top_k) / double(c.experts) : 1.0);
  if (w.quant->lm_head) add(*w.quant->lm_head, 1.0);
  if (w.quant->embed) {
    const infer::QuantMatrix& e = *w.quant->embed;
    add(e, double(e.row_bytes) / (double(e.rows) * double(e.row_bytes)));  // one row (unless it is the tied head)
  }
  const double copied_quantized = all_quantized - double(w.quant->bytes);
  return read + double(w.copied_bytes) - copied_quantized;
}

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
  if (cmd == "run" && argc >= 4 && argc <= 6) {
    const int64_t n_new = std::atoll(argv[3]), depth = argc >= 5 ? std::atoll(argv[4]) : 1,
                  batch = argc == 6 ? std::atoll(argv[5]) : 1;
    if (n_new <= 0 || depth <= 0 || batch <= 0) {
      std::fprintf(stderr, "qdecode_bench run: NEW, DEPTH and BATCH must be positive\n");
      return 2;
    }
    MemoryAccountant mem;
    auto w = infer::load_gguf_weights(argv[2], mem);
    const model::ModelConfig& c = w->params->config();
    for (const std::string& n : w->notes) std::fprintf(stderr, "note: %s\n", n.c_str());
    infer::Decoder dec(*w->params, DType::F32, batch, depth + n_new + 1, mem, 512, w->quant.get());
    std::vector<float> logits(static_cast<size_t>(c.vocab * batch));
    std::vector<int32_t> prompt(static_cast<size_t>(depth));
    for (int64_t i = 0; i < depth; ++i) prompt[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + 1) % c.vocab);
    std::vector<int32_t> slots(static_cast<size_t>(batch)), ids(static_cast<size_t>(batch), 1);
    for (int64_t b = 0; b < batch; ++b) {
      slots[static_cast<size_t>(b)] = static_cast<int32_t>(b);
      dec.prefill(b, prompt, logits.data());
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n_new; ++i) {
      dec.step(slots, ids, logits.data());
      for (int64_t b = 0; b < batch; ++b)  // fixed ids (the speed does not depend on them), different per sequence
        ids[static_cast<size_t>(b)] = static_cast<int32_t>((ids[static_cast<size_t>(b)] * 31 + 7 + b) % c.vocab);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("{\"file\": \"%s\", \"threads\": %d, \"new\": %lld, \"depth\": %lld, \"batch\": %lld, "
                "\"decode_tokens_per_s\": %.3f, \"quantized_bytes\": %llu, \"copied_bytes\": %llu, "
                "\"bytes_read_per_token\": %.0f}\n",
                std::filesystem::path(argv[2]).filename().c_str(), omp_get_max_threads(), static_cast<long long>(n_new),
                static_cast<long long>(depth), static_cast<long long>(batch), double(n_new * batch) / s,
                static_cast<unsigned long long>(w->quant->bytes), static_cast<unsigned long long>(w->copied_bytes),
                bytes_read_per_token(*w));
    return 0;
  }
  if (cmd == "prefill" && argc >= 4 && argc <= 6) {
    const int64_t n = std::atoll(argv[3]), batch = argc == 6 ? std::atoll(argv[5]) : 1;
    const std::string mode = argc >= 5 ? argv[4] : "chunked";
    if (n <= 0 || batch <= 0 || (mode != "chunked" && mode != "int8" && mode != "dequantized" && mode != "bf16" && mode != "tokens")) {
      std::fprintf(stderr, "qdecode_bench prefill: N > 0, chunked|int8|dequantized|bf16|tokens, BATCH > 0\n");
      return 2;
    }
    MemoryAccountant mem;
    auto w = infer::load_gguf_weights(argv[2], mem);
    const model::ModelConfig& c = w->params->config();
    infer::Decoder dec(*w->params, DType::F32, batch, n, mem, 512, w->quant.get());
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
    for (int64_t b = 0; b < batch; ++b) dec.prefill(b, prompt, logits.data());  // BATCH prompts, one after another
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("{\"file\": \"%s\", \"threads\": %d, \"prompt\": %lld, \"batch\": %lld, \"mode\": \"%s\", "
                "\"prefill_tokens_per_s\": %.3f}\n",
                std::filesystem::path(argv[2]).filename().c_str(), omp_get_max_threads(), static_cast<long long>(n),
                static_cast<long long>(batch), mode.c_str(), double(n * batch) / s);
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
  std::fprintf(stderr, "usage: qdecode_bench make-small q8_0|q4_k OUT.gguf | run FILE.gguf NEW [DEPTH [BATCH]] | "
                       "prefill FILE.gguf N [chunked|int8|dequantized|bf16|tokens [BATCH]] | matmul q8_0|q4_k M N K WAY REPS\n");
  return 2;
}
