#include "train/schedule.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <sstream>
#include <stdexcept>

#include "core/profile.h"
#include "core/settings.h"
#include "distributed/global_weights.h"
#include "distributed/gradient_flights.h"
#include "distributed/prefetch.h"
#include "kernels/embedding.h"
#include "kernels/lm_head.h"
#include "kernels/matmul.h"
#include "kernels/norms.h"
#include "model/layer.h"
#include "model/linear.h"
#include "model/mtp.h"

namespace hs::train {

using model::LayerSlot;
using model::ModelConfig;
using model::ParamSet;
using model::StackGroup;
using kernels::RouterStats;

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

std::string packing_name(Packing p) {
  switch (p) {
    case Packing::Auto: return "auto";
    case Packing::Stream: return "stream";
    case Packing::Documents: return "documents";
  }
  return "?";
}

Packing parse_packing(const std::string& s) {
  if (s == "auto") return Packing::Auto;
  if (s == "stream") return Packing::Stream;
  if (s == "documents") return Packing::Documents;
  throw std::invalid_argument("unknown packing '" + s + "' (use documents, stream or auto)");
}

bool packed_weights_default() {
  const char* v = settings::value(settings::Setting::PackedWeights);
  const std::string e = v ? v : "";
  if (e == "on") return true;
  if (e.empty() || e == "off") return false;
  throw std::invalid_argument(std::string(settings::name(settings::Setting::PackedWeights)) + " must be on or off, not '" +
                              e + "'");
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

// grads can receive params' gradients: the same tensors in the same order with the same element counts (fp32).
bool same_layout(const ParamSet& grads, const ParamSet& params) {
  const auto& g = grads.all();
  const auto& p = params.all();
  if (grads.shards() != params.shards() || g.size() != p.size()) return false;
  for (size_t i = 0; i < g.size(); ++i)
    if (g[i].name != p[i].name || g[i].tensor.numel() != p[i].tensor.numel() || g[i].tensor.dtype() != DType::F32)
      return false;
  return true;
}

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
  LocalCollectives local;
  Collectives* comm;
  Collectives* batch_comm;  // sums over the global batch (the ranks that share it)
  int64_t ep = 1;
  Collectives* ep_group = nullptr;
  bool keep_recomputables = false;  // remat none: the layers keep what their kernels would recompute
  bool prefetch = false;
  bool pack_weights = false;
  bool delta_rule_bf16_products = false;
  size_t piece_bytes = 0;
  size_t vocab_piece_bytes = 0;  // StepOptions::vocab_piece_bytes
  GradientSink* sink = nullptr;  // StepOptions::update
  double mtp_weight = 0;         // StepOptions::mtp_weight

  // Prefetching: the layer_forward calls of a step (layer indices in order), each taking its weights with the next
  // call's gathers started.
  distributed::InOrderPrefetch<model::ComputeWeights<T>> prefetcher;
  // Gradient reduce-scatters (and the sink's hand-overs): one left in flight while the next backward computes when
  // prefetching.
  distributed::GradientFlights flights;

  Runner(const ParamSet& p, const Batch& bt, MemoryAccountant& m, Collectives* group, Collectives* batch_group)
      : params(p), c(p.config()), b(bt), mem(m), P(m.planning()), N(bt.batch * bt.seq), H(p.config().hidden),
        slots(scan_order(p.config())), comm(group ? group : &local),
        batch_comm(batch_group ? batch_group : &local) {
    if (comm->size() != p.shards())
      throw std::invalid_argument("parameters are sharded " + std::to_string(p.shards()) + " ways but the group has " +
                                  std::to_string(comm->size()) + " ranks");
    // RoPE's positions: within each document with packed documents, else 0..seq-1 per sequence.
    positions = mem.allocate_n<int32_t>(static_cast<size_t>(N), MemCategory::Workspace, "positions");
    if (!P && b.positions) {
      kernels::check_positions(b.positions, b.batch, b.seq, "the batch");
      std::copy_n(b.positions, N, ptr<int32_t>(positions));
    } else if (!P) {
      for (int64_t i = 0; i < N; ++i) ptr<int32_t>(positions)[i] = static_cast<int32_t>(i % b.seq);
    }
  }
  model::LayerContext ctx() const {
    model::LayerContext x{c, mem, b.batch, b.seq, ptr<int32_t>(positions), comm, ep, keep_recomputables,
                          /*cache=*/nullptr, /*slots=*/nullptr, piece_bytes, ep_group, pack_weights,
                          delta_rule_bf16_products};
    x.documents = b.positions != nullptr;
    return x;
  }
  bool sharded() const { return params.shards() > 1; }
  bool prefetching() const { return prefetch && sharded(); }

  model::ComputeWeights<T> start_weights(size_t i) {
    profile::Scope profile_scope(sharded() ? profile::Phase::Communication : profile::Phase::Elementwise, "layer_weight_casts");
    return model::start_compute_weights<T>(c, params.layer(slots[i]), mem, comm);
  }
  // The weights of layer i's next layer_forward call (prefetching: the call after it started).
  model::ComputeWeights<T> weights_for(size_t i) {
    if (!prefetching()) return start_weights(i);
    return prefetcher.take(i, [this](size_t k) { return start_weights(k); });
  }
  RouterStats run_layer(size_t i, const T* in, T* out, model::LayerSaved<T>* saved) {
    model::ComputeWeights<T> w = weights_for(i);
    return model::layer_forward<T>(ctx(), params.layer(slots[i]), in, out, saved, &w);
  }

  // The group a tensor is sharded over (null: unsharded).
  Collectives* shard_group() const { return sharded() ? comm : nullptr; }

  // A global tensor (embedding, final norm, LM head) whole as E for compute (distributed::whole_weight).
  // `which`: an index into params.all(): a g::Global, or (the MTP layer's own tensors) ParamSet::mtp_index.
  template <typename E> model::Converted<E> global_weight(size_t which) {
    const model::StackedParam& sp = params.all().at(which);
    return distributed::whole_weight<E>(sp.tensor.view(), hs::numel(sp.full_shape), shard_group(), mem);
  }

  // Where a layer's backward accumulates its gradients: the gradient stacks themselves (or, with a sink, zeroed
  // buffers of this layer's shards, `own`), or, when sharded, full-size temporaries that are reduce-scattered into
  // this rank's shards once the layer's backward is done. The routed experts' views stay on this rank's shards: the
  // MoE kernel reduce-scatters them piece by piece.
  struct GradTarget {
    std::vector<Buffer> full;
    std::vector<size_t> index;   // the tensor of each full buffer
    std::vector<float*> shards;  // this rank's gradient shard of each
    model::LayerWeights view;
    std::vector<Buffer> own;     // with a sink: the layer's gradient shards
    model::LayerWeights out;     // with a sink: views of `own`, what the sink receives
    LayerSlot slot{};
  };
  GradTarget layer_grads(ParamSet* grads, const LayerSlot& s) {
    GradTarget g;
    const auto specs = model::layer_specs(c, s.kind());
    if (grads) {
      g.view = grads->layer(s);
    } else {
      g.slot = s;
      g.view = {s.kind(), {}, params.shards()};
      for (const model::ParamSpec& sp : specs) {
        const int64_t n = sharded() ? model::layer_shard_elems(sp, params.shards()) : hs::numel(sp.shape);
        g.own.push_back(mem.allocate_n<float>(static_cast<size_t>(n), MemCategory::Gradients,
                                              "layer_grad_shard:" + sp.name, true));
        g.view.t.emplace_back(g.own.back().data(), DType::F32, sp.shape);
      }
      g.out = g.view;
    }
    if (!sharded()) return g;
    for (size_t i = 0; i < g.view.t.size(); ++i) {
      if (model::is_routed_expert(specs[i])) continue;
      TensorView& v = g.view.t[i];
      g.full.push_back(mem.allocate_n<float>(static_cast<size_t>(comm->padded_elems(v.numel())), MemCategory::Gradients,
                                             "layer_grad:" + specs[i].name, true));
      g.index.push_back(i);
      g.shards.push_back(static_cast<float*>(v.data));
      v.data = g.full.back().data();
    }
    return g;
  }
  void reduce_scatter(GradTarget& g) {
    distributed::GradientFlight f;
    for (size_t i = 0; i < g.full.size(); ++i)
      f.requests.push_back(
          comm->start_reduce_scatter(ptr<float>(g.full[i]), g.view.t[g.index[i]].numel(), g.shards[i]));
    f.full = std::move(g.full);
    if (sink) {
      f.shards = std::move(g.own);
      f.done = [this, slot = g.slot, out = std::move(g.out)] { sink->layer(slot, out); };
    }
    flights.submit(std::move(f));
  }
  // A global tensor's gradient: accumulated at `ptr` (this rank's shard, or a full temporary when sharded); with a
  // sink the shard is the step's own buffer (`own`).
  struct GlobalGrad {
    Buffer full, own;
    float* ptr;
    float* shard;
  };
  GlobalGrad global_grad(ParamSet* grads, size_t which, bool full = true) {
    const model::StackedParam& sp = params.all().at(which);
    GlobalGrad g;
    if (grads) {
      g.shard = static_cast<float*>(grads->all().at(which).tensor.data());
    } else {
      g.own = mem.allocate_n<float>(static_cast<size_t>(sp.tensor.numel()), MemCategory::Gradients, "global_grad_shard",
                                    true);
      g.shard = ptr<float>(g.own);
    }
    g.ptr = g.shard;
    if (!sharded() || !full) return g;
    g.full = mem.allocate_n<float>(static_cast<size_t>(comm->padded_elems(hs::numel(sp.full_shape))),
                                   MemCategory::Gradients, "global_grad", true);
    g.ptr = ptr<float>(g.full);
    return g;
  }
  void reduce_scatter(GlobalGrad& g, size_t which) {
    if (!sharded() && !sink) return;
    distributed::GradientFlight f;
    if (sharded()) {
      const model::StackedParam& sp = params.all().at(which);
      f.requests.push_back(comm->start_reduce_scatter(ptr<float>(g.full), hs::numel(sp.full_shape), g.shard));
      f.full.push_back(std::move(g.full));
    }
    if (sink) {
      f.shards.push_back(std::move(g.own));
      f.done = [this, which, p = g.shard] { sink->global(static_cast<model::g::Global>(which), p); };
    }
    flights.submit(std::move(f));
  }

  // The embedding or the LM head in vocabulary pieces (StepOptions::vocab_piece_bytes): when it is larger than a
  // piece in E and a piece saves a gather (sharded) or a cast (unsharded, stored in another dtype than E).
  template <typename E> bool in_pieces(model::g::Global which) const {
    if (vocab_piece_bytes == 0) return false;
    if (!sharded() && params.global_param(which).tensor.dtype() == dtype_of<E>()) return false;
    return static_cast<size_t>(c.vocab * H) * sizeof(E) > vocab_piece_bytes;
  }
  template <typename E> int64_t piece_rows() const {
    return std::clamp<int64_t>(static_cast<int64_t>(vocab_piece_bytes / (static_cast<size_t>(H) * sizeof(E))), 1,
                               c.vocab);
  }

  // A global [V, H] table (embedding, LM head) in row pieces of piece_rows<E>() (distributed::RowPieces), visited in
  // `order`; with `grad`, its gradient pieces go to the step's flights.
  template <typename E>
  distributed::RowPieces<E> row_pieces(model::g::Global which, std::vector<int64_t> order,
                                       distributed::RowGradients* grad = nullptr) {
    return distributed::RowPieces<E>(mem, shard_group(), params.global_param(which).tensor.view(), c.vocab, H,
                                     piece_rows<E>(), std::move(order), prefetching(), flights, grad);
  }
  // Where a table's gradient pieces go: the shard of `g`, handed to the sink with the last piece.
  distributed::RowGradients row_grads(GlobalGrad& g, model::g::Global which) {
    distributed::RowGradients r{g.shard, &g.own, nullptr};
    if (sink) r.complete = [s = sink, which, p = g.shard] { s->global(which, p); };
    return r;
  }

  Buffer embed(MemCategory cat, const int32_t* ids = nullptr) {
    if (!ids) ids = b.inputs;
    Buffer h = mem.allocate_n<T>(static_cast<size_t>(N * H), cat, "h.embed");
    if (sharded() && in_pieces<T>(model::g::kEmbed)) {
      const int64_t pieces = (c.vocab + piece_rows<T>() - 1) / piece_rows<T>();
      std::vector<int64_t> order(static_cast<size_t>(pieces));
      for (int64_t k = 0; k < pieces; ++k) order[static_cast<size_t>(k)] = k;
      distributed::RowPieces<T> table = row_pieces<T>(model::g::kEmbed, order);
      for (int64_t k = 0; k < pieces; ++k) {
        const T* rows = table.weights(k);
        if (!P)
          kernels::embedding_forward_rows(ids, N, rows, table.first(k), table.count(k), c.vocab, H, ptr<T>(h));
      }
      return h;
    }
    if (sharded()) {
      model::Converted<T> table = global_weight<T>(model::g::kEmbed);
      if (!P) kernels::embedding_forward(ids, N, table.ptr, c.vocab, H, ptr<T>(h));
      return h;
    }
    if (P) return h;
    const TensorView& e = params.global(model::g::kEmbed);
    if (e.dtype == DType::F32)
      kernels::embedding_forward(ids, N, static_cast<const float*>(e.data), c.vocab, H, ptr<T>(h));
    else
      kernels::embedding_forward(ids, N, static_cast<const bf16*>(e.data), c.vocab, H, ptr<T>(h));
    return h;
  }

  // Final norm + LM head + cross-entropy. With grads: dh_last receives d loss / d h_last (fp32).
  // backward false: the loss only. grads: the gradient set, or null with a sink.
  // norm / targets: the MTP layer's head passes mtp.norm and its targets (x_{t+2}).
  // also (backward only): another consumer of the normed state xf, run after the LM head's backward with xf and
  // d loss / d xf (fp32, accumulated into), before the norm's backward: the MTP layer, which reads xf.
  using XfConsumer = std::function<void(const T* xf, float* dxf)>;
  kernels::XentResult head(const T* h_last, float grad_scale, bool backward, ParamSet* grads, float* dh_last,
                           float* logits, size_t norm = model::g::kFinalNorm, const int32_t* targets = nullptr,
                           const XfConsumer* also = nullptr) {
    if (!targets) targets = b.targets;
    Buffer xf = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "final_norm.out");
    Buffer rstd = mem.allocate_n<float>(static_cast<size_t>(N), MemCategory::Workspace, "final_norm.rstd");
    model::Converted<float> wn = global_weight<float>(norm);
    if (!P) kernels::rmsnorm_forward(h_last, wn.ptr, ptr<T>(xf), ptr<float>(rstd), N, H, float(c.rms_eps));
    if (!logits && in_pieces<T>(model::g::kLmHead)) {
      // Vocabulary pieces: the forward visits 0..P-1, the backward P-1..0 (the forward's last piece kept).
      const int64_t rows = piece_rows<T>(), pieces = (c.vocab + rows - 1) / rows;
      std::vector<int64_t> order;
      for (int64_t k = 0; k < pieces; ++k) order.push_back(k);
      if (backward)
        for (int64_t k = pieces - 1; k-- > 0;) order.push_back(k);
      if (!backward) {
        distributed::RowPieces<T> wl = row_pieces<T>(model::g::kLmHead, order);
        distributed::XentRowPieces<T> src(wl);
        return kernels::lm_head_xent_pieced(ptr<T>(xf), targets, N, H, c.vocab, rows, src, 0.f, nullptr, mem);
      }
      Buffer dxf = mem.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "final_norm.dout", true);
      GlobalGrad dW = global_grad(grads, model::g::kLmHead, /*full=*/false);
      kernels::XentResult r;
      {
        distributed::RowGradients to = row_grads(dW, model::g::kLmHead);
        distributed::RowPieces<T> wl = row_pieces<T>(model::g::kLmHead, order, &to);
        distributed::XentRowPieces<T> src(wl);
        r = kernels::lm_head_xent_pieced(ptr<T>(xf), targets, N, H, c.vocab, rows, src, grad_scale, ptr<float>(dxf),
                                         mem, 0, /*plan_backward=*/true);
      }
      if (also) (*also)(ptr<T>(xf), ptr<float>(dxf));
      final_norm_backward(h_last, wn, rstd, dxf, grads, dh_last, norm);
      return r;
    }
    Buffer dxf;
    kernels::XentResult r;
    {  // (the head's weight and its whole gradient are released before `also` runs)
      model::Converted<T> wl = global_weight<T>(model::g::kLmHead);
      if (logits && !P) kernels::matmul(ptr<T>(xf), wl.ptr, logits, N, c.vocab, H, false, true);
      if (!backward) return kernels::lm_head_xent(ptr<T>(xf), wl.ptr, targets, N, H, c.vocab, 0.f, nullptr, nullptr, mem);
      dxf = mem.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "final_norm.dout", true);
      GlobalGrad dW = global_grad(grads, model::g::kLmHead);
      r = kernels::lm_head_xent(ptr<T>(xf), wl.ptr, targets, N, H, c.vocab, grad_scale, ptr<float>(dxf), dW.ptr, mem, 0,
                                /*plan_backward=*/true);
      reduce_scatter(dW, model::g::kLmHead);
    }
    if (also) (*also)(ptr<T>(xf), ptr<float>(dxf));
    final_norm_backward(h_last, wn, rstd, dxf, grads, dh_last, norm);
    return r;
  }
  void final_norm_backward(const T* h_last, const model::Converted<float>& wn, const Buffer& rstd, const Buffer& dxf,
                           ParamSet* grads, float* dh_last, size_t norm) {
    GlobalGrad dn = global_grad(grads, norm);
    if (!P) {
      kernels::rmsnorm_backward(h_last, wn.ptr, ptr<float>(rstd), ptr<float>(dxf), dh_last, dn.ptr, N, H,
                                /*accumulate=*/false);
    }
    reduce_scatter(dn, norm);
  }

  // Router statistics of every layer summed over the batch group, in one call: [counts, prob sums, rows] per layer.
  void sum_router_stats(std::vector<RouterStats>& router) {
    if (batch_comm->size() == 1 || router.empty()) return;
    std::vector<double> v;
    for (const RouterStats& s : router) {
      v.insert(v.end(), s.expert_counts.begin(), s.expert_counts.end());
      v.insert(v.end(), s.prob_sums.begin(), s.prob_sums.end());
      v.push_back(static_cast<double>(s.rows));
    }
    batch_comm->all_reduce_sum(v.data(), static_cast<int64_t>(v.size()));
    size_t k = 0;
    for (RouterStats& s : router) {
      for (double& e : s.expert_counts) e = v[k++];
      for (double& e : s.prob_sums) e = v[k++];
      s.rows = static_cast<int64_t>(v[k++]);
    }
  }

  void finish(StepResult& r, const kernels::XentResult& x, std::vector<float>* dprob) {
    double sums[2] = {x.loss_sum, static_cast<double>(x.count)};
    batch_comm->all_reduce_sum(sums, 2);
    r.ce_sum = sums[0];
    r.count = static_cast<int64_t>(sums[1]);
    sum_router_stats(r.router);
    r.ce = r.count ? r.ce_sum / static_cast<double>(r.count) : 0.0;
    if (c.moe()) r.aux = kernels::load_balance_loss(r.router, c.experts, dprob);
    r.loss = r.ce + c.router_aux_coef * r.aux;
    if (dprob)
      for (float& v : *dprob) v *= static_cast<float>(c.router_aux_coef);
  }

  // The multi-token-prediction layer at depth 1 (docs/model.md), forward and backward at once, run inside the
  // decoder's head (its XfConsumer) on the final norm's output xf, after the LM head's backward and before the
  // norm's: whatever the remat policy, its intermediates live only while it runs (it is computed once and never
  // recomputed). Adds weight / (its counted targets) times its cross-entropy's gradient: into dxf (d loss / d xf,
  // accumulated), into the gradients of its own tensors and of the LM head, and, for the embedding's backward at the
  // end of the step, into d_next [N, H] (written) at the ids next_ids. Its router's statistics are not part of the
  // load-balance loss.
  kernels::XentResult mtp(const T* xf, double weight, ParamSet* grads, float* dxf, Buffer& next_ids, Buffer& d_next,
                          int64_t& count) {
    const model::LayerSlot slot{StackGroup::Mtp, 0, 0};
    next_ids = mem.allocate_n<int32_t>(static_cast<size_t>(N), MemCategory::Workspace, "mtp.next_ids");
    Buffer targets = mem.allocate_n<int32_t>(static_cast<size_t>(N), MemCategory::Workspace, "mtp.targets");
    const int64_t on_rank =
        P ? N : model::mtp_shift(b.inputs, b.targets, b.batch, b.seq, ptr<int32_t>(next_ids), ptr<int32_t>(targets));
    count = static_cast<int64_t>(batch_comm->all_reduce_sum(static_cast<double>(on_rank)));
    const size_t i_fc = params.mtp_index(model::g::kMtpFc), i_ne = params.mtp_index(model::g::kMtpNormEmbedding),
                 i_nh = params.mtp_index(model::g::kMtpNormHidden), i_n = params.mtp_index(model::g::kMtpNorm);
    Buffer e = embed(MemCategory::Workspace, ptr<int32_t>(next_ids));
    Buffer m = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "mtp.in");
    model::MtpInputSaved in_saved;
    {
      model::Converted<T> fc = global_weight<T>(i_fc);
      model::Converted<float> we = global_weight<float>(i_ne), wh = global_weight<float>(i_nh);
      model::mtp_input_forward<T>(mem, ptr<T>(e), xf, we.ptr, wh.ptr, fc.ptr, ptr<T>(m), N, H,
                                  static_cast<float>(c.rms_eps), in_saved);
    }
    Buffer out = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "mtp.out");
    auto st = std::make_unique<model::LayerSaved<T>>();
    model::layer_forward<T>(ctx(), params.layer(slot), ptr<T>(m), ptr<T>(out), st.get());
    Buffer dout = mem.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "mtp.dout");
    const kernels::XentResult x = head(ptr<T>(out), count ? static_cast<float>(weight / static_cast<double>(count)) : 0.f,
                                       true, grads, ptr<float>(dout), nullptr, i_n, ptr<int32_t>(targets));
    out.reset();
    Buffer dm = mem.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "mtp.dm");
    {
      GradTarget gt = layer_grads(grads, slot);
      model::layer_backward<T>(ctx(), params.layer(slot), gt.view, ptr<T>(m), *st, ptr<float>(dout), ptr<float>(dm),
                               nullptr);
      reduce_scatter(gt);
    }
    st.reset();
    dout.reset();
    d_next = mem.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "mtp.d_next");
    model::Converted<T> fc = global_weight<T>(i_fc);
    model::Converted<float> we = global_weight<float>(i_ne), wh = global_weight<float>(i_nh);
    GlobalGrad dfc = global_grad(grads, i_fc), dwe = global_grad(grads, i_ne), dwh = global_grad(grads, i_nh);
    model::mtp_input_backward<T>(mem, ptr<T>(e), xf, we.ptr, wh.ptr, fc.ptr, in_saved, ptr<float>(dm),
                                 ptr<float>(d_next), dxf, dwe.ptr, dwh.ptr, dfc.ptr, N, H);
    reduce_scatter(dfc, i_fc);
    reduce_scatter(dwe, i_ne);
    reduce_scatter(dwh, i_nh);
    return x;
  }

  StepResult forward_only(float* logits) {
    StepResult r;
    Buffer h = embed(MemCategory::Workspace);
    for (const LayerSlot& s : slots) {
      Buffer out = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "h.layer_out");
      r.router.push_back(model::layer_forward<T>(ctx(), params.layer(s), ptr<T>(h), ptr<T>(out), nullptr));
      h = std::move(out);
    }
    finish(r, head(ptr<T>(h), 0.f, false, nullptr, nullptr, logits), nullptr);
    return r;
  }

  StepResult forward_backward(RematPolicy policy, std::unique_ptr<ParamSet>* grads_out) {
    StepResult r;
    const size_t L = slots.size();
    const std::vector<bool> seg = segment_starts(c);
    keep_recomputables = policy == RematPolicy::None;
    // kept[i]: the input of layer i, when the policy keeps it (kept[L] is the last layer's output).
    std::vector<Buffer> kept(L + 1);
    std::vector<std::unique_ptr<model::LayerSaved<T>>> states(L);
    auto keeps_input = [&](size_t i) {
      return i == L || policy != RematPolicy::Block || seg[i];
    };
    flights.set_overlap(prefetching());
    std::vector<size_t>& calls = prefetcher.calls;
    for (size_t i = 0; i < L; ++i) calls.push_back(i);
    if (policy == RematPolicy::Sublayer) {
      for (size_t i = L; i-- > 0;) calls.push_back(i);
    } else if (policy == RematPolicy::Block) {
      for (size_t end = L; end > 0;) {
        size_t start = end - 1;
        while (!seg[start]) --start;
        for (size_t i = start; i < end; ++i) calls.push_back(i);
        end = start;
      }
    }
    Buffer h = embed(keeps_input(0) ? MemCategory::Activations : MemCategory::Workspace);
    for (size_t i = 0; i < L; ++i) {
      MemCategory out_cat = keeps_input(i + 1) ? MemCategory::Activations : MemCategory::Workspace;
      Buffer out = mem.allocate_n<T>(static_cast<size_t>(N * H), out_cat, "h.layer_out");
      if (policy == RematPolicy::None) states[i] = std::make_unique<model::LayerSaved<T>>();
      r.router.push_back(run_layer(i, ptr<T>(h), ptr<T>(out), states[i].get()));
      if (keeps_input(i)) kept[i] = std::move(h);
      h = std::move(out);
    }
    kept[L] = std::move(h);

    ParamSet* grads = nullptr;
    if (!sink) {
      if (!*grads_out || !same_layout(**grads_out, params))
        grads_out->reset(new ParamSet(c, DType::F32, mem, MemCategory::Gradients, /*zero=*/true, params.shards()));
      grads = grads_out->get();
    }
    const int64_t count = static_cast<int64_t>(batch_comm->all_reduce_sum(static_cast<double>(count_targets(b, P))));
    Buffer dh = mem.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "dh");
    std::vector<float> dprob;
    Buffer mtp_ids, mtp_dnext;  // the MTP layer's next-token ids and their embedding gradient
    kernels::XentResult mtp_x;
    int64_t mtp_n = 0;
    const XfConsumer with_mtp = [&](const T* xf, float* dxf) {
      mtp_x = mtp(xf, mtp_weight, grads, dxf, mtp_ids, mtp_dnext, mtp_n);
    };
    finish(r,
           head(ptr<T>(kept[L]), count ? 1.0f / static_cast<float>(count) : 0.f, true, grads, ptr<float>(dh), nullptr,
                model::g::kFinalNorm, nullptr, mtp_weight > 0 ? &with_mtp : nullptr),
           c.moe() ? &dprob : nullptr);
    if (mtp_weight > 0) {
      r.mtp_count = mtp_n;
      r.mtp_ce = mtp_n ? batch_comm->all_reduce_sum(mtp_x.loss_sum) / static_cast<double>(mtp_n) : 0.0;
      r.loss += mtp_weight * r.mtp_ce;
    }
    kept[L].reset();
    const float* aux_dprob = c.moe() ? dprob.data() : nullptr;

    Buffer dh_prev = mem.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "dh");
    auto backward_one = [&](size_t i, const T* h_in, const model::LayerSaved<T>& st) {
      GradTarget gt = layer_grads(grads, slots[i]);
      model::layer_backward<T>(ctx(), params.layer(slots[i]), gt.view, h_in, st, ptr<float>(dh), ptr<float>(dh_prev),
                               aux_dprob);
      reduce_scatter(gt);
      std::swap(dh, dh_prev);
    };
    if (policy == RematPolicy::None) {
      for (size_t i = L; i-- > 0;) {
        backward_one(i, ptr<T>(kept[i]), *states[i]);
        states[i].reset();
        kept[i].reset();
      }
    } else if (policy == RematPolicy::Sublayer) {
      for (size_t i = L; i-- > 0;) {
        model::LayerSaved<T> st;
        {
          Buffer out = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "h.recompute_out");
          run_layer(i, ptr<T>(kept[i]), ptr<T>(out), &st);
        }
        backward_one(i, ptr<T>(kept[i]), st);
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
          const T* in = i == start ? ptr<T>(kept[start]) : ptr<T>(inputs.back());
          Buffer out = mem.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "h.recompute_out");
          st.push_back(std::make_unique<model::LayerSaved<T>>());
          run_layer(i, in, ptr<T>(out), st.back().get());
          if (i + 1 < end) inputs.push_back(std::move(out));
        }
        for (size_t i = end; i-- > start;) {
          const T* in = i == start ? ptr<T>(kept[start]) : ptr<T>(inputs[i - start - 1]);
          backward_one(i, in, *st[i - start]);
          st[i - start].reset();
          if (i > start) inputs[i - start - 1].reset();
        }
        kept[start].reset();
        end = start;
      }
    }
    if (sharded() && in_pieces<T>(model::g::kEmbed)) {
      // In vocabulary pieces: each piece's rows scatter-added (the same sums as the whole table) and reduce-scattered.
      GlobalGrad de = global_grad(grads, model::g::kEmbed, /*full=*/false);
      distributed::RowGradients to = row_grads(de, model::g::kEmbed);
      distributed::RowPieces<T> table = row_pieces<T>(model::g::kEmbed, {}, &to);
      for (int64_t k = 0; k < table.pieces(); ++k) {
        float* rows = table.grad_rows(k);
        if (!P)
          kernels::embedding_backward_rows(b.inputs, N, ptr<float>(dh), table.first(k), table.count(k), c.vocab, H,
                                           rows);
        if (!P && mtp_weight > 0)
          kernels::embedding_backward_rows(ptr<int32_t>(mtp_ids), N, ptr<float>(mtp_dnext), table.first(k),
                                           table.count(k), c.vocab, H, rows);
        table.grad_rows_done(k);
      }
    } else {
      GlobalGrad de = global_grad(grads, model::g::kEmbed);
      if (!P) kernels::embedding_backward(b.inputs, N, ptr<float>(dh), c.vocab, H, de.ptr);
      if (!P && mtp_weight > 0) kernels::embedding_backward(ptr<int32_t>(mtp_ids), N, ptr<float>(mtp_dnext), c.vocab, H, de.ptr);
      reduce_scatter(de, model::g::kEmbed);
    }
    flights.finish();
    return r;
  }
};

}  // namespace

