// ggml's side of bench/quant_gemv_bench.cpp: one mul_mat of a quantized weight [N, K] by M fp32 rows on ggml's CPU
// backend, as llama.cpp runs it (its threads, its activation quantization, and with `repack` the weights in the CPU
// backend's extra buffer type, which repacks Q4_0 / Q4_K / ... into interleaved rows at load as llama.cpp does by
// default). Built as a shared library by bench/quant_gemv_bench.sh against the llama.cpp it is pointed at; not part
// of hybridscan's build.
#include <cstdio>
#include <cstring>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

struct QPeer {
  ggml_backend_t backend = nullptr;
  ggml_context* ctx_w = nullptr;
  ggml_context* ctx = nullptr;
  ggml_backend_buffer_t buf_w = nullptr, buf = nullptr;
  ggml_tensor *w = nullptr, *x = nullptr, *y = nullptr;
  ggml_cgraph* graph = nullptr;
  std::vector<float> out;
  char buffer_name[64] = {};
};

extern "C" {

void qpeer_free(QPeer* p) {
  if (!p) return;
  if (p->buf) ggml_backend_buffer_free(p->buf);
  if (p->buf_w) ggml_backend_buffer_free(p->buf_w);
  if (p->ctx) ggml_free(p->ctx);
  if (p->ctx_w) ggml_free(p->ctx_w);
  if (p->backend) ggml_backend_free(p->backend);
  delete p;
}

QPeer* qpeer_new(int type, int64_t N, int64_t K, int64_t M, int threads, int repack, const void* W, const float* x) {
  auto* p = new QPeer;
  p->backend = ggml_backend_cpu_init();
  ggml_backend_cpu_set_n_threads(p->backend, threads);
  ggml_backend_buffer_type_t buft = ggml_backend_cpu_buffer_type();
  if (repack) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    auto get_extra = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
        ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts"));
    ggml_backend_buffer_type_t* extra = get_extra ? get_extra(dev) : nullptr;
    if (!extra || !*extra) {
      std::fprintf(stderr, "quant_ggml_peer: this ggml has no extra (repacking) buffer type\n");
      qpeer_free(p);
      return nullptr;
    }
    buft = *extra;
  }
  std::snprintf(p->buffer_name, sizeof p->buffer_name, "%s", ggml_backend_buft_name(buft));
  ggml_init_params pw{ggml_tensor_overhead() * 2, nullptr, true};
  p->ctx_w = ggml_init(pw);
  p->w = ggml_new_tensor_2d(p->ctx_w, static_cast<ggml_type>(type), K, N);
  p->buf_w = ggml_backend_alloc_ctx_tensors_from_buft(p->ctx_w, buft);
  ggml_init_params pa{ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
  p->ctx = ggml_init(pa);
  p->x = ggml_new_tensor_2d(p->ctx, GGML_TYPE_F32, K, M);
  p->y = ggml_mul_mat(p->ctx, p->w, p->x);
  if (repack && !ggml_backend_dev_supports_op(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU), p->y)) {
    std::fprintf(stderr, "quant_ggml_peer: %s does not take this product\n", p->buffer_name);
    qpeer_free(p);
    return nullptr;
  }
  ggml_backend_tensor_set(p->w, W, 0, ggml_nbytes(p->w));
  p->graph = ggml_new_graph(p->ctx);
  ggml_build_forward_expand(p->graph, p->y);
  p->buf = ggml_backend_alloc_ctx_tensors(p->ctx, p->backend);
  ggml_backend_tensor_set(p->x, x, 0, ggml_nbytes(p->x));
  p->out.resize(static_cast<size_t>(M * N));
  return p;
}

int qpeer_run(QPeer* p) { return ggml_backend_graph_compute(p->backend, p->graph) == GGML_STATUS_SUCCESS ? 0 : 1; }

const float* qpeer_output(QPeer* p) {
  ggml_backend_tensor_get(p->y, p->out.data(), 0, p->out.size() * sizeof(float));
  return p->out.data();
}

const char* qpeer_buffer_name(QPeer* p) { return p->buffer_name; }

}  // extern "C"
