#include "train/schedule.h"

#include <cstring>
#include <stdexcept>

#include "kernels/embedding.h"
#include "kernels/lm_head.h"
#include "kernels/matmul.h"
#include "kernels/norms.h"
#include "model/layer.h"
#include "model/linear.h"

namespace hs::train {

using model::LayerSlot;
using model::ModelConfig;
using model::ParamSet;
using model::StackGroup;

std::string remat_name(RematPolicy p) {
  switch (p) {
    case RematPolicy::None: return "none";
    case RematPolicy::Block: return "block";
    case RematPolicy::Sublayer: return "sublayer";
  }
  return "?";
}

RematPolicy parse_remat(const std::string& s) {
  if (s == "none") return RematPolicy::None;
  if (s == "block") return RematPolicy::Block;
  if (s == "sublayer") return RematPolicy::Sublayer;
  throw std::invalid_argument("unknown remat policy '" + s + "' (use none, block or sublayer)");
}

DType parse_dtype(const std::string& s) {
  if (s == "fp32" || s == "f32" || s == "float32") return DType::F32;
  if (s == "bf16" || s == "bfloat16") return DType::BF16;
  throw std::invalid_argument("unknown dtype '" + s + "' (use fp32 or bf16)");
}

std::vector<LayerSlot> scan_order(const ModelConfig& c) {
  std::vector<LayerSlot> v;
  for (int64_t b = 0; b < c.blocks(); ++b) {
    for (int64_t l = 0; l < c.local_per_block(); ++l) v.push_back({StackGroup::Local, b, l});
    v.push_back({StackGroup::Global, b, 0});
  }
  for (int64_t r = 0; r < c.remainder(); ++r) v.push_back({StackGroup::Remainder, r, 0});
  return v;
}

namespace {

// The scan order cut into segments: one per block, one for the remainder. Block remat keeps segment inputs.
std::vector<bool> segment_starts(const ModelConfig& c) {
  std::vector<bool> starts(static_cast<size_t>(c.layers), false);
  for (int64_t b = 0; b < c.blocks(); ++b) starts[static_cast<size_t>(b * c.cycle)] = true;
  if (c.remainder() > 0) starts[static_cast<size_t>(c.blocks() * c.cycle)] = true;
  return starts;
}

int64_t count_targets(const Batch& b, bool planning) {
  if (planning) return b.batch * b.seq;
  int64_t n = 0;
  for (int64_t i = 0; i < b.batch * b.seq; ++i) n += b.targets[i] >= 0;
  return n;
}

template <typename T>
struct Runner {
  const ParamSet& params;
  const ModelConfig& c;
  const Batch& b;
  MemoryAccountant& mem;
  bool P;
  int64_t N, H;
  Buffer positions;
  std::vector<LayerSlot> slots;

  Runner(const ParamSet& p, const Batch& bt, MemoryAccountant& m)
      : params(p), c(p.config()), b(bt), mem(m), P(m.planning()), N(bt.batch * bt.seq), H(p.config().hidden),
        slots(scan_order(p.config())) {
    positions = mem.allocate_n<int32_t>(static_cast<size_t>(N), MemCategory::Workspace, "positions");
    if (!P)
      for (int64_t i = 0; i < N; ++i) positions.as<int32_t>()[i] = static_cast<int32_t>(i % b.seq);
  }
  model::LayerContext ctx() const { return {c, mem, b.batch, b.seq, positions.as<int32_t>()}; }

  Buffer embed(MemCategory cat) {
    Buffer h = mem.allocate_n<T>(static_cast<size_t>(N * H), cat, "h.embed");
    if (P) return h;
    const TensorView& e = params.global(model::g::kEmbed);
    if (e.dtype == DType::F32)
      kernels::embedding_forward(b.inputs, N, static_cast<const float*>(e.data), c.vocab, H, h.as<T>());
    else
      kernels::embedding_forward(b.inputs, N, static_cast<const bf16*>(e.data), c.vocab, H, h.as<T>());
    return h;
  }