void check_expert_parallel(const ModelConfig& c, int64_t ep, int64_t shards) {
  if (ep < 1) throw std::invalid_argument("expert parallelism over " + std::to_string(ep) + " ranks: must be at least 1");
  if (c.moe() && c.experts % ep != 0)
    throw std::invalid_argument("expert parallelism over " + std::to_string(ep) + " ranks must divide the number of experts (" +
                                std::to_string(c.experts) + ")");
  if (ep > 1 && shards % ep != 0)
    throw std::invalid_argument("expert parallelism over " + std::to_string(ep) + " ranks must divide the FSDP group (" +
                                std::to_string(shards) + " ranks)");
}

StepResult forward_backward(const ParamSet& params, const Batch& b, const StepOptions& opt, MemoryAccountant& mem,
                            std::unique_ptr<ParamSet>* grads) {
  const int64_t ep = opt.expert_parallel;
  check_expert_parallel(params.config(), ep, params.shards());
  VirtualCollectives planned_ep(ep);
  Collectives* ep_group = opt.ep_group;
  if (ep > 1 && !ep_group) {
    if (!mem.planning())
      throw std::invalid_argument("expert parallelism needs the group of ranks that exchange tokens");
    ep_group = &planned_ep;
  }
  if (ep > 1 && ep_group->size() != ep)
    throw std::invalid_argument("the expert-parallel group has " + std::to_string(ep_group->size()) + " ranks, not " +
                                std::to_string(ep));
  if (opt.update && grads && *grads)
    throw std::invalid_argument("the gradients go to the optimizer as the backward completes them (update in backward): "
                                "there is no gradient set to accumulate into");
  if (!opt.update && !grads) throw std::invalid_argument("forward_backward: no gradient set to fill");
  if (opt.mtp_weight < 0) throw std::invalid_argument("--mtp-weight must be >= 0");
  if (opt.mtp_weight > 0 && params.config().mtp_layers == 0)
    throw std::invalid_argument("--mtp-weight " + (std::ostringstream() << opt.mtp_weight).str() + ": the model '" +
                                params.config().name + "' has no multi-token-prediction layer (use a preset with "
                                "'+mtp', e.g. small+mtp, or a config.json with num_nextn_predict_layers / "
                                "mtp_num_hidden_layers 1)");
  if (opt.mtp_weight > 0 && opt.update)
    throw std::invalid_argument("--mtp-weight with --update-in-backward is not supported yet (the MTP layer's and the "
                                "LM head's gradients are completed twice in a step): drop one of them");
  Collectives* batch_group = opt.batch_group ? opt.batch_group : opt.comm;
  auto run = [&](auto& r) {
    r.ep = ep;
    r.ep_group = ep_group;
    r.prefetch = opt.prefetch;
    r.pack_weights = opt.pack_weights;
    r.delta_rule_bf16_products = opt.delta_rule_bf16_products;
    r.piece_bytes = opt.gather_piece_bytes;
    r.vocab_piece_bytes = opt.vocab_piece_bytes;
    r.sink = opt.update;
    r.mtp_weight = opt.mtp_weight;
    return r.forward_backward(opt.remat, grads);
  };
  if (opt.compute == DType::F32) {
    Runner<float> r(params, b, mem, opt.comm, batch_group);
    return run(r);
  }
  Runner<bf16> r(params, b, mem, opt.comm, batch_group);
  return run(r);
}

void sum_over_replicas(ParamSet& grads, Collectives& replicas, MemoryAccountant& mem) {
  if (replicas.size() <= 1) return;
  for (auto& g : grads.all()) {
    const int64_t n = g.tensor.numel();
    Buffer scratch = mem.allocate_n<float>(static_cast<size_t>(replicas.all_reduce_scratch_elems(n)),
                                           MemCategory::Workspace, "replica_all_reduce");
    if (!mem.planning()) replicas.all_reduce_sum(g.tensor.as<float>(), n, ptr<float>(scratch));
  }
}

StepResult forward_only(const ParamSet& params, const Batch& b, DType compute, MemoryAccountant& mem, float* logits,
                        Collectives* comm) {
  // Every rank evaluates the same batch here: nothing is summed over ranks.
  if (compute == DType::F32) return Runner<float>(params, b, mem, comm, nullptr).forward_only(logits);
  return Runner<bf16>(params, b, mem, comm, nullptr).forward_only(logits);
}

}  // namespace hs::train
