// The prefill of a GGUF model read quantized (load_gguf_weights): a piece of a prompt through one decoder layer at a
// time, as model::layer_forward runs it for the bf16 / fp32 decoder (Decoder::prefill), with every matrix that
// QuantWeights keeps in the file's blocks multiplied on those blocks by kernels::quant_matmul (fp32 compute).
//
// The same kernels as the layered path, in the same order, around the products: the input norm, the Gated DeltaNet's
// cached conv, q/k norms, gates, the delta rule (chunked over the piece, or its recurrent step for a one-token
// piece), the gated norm; attention's q/k norms, RoPE, the cache write and the flash kernel (a piece from position 0)
// or the cached one (later pieces); the residual add and post norm; the dense SwiGLU, or the MoE's routing, grouping,
// experts and combine (kernels::pieces, as the fused step composes them). The matrices the file stores unquantized
// (converted to fp32 at load) go through kernels::matmul.
//
// Products take quant_matmul's Auto way: int8 for pieces of at most kGemvMaxRows rows (the decode arithmetic, so
// each product row has the bits the fused step gives it), dequantized fp32 tiles through oneDNN with more rows. A piece runs under kernels::SmallRowProducts as Decoder::run does, so a one-token
// piece's fp32 products are gemv's: a prefill in one-token pieces gives the token-by-token steps' logits bit for bit
// (tests/quant_prefill_test.cpp).
//
// Every buffer (and quant_matmul's scratch) is taken from the accountant in the same order in planning mode, so
// planner::plan_generate_gguf equals what generate measures.
#pragma once
#include <cstdint>

#include "core/memory.h"
#include "infer/weights.h"
#include "kernels/quant_gemv.h"
#include "model/layer.h"
#include "model/params.h"

namespace hs::infer {

// Layer lw (its quantized matrices in ql) over ctx.tokens() rows of h_in, fp32, into h_out; ctx.cache and ctx.slots
// required (the decoder's caches), ctx.positions absolute. how: the products' way (tests force one).
void quant_layer_prefill(const model::LayerContext& ctx, const model::LayerWeights& lw, const QuantLayer& ql,
                         const float* h_in, float* h_out, kernels::QuantMatmul how = kernels::QuantMatmul::Auto);

// y[M, N] = x[M, K] W^T for a matrix kept quantized (its rows from row0), through quant_matmul with its scratch from
// the accountant (MemCategory::Workspace, "quant_matmul.workspace"); allocates in planning mode too, computes only
// outside it. ldx, ldy: 0 for K, N.
void quant_product(MemoryAccountant& mem, const QuantMatrix& m, int64_t row0, const float* x, float* y, int64_t M,
                   int64_t N, int64_t K, int64_t ldx = 0, int64_t ldy = 0,
                   kernels::QuantMatmul how = kernels::QuantMatmul::Auto);

}  // namespace hs::infer