  // Final norm + LM head + cross-entropy. With grads: dh_last receives d loss / d h_last (fp32).
  kernels::XentResult head(const T* h_last, float grad_scale, ParamSet* grads, float* dh_last, float* logits) {
    Buffer xf = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "final_norm.out");
    Buffer rstd = mem.allocate_n<float>(static_cast<size_t>(N), MemCategory::Workspace, "final_norm.rstd");
    model::Converted<float> wn = model::as_type<float>(params.global(model::g::kFinalNorm), mem,
                                                       MemCategory::WeightCasts, "weight_cast");
    if (!P) kernels::rmsnorm_forward(h_last, wn.ptr, xf.as<T>(), rstd.as<float>(), N, H, float(c.rms_eps));
    model::Converted<T> wl = model::as_type<T>(params.global(model::g::kLmHead), mem, MemCategory::WeightCasts,
                                               "weight_cast");
    if (logits && !P) kernels::matmul(xf.as<T>(), wl.ptr, logits, N, c.vocab, H, false, true);
    if (!grads) return kernels::lm_head_xent(xf.as<T>(), wl.ptr, b.targets, N, H, c.vocab, 0.f, nullptr, nullptr, mem);
    Buffer dxf = mem.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "final_norm.dout", true);
    float* dW = static_cast<float*>(grads->global(model::g::kLmHead).data);
    kernels::XentResult r =
        kernels::lm_head_xent(xf.as<T>(), wl.ptr, b.targets, N, H, c.vocab, grad_scale, dxf.as<float>(), dW, mem);
    if (!P) {
      std::memset(dh_last, 0, sizeof(float) * static_cast<size_t>(N * H));
      kernels::rmsnorm_backward(h_last, wn.ptr, rstd.as<float>(), dxf.as<float>(), dh_last,
                                static_cast<float*>(grads->global(model::g::kFinalNorm).data), N, H);
    }
    return r;
  }

  void finish(StepResult& r, const kernels::XentResult& x, std::vector<float>* dprob) {
    r.ce_sum = x.loss_sum;
    r.count = x.count;
    r.ce = x.count ? x.loss_sum / static_cast<double>(x.count) : 0.0;
    if (c.moe()) r.aux = kernels::load_balance_loss(r.router, c.experts, dprob);
    r.loss = r.ce + c.router_aux_coef * r.aux;
    if (dprob)
      for (float& v : *dprob) v *= static_cast<float>(c.router_aux_coef);
  }

  StepResult forward_only(float* logits) {
    StepResult r;
    Buffer h = embed(MemCategory::Workspace);
    for (const LayerSlot& s : slots) {
      Buffer out = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "h.layer_out");
      r.router.push_back(model::layer_forward<T>(ctx(), params.layer(s), h.as<T>(), out.as<T>(), nullptr));
      h = std::move(out);
    }
    finish(r, head(h.as<T>(), 0.f, nullptr, nullptr, logits), nullptr);
    return r;
  }

  StepResult forward_backward(RematPolicy policy, std::unique_ptr<ParamSet>* grads_out) {
    StepResult r;
    const size_t L = slots.size();
    const std::vector<bool> seg = segment_starts(c);
    // kept[i]: the input of layer i, when the policy keeps it (kept[L] is the last layer's output).
    std::vector<Buffer> kept(L + 1);
    std::vector<std::unique_ptr<model::LayerSaved<T>>> states(L);
    auto keeps_input = [&](size_t i) {
      return i == L || policy != RematPolicy::Block || seg[i];
    };
    Buffer h = embed(keeps_input(0) ? MemCategory::Activations : MemCategory::Workspace);
    for (size_t i = 0; i < L; ++i) {
      MemCategory out_cat = keeps_input(i + 1) ? MemCategory::Activations : MemCategory::Workspace;
      Buffer out = mem.allocate_n<T>(static_cast<size_t>(N * H), out_cat, "h.layer_out");
      if (policy == RematPolicy::None) states[i] = std::make_unique<model::LayerSaved<T>>();
      r.router.push_back(
          model::layer_forward<T>(ctx(), params.layer(slots[i]), h.as<T>(), out.as<T>(), states[i].get()));
      if (keeps_input(i)) kept[i] = std::move(h);
      h = std::move(out);
    }
    kept[L] = std::move(h);

    grads_out->reset(new ParamSet(c, DType::F32, mem, MemCategory::Gradients, /*zero=*/true));
    ParamSet& grads = **grads_out;
    const int64_t count = count_targets(b, P);
    Buffer dh = mem.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "dh");
    std::vector<float> dprob;
    finish(r, head(kept[L].as<T>(), count ? 1.0f / static_cast<float>(count) : 0.f, &grads, dh.as<float>(), nullptr),
           c.moe() ? &dprob : nullptr);
    kept[L].reset();
    const float* aux_dprob = c.moe() ? dprob.data() : nullptr;

    Buffer dh_prev = mem.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "dh");
    auto backward_one = [&](size_t i, const T* h_in, const model::LayerSaved<T>& st) {
      model::layer_backward<T>(ctx(), params.layer(slots[i]), grads.layer(slots[i]), h_in, st, dh.as<float>(),
                               dh_prev.as<float>(), aux_dprob);
      std::swap(dh, dh_prev);
    };
    if (policy == RematPolicy::None) {
      for (size_t i = L; i-- > 0;) {
        backward_one(i, kept[i].as<T>(), *states[i]);
        states[i].reset();
        kept[i].reset();
      }
    } else if (policy == RematPolicy::Sublayer) {
      for (size_t i = L; i-- > 0;) {
        model::LayerSaved<T> st;
        {
          Buffer out = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "h.recompute_out");
          model::layer_forward<T>(ctx(), params.layer(slots[i]), kept[i].as<T>(), out.as<T>(), &st);
        }
        backward_one(i, kept[i].as<T>(), st);
        kept[i].reset();
      }
    } else {
      size_t end = L;
      while (end > 0) {
        size_t start = end - 1;
        while (!seg[start]) --start;
        // Recompute the whole segment keeping every layer's intermediates, then run its backward.
        std::vector<Buffer> inputs;
        std::vector<std::unique_ptr<model::LayerSaved<T>>> st;
        for (size_t i = start; i < end; ++i) {
          const T* in = i == start ? kept[start].as<T>() : inputs.back().as<T>();
          Buffer out = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "h.recompute_out");
          st.push_back(std::make_unique<model::LayerSaved<T>>());
          model::layer_forward<T>(ctx(), params.layer(slots[i]), in, out.as<T>(), st.back().get());
          if (i + 1 < end) inputs.push_back(std::move(out));
        }
        for (size_t i = end; i-- > start;) {
          const T* in = i == start ? kept[start].as<T>() : inputs[i - start - 1].as<T>();
          backward_one(i, in, *st[i - start]);
          st[i - start].reset();
          if (i > start) inputs[i - start - 1].reset();
        }
        kept[start].reset();
        end = start;
      }
    }
    if (!P)
      kernels::embedding_backward(b.inputs, N, dh.as<float>(), c.vocab, H,
                                  static_cast<float*>(grads.global(model::g::kEmbed).data));
    return r;
  }
};

}  // namespace

StepResult forward_backward(const ParamSet& params, const Batch& b, const StepOptions& opt, MemoryAccountant& mem,
                            std::unique_ptr<ParamSet>* grads) {
  if (opt.compute == DType::F32) return Runner<float>(params, b, mem).forward_backward(opt.remat, grads);
  return Runner<bf16>(params, b, mem).forward_backward(opt.remat, grads);
}

StepResult forward_only(const ParamSet& params, const Batch& b, DType compute, MemoryAccountant& mem, float* logits) {
  if (compute == DType::F32) return Runner<float>(params, b, mem).forward_only(logits);
  return Runner<bf16>(params, b, mem).forward_only(logits);
}

}  // namespace hs::train
