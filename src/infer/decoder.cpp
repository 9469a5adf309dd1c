#include "infer/decoder.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/settings.h"
#include "kernels/embedding.h"
#include "kernels/gemv.h"
#include "kernels/matmul.h"
#include "kernels/norms.h"
#include "kernels/quant.h"
#include "infer/quant_prefill.h"
#include "model/linear.h"

namespace hs::infer {

using model::LayerKind;

Decoder::Decoder(const model::ParamSet& params, DType compute, int64_t slots, int64_t capacity, MemoryAccountant& mem,
                 int64_t piece, const QuantWeights* quant, int64_t draft)
    : params_(params), cfg_(params.config()), compute_(compute), slots_(slots), capacity_(capacity), piece_(piece),
      draft_(draft), state_slots_(slots * (1 + draft)), mem_(mem), quant_(quant) {
  if (slots <= 0 || capacity <= 0 || piece <= 0)
    throw std::invalid_argument("decoder: slots, capacity and piece must be positive");
  if (draft < 0 || (draft + 1) > kernels::kGemvMaxRows)
    throw std::invalid_argument("decoder: draft must be in [0, " + std::to_string(kernels::kGemvMaxRows - 1) + "]");
  if (params.shards() != 1) throw std::invalid_argument("decoder: the parameters must not be sharded");
  if (compute != DType::F32 && compute != DType::BF16) throw std::invalid_argument("decoder: compute fp32 or bf16");
  const int64_t T = dtype_size(compute), hist = cfg_.conv_width - 1;
  for (int64_t i = 0; i < cfg_.layers; ++i) order_.push_back(model::slot_of_layer(cfg_, i));  // decoder order
  for (const model::LayerSlot& s : order_) {
    model::LayerCache c;
    c.capacity = capacity;
    if (s.kind() == LayerKind::LinearAttention) {
      c.conv = mem.allocate(static_cast<size_t>(state_slots_ * hist * cfg_.conv_dim() * T), MemCategory::Activations,
                            "cache.conv_window", true);
      c.state = mem.allocate_n<float>(static_cast<size_t>(state_slots_ * cfg_.v_heads * cfg_.dk * cfg_.dv),
                                      MemCategory::Activations, "cache.delta_state", true);
    } else {
      const size_t n = static_cast<size_t>(slots * cfg_.kv_heads * capacity * cfg_.head_dim * T);
      c.k = mem.allocate(n, MemCategory::Activations, "cache.keys");
      c.v = mem.allocate(n, MemCategory::Activations, "cache.values");
    }
    caches_.push_back(std::move(c));
  }
  length_.assign(static_cast<size_t>(slots), 0);
  pending_.assign(static_cast<size_t>(slots), 0);
  positions_.resize(static_cast<size_t>(std::max(piece, slots)));
  row_slots_.resize(1);
  if (const char* f = settings::value(settings::Setting::DecodeFused); f && std::strcmp(f, "0") == 0) use_fused_ = false;
  if (quant) {
    if (compute != DType::F32) throw std::invalid_argument("decoder: quantized weights decode with compute fp32");
    if (!FusedStep<float>::supported(params, compute))
      throw std::invalid_argument("decoder: quantized weights need the fused step, which these weights do not allow");
    fused32_ = std::make_unique<FusedStep<float>>(params, order_, caches_, mem, quant);
  } else if (compute == DType::F32 && FusedStep<float>::supported(params, compute))
    fused32_ = std::make_unique<FusedStep<float>>(params, order_, caches_, mem);
  if (compute == DType::BF16 && FusedStep<bf16>::supported(params, compute))
    fused16_ = std::make_unique<FusedStep<bf16>>(params, order_, caches_, mem);
}

size_t Decoder::kv_cache_bytes() const {
  size_t n = 0;
  for (const model::LayerCache& c : caches_) n += c.k.bytes() + c.v.bytes();
  return n;
}

size_t Decoder::recurrent_state_bytes() const {
  size_t n = 0;
  for (const model::LayerCache& c : caches_) n += c.conv.bytes() + c.state.bytes();
  return n;
}

void Decoder::reset(int64_t slot) {
  if (slot < 0 || slot >= slots_) throw std::out_of_range("decoder: slot " + std::to_string(slot) + " does not exist");
  length_[static_cast<size_t>(slot)] = 0;
  pending_[static_cast<size_t>(slot)] = 0;
  if (mem_.planning()) return;
  for (model::LayerCache& c : caches_) {
    if (c.conv.empty()) continue;
    const size_t conv = c.conv.bytes() / static_cast<size_t>(state_slots_),
                 state = c.state.bytes() / static_cast<size_t>(state_slots_);
    zero_bytes(static_cast<char*>(c.conv.data()) + static_cast<size_t>(slot) * conv, conv);
    zero_bytes(static_cast<char*>(c.state.data()) + static_cast<size_t>(slot) * state, state);
  }
}

namespace {
void check_slot(int64_t slot, int64_t slots) {
  if (slot < 0 || slot >= slots) throw std::out_of_range("decoder: slot " + std::to_string(slot) + " does not exist");
}
}  // namespace

size_t Decoder::recurrent_bytes_per_slot() const { return recurrent_state_bytes() / static_cast<size_t>(state_slots_); }

size_t Decoder::kv_bytes_per_position() const {
  return kv_cache_bytes() / static_cast<size_t>(slots_ * capacity_);
}

void Decoder::save_recurrent(int64_t slot, void* out) const {
  check_slot(slot, slots_);
  char* o = static_cast<char*>(out);
  for (const model::LayerCache& c : caches_) {
    if (c.conv.empty()) continue;
    for (const Buffer* b : {&c.conv, &c.state}) {
      const size_t n = b->bytes() / static_cast<size_t>(state_slots_);
      std::memcpy(o, static_cast<const char*>(b->data()) + static_cast<size_t>(slot) * n, n);
      o += n;
    }
  }
}

void Decoder::load_recurrent(int64_t slot, const void* in, int64_t length) {
  check_slot(slot, slots_);
  if (length < 0 || length > capacity_)
    throw std::out_of_range("decoder: length " + std::to_string(length) + " outside the capacity " +
                            std::to_string(capacity_));
  const char* p = static_cast<const char*>(in);
  for (model::LayerCache& c : caches_) {
    if (c.conv.empty()) continue;
    for (Buffer* b : {&c.conv, &c.state}) {
      const size_t n = b->bytes() / static_cast<size_t>(state_slots_);
      std::memcpy(static_cast<char*>(b->data()) + static_cast<size_t>(slot) * n, p, n);
      p += n;
    }
  }
  length_[static_cast<size_t>(slot)] = length;
}

// Keys and values are [slots, nKV, capacity, hd]: one run of positions per head.
void Decoder::save_kv(int64_t slot, int64_t from, int64_t to, void* out) const {
  check_slot(slot, slots_);
  if (from < 0 || to < from || to > capacity_) throw std::out_of_range("decoder: positions outside the capacity");
  char* o = static_cast<char*>(out);
  const size_t row = static_cast<size_t>(cfg_.head_dim * dtype_size(compute_)), n = static_cast<size_t>(to - from) * row;
  for (const model::LayerCache& c : caches_) {
    if (c.k.empty()) continue;
    for (const Buffer* b : {&c.k, &c.v})
      for (int64_t h = 0; h < cfg_.kv_heads; ++h) {
        const size_t at = static_cast<size_t>((slot * cfg_.kv_heads + h) * capacity_ + from) * row;
        std::memcpy(o, static_cast<const char*>(b->data()) + at, n);
        o += n;
      }
  }
}

void Decoder::load_kv(int64_t slot, int64_t from, int64_t to, const void* in) {
  check_slot(slot, slots_);
  if (from < 0 || to < from || to > capacity_) throw std::out_of_range("decoder: positions outside the capacity");
  const char* p = static_cast<const char*>(in);
  const size_t row = static_cast<size_t>(cfg_.head_dim * dtype_size(compute_)), n = static_cast<size_t>(to - from) * row;
  for (model::LayerCache& c : caches_) {
    if (c.k.empty()) continue;
    for (Buffer* b : {&c.k, &c.v})
      for (int64_t h = 0; h < cfg_.kv_heads; ++h) {
        const size_t at = static_cast<size_t>((slot * cfg_.kv_heads + h) * capacity_ + from) * row;
        std::memcpy(static_cast<char*>(b->data()) + at, p, n);
        p += n;
      }
  }
}

void Decoder::prefill(int64_t slot, std::span<const int32_t> ids, float* logits, bool all_logits, void* hidden) {
  if (slot < 0 || slot >= slots_) throw std::out_of_range("decoder: slot " + std::to_string(slot) + " does not exist");
  const int64_t n = static_cast<int64_t>(ids.size());
  int64_t& len = length_[static_cast<size_t>(slot)];
  if (len + n > capacity_)
    throw std::out_of_range("decoder: " + std::to_string(len + n) + " positions exceed the capacity " +
                            std::to_string(capacity_));
  row_slots_[0] = static_cast<int32_t>(slot);
  if (pending_[static_cast<size_t>(slot)])
    throw std::logic_error("decoder: slot " + std::to_string(slot) + " was verified and not accepted");
  if (quant_ && hidden) throw std::invalid_argument("decoder: no hidden states from a quantized model's prefill");
  if (quant_) {
    for (int64_t i = 0; i < n; ++i) {
      const int32_t id = ids[static_cast<size_t>(i)];
      if (id < 0 || id >= cfg_.vocab)
        throw std::out_of_range("decoder: token id " + std::to_string(id) + " is outside the vocabulary of " +
                                std::to_string(cfg_.vocab));
    }
  }
  if (quant_ && quant_prefill_ == QuantPrefill::TokenByToken) {  // a fused step per token (the reference)
    for (int64_t i = 0; i < n; ++i) {
      const int32_t pos = static_cast<int32_t>(len);
      float* out = all_logits ? (logits ? logits + i * cfg_.vocab : nullptr) : i + 1 == n ? logits : nullptr;
      fused32_->run(1, row_slots_.data(), &pos, ids.data() + i, out);
      ++len;
    }
    return;
  }
  for (int64_t off = 0; off < n; off += piece_) {
    const int64_t m = std::min(piece_, n - off);
    for (int64_t i = 0; i < m; ++i) positions_[static_cast<size_t>(i)] = static_cast<int32_t>(len + i);
    // Logits of every token, or only of the last piece's last token.
    float* out = all_logits ? (logits ? logits + off * cfg_.vocab : nullptr) : off + m == n ? logits : nullptr;
    void* hid = hidden ? static_cast<char*>(hidden) + off * cfg_.hidden * dtype_size(compute_) : nullptr;
    if (quant_) run_quant(m, ids.data() + off, out, all_logits);
    else if (compute_ == DType::F32) run<float>(1, m, row_slots_.data(), ids.data() + off, out, all_logits, hid);
    else run<bf16>(1, m, row_slots_.data(), ids.data() + off, out, all_logits, hid);
    len += m;
  }
}

// The checks of a step of n positions per slot (step: n = 1), before the fused step's parallel region (where a throw
// could not reach the caller).
void Decoder::check_step(std::span<const int32_t> slots, int64_t n, std::span<const int32_t> ids) {
  const int64_t B = static_cast<int64_t>(slots.size());
  if (static_cast<int64_t>(ids.size()) != B * n) throw std::invalid_argument("decoder: one id per slot and position");
  for (int64_t b = 0; b < B; ++b) {
    const int32_t s = slots[static_cast<size_t>(b)];
    if (s < 0 || s >= slots_) throw std::out_of_range("decoder: slot " + std::to_string(s) + " does not exist");
    if (pending_[static_cast<size_t>(s)])
      throw std::logic_error("decoder: slot " + std::to_string(s) + " was verified and not accepted");
    if (length_[static_cast<size_t>(s)] + n > capacity_)
      throw std::out_of_range("decoder: slot " + std::to_string(s) + " is full (capacity " + std::to_string(capacity_) +
                              ")");
    for (int64_t j = 0; j < b; ++j)
      if (slots[static_cast<size_t>(j)] == s)
        throw std::invalid_argument("decoder: slot " + std::to_string(s) + " appears twice in one step");
  }
  for (const int32_t id : ids)
    if (id < 0 || id >= cfg_.vocab)
      throw std::out_of_range("decoder: token id " + std::to_string(id) + " is outside the vocabulary of " +
                              std::to_string(cfg_.vocab));
}

void Decoder::verify(std::span<const int32_t> slots, int64_t n, std::span<const int32_t> ids, float* logits,
                     void* hidden) {
  if (n < 1 || n > draft_ + 1)
    throw std::invalid_argument("decoder: verify " + std::to_string(n) + " positions (1 to draft + 1 = " +
                                std::to_string(draft_ + 1) + ")");
  if (!fused()) throw std::invalid_argument("decoder: verification runs on the fused step, which these weights do not allow");
  check_step(slots, n, ids);
  const int64_t B = static_cast<int64_t>(slots.size()), R = B * n, V = cfg_.vocab, H = cfg_.hidden;
  std::vector<int32_t> kv(static_cast<size_t>(R)), pos(static_cast<size_t>(R)), ss(static_cast<size_t>(R)),
      from(static_cast<size_t>(R));
  for (int64_t b = 0; b < B; ++b) {
    const int32_t s = slots[static_cast<size_t>(b)];
    for (int64_t j = 0; j < n; ++j) {
      const size_t r = static_cast<size_t>(b * n + j);
      kv[r] = s;
      pos[r] = static_cast<int32_t>(length_[static_cast<size_t>(s)] + j);
      ss[r] = state_slot(s, j);
      from[r] = j == 0 ? -1 : state_slot(s, j - 1);
    }
  }
  const int64_t per = std::max<int64_t>(1, kernels::kGemvMaxRows / n);  // whole slots per fused step
  const size_t hbytes = static_cast<size_t>(H * dtype_size(compute_));
  for (int64_t b0 = 0; b0 < B; b0 += per) {
    const int64_t r0 = b0 * n, rows = std::min(per, B - b0) * n;
    StepExtras ex;
    ex.state_slots = ss.data() + r0;
    ex.state_from = from.data() + r0;
    ex.chain = n;
    ex.hidden = hidden ? static_cast<char*>(hidden) + static_cast<size_t>(r0) * hbytes : nullptr;
    float* out = logits ? logits + r0 * V : nullptr;
    if (fused32_) fused32_->run(rows, kv.data() + r0, pos.data() + r0, ids.data() + r0, out, &ex);
    else fused16_->run(rows, kv.data() + r0, pos.data() + r0, ids.data() + r0, out, &ex);
  }
  for (int32_t s : slots) pending_[static_cast<size_t>(s)] = n;
}

void Decoder::accept(int64_t slot, int64_t m) {
  check_slot(slot, slots_);
  int64_t& pending = pending_[static_cast<size_t>(slot)];
  if (m < 1 || m > pending)
    throw std::invalid_argument("decoder: accept " + std::to_string(m) + " of the " + std::to_string(pending) +
                                " positions verified in slot " + std::to_string(slot));
  if (m > 1 && !mem_.planning())  // the recurrent part after position m - 1 becomes the slot's
    for (model::LayerCache& c : caches_) {
      if (c.conv.empty()) continue;
      for (Buffer* b : {&c.conv, &c.state}) {
        const size_t per = b->bytes() / static_cast<size_t>(state_slots_);
        char* base = static_cast<char*>(b->data());
        std::memcpy(base + static_cast<size_t>(slot) * per, base + static_cast<size_t>(state_slot(slot, m - 1)) * per,
                    per);
      }
    }
  length_[static_cast<size_t>(slot)] += m;
  pending = 0;
}

void Decoder::step(std::span<const int32_t> slots, std::span<const int32_t> ids, float* logits) {
  const int64_t B = static_cast<int64_t>(slots.size());
  check_step(slots, 1, ids);
  for (int64_t b = 0; b < B; ++b)
    positions_[static_cast<size_t>(b)] = static_cast<int32_t>(length_[static_cast<size_t>(slots[static_cast<size_t>(b)])]);
  if (fused()) {
    // Groups of at most kGemvMaxRows rows, each one fused step.
    const int64_t V = cfg_.vocab;
    for (int64_t b0 = 0; b0 < B; b0 += kernels::kGemvMaxRows) {
      const int64_t n = std::min(kernels::kGemvMaxRows, B - b0);
      float* out = logits ? logits + b0 * V : nullptr;
      if (fused32_) fused32_->run(n, slots.data() + b0, positions_.data() + b0, ids.data() + b0, out);
      else fused16_->run(n, slots.data() + b0, positions_.data() + b0, ids.data() + b0, out);
    }
  } else if (compute_ == DType::F32) {
    run<float>(B, 1, slots.data(), ids.data(), logits, true);
  } else {
    run<bf16>(B, 1, slots.data(), ids.data(), logits, true);
  }
  for (int32_t s : slots) ++length_[static_cast<size_t>(s)];
}

template <typename T>
void Decoder::run(int64_t batch, int64_t seq, const int32_t* slots, const int32_t* ids, float* logits,
                  bool all_logits, void* hidden) {
  const bool P = mem_.planning();
  const int64_t N = batch * seq, H = cfg_.hidden, V = cfg_.vocab;
  // Products of a few rows (a decode step's sequences, an expert's rows, the head) stream each weight once.
  const kernels::SmallRowProducts small_rows;
  Buffer h = mem_.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "h.embed");
  if (!P) {
    const TensorView& e = params_.global(model::g::kEmbed);
    if (e.dtype == DType::F32) kernels::embedding_forward(ids, N, static_cast<const float*>(e.data), V, H, ptr<T>(h));
    else kernels::embedding_forward(ids, N, static_cast<const bf16*>(e.data), V, H, ptr<T>(h));
  }
  for (size_t i = 0; i < order_.size(); ++i) {
    model::LayerContext ctx{cfg_, mem_, batch, seq, positions_.data(), nullptr, 1, false, &caches_[i], slots};
    Buffer out = mem_.allocate_n<T>(static_cast<size_t>(N * H), MemCategory::Workspace, "h.layer_out");
    model::layer_forward<T>(ctx, params_.layer(order_[i]), ptr<T>(h), ptr<T>(out), nullptr);
    h = std::move(out);
  }
  model::Converted<float> wn = model::as_type<float>(params_.global(model::g::kFinalNorm), mem_,
                                                     MemCategory::WeightCasts, "weight_cast");
  if (hidden) {  // the final norm's output at every row
    Buffer rstd_all = mem_.allocate_n<float>(static_cast<size_t>(N), MemCategory::Workspace, "final_norm.rstd");
    if (!P) kernels::rmsnorm_forward(ptr<T>(h), wn.ptr, static_cast<T*>(hidden), ptr<float>(rstd_all), N, H,
                                     float(cfg_.rms_eps));
  }
  // The head runs on the rows whose logits are wanted: all, or each row's last token.
  const int64_t rows = all_logits ? N : batch;
  Buffer last;
  const T* x = ptr<T>(h);
  if (!all_logits && seq > 1) {
    last = mem_.allocate_n<T>(static_cast<size_t>(batch * H), MemCategory::Workspace, "h.last");
    if (!P)
      for (int64_t b = 0; b < batch; ++b)
        std::copy_n(ptr<T>(h) + ((b + 1) * seq - 1) * H, H, ptr<T>(last) + b * H);
    x = ptr<T>(last);
  }
  Buffer xf = mem_.allocate_n<T>(static_cast<size_t>(rows * H), MemCategory::Workspace, "final_norm.out");
  Buffer rstd = mem_.allocate_n<float>(static_cast<size_t>(rows), MemCategory::Workspace, "final_norm.rstd");
  model::Converted<T> wl = model::as_type<T>(params_.global(model::g::kLmHead), mem_, MemCategory::WeightCasts,
                                             "weight_cast");
  if (P || !logits) return;
  kernels::rmsnorm_forward(x, wn.ptr, ptr<T>(xf), ptr<float>(rstd), rows, H, float(cfg_.rms_eps));
  kernels::matmul(ptr<T>(xf), wl.ptr, logits, rows, V, H, false, true);
}

// A piece of a quantized model's prompt (slot row_slots_[0], positions_), layer by layer on the quantized blocks
// (infer/quant_prefill.h): the embedding's rows dequantized on lookup, the head's product on its blocks.
void Decoder::run_quant(int64_t seq, const int32_t* ids, float* logits, bool all_logits) {
  const bool P = mem_.planning();
  const int64_t N = seq, H = cfg_.hidden, V = cfg_.vocab;
  const kernels::SmallRowProducts small_rows;  // a one-token piece's fp32 products on gemv, as the fused step's
  Buffer h = mem_.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "h.embed");
  if (!P) {
    if (quant_->embed) {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < N; ++i)
        kernels::dequantize_row(quant_->embed->type, quant_->embed->row(ids[i]), ptr<float>(h) + i * H, H);
    } else {
      const TensorView& e = params_.global(model::g::kEmbed);
      if (e.dtype == DType::F32) kernels::embedding_forward(ids, N, static_cast<const float*>(e.data), V, H, ptr<float>(h));
      else kernels::embedding_forward(ids, N, static_cast<const bf16*>(e.data), V, H, ptr<float>(h));
    }
  }
  for (size_t i = 0; i < order_.size(); ++i) {
    model::LayerContext ctx{cfg_, mem_, 1, seq, positions_.data(), nullptr, 1, false, &caches_[i], row_slots_.data()};
    Buffer out = mem_.allocate_n<float>(static_cast<size_t>(N * H), MemCategory::Workspace, "h.layer_out");
    quant_layer_prefill(ctx, params_.layer(order_[i]),
                        quant_->layers[static_cast<size_t>(model::layer_of_slot(cfg_, order_[i]))], ptr<float>(h),
                        ptr<float>(out), quant_matmul_);
    h = std::move(out);
  }
  const int64_t rows = all_logits ? N : 1;
  const float* x = ptr<float>(h) + (N - rows) * H;  // every row, or the last
  Buffer xf = mem_.allocate_n<float>(static_cast<size_t>(rows * H), MemCategory::Workspace, "final_norm.out");
  Buffer rstd = mem_.allocate_n<float>(static_cast<size_t>(rows), MemCategory::Workspace, "final_norm.rstd");
  const TensorView& fn = params_.global(model::g::kFinalNorm);
  // The head's scratch is taken whether or not logits are wanted (planning passes none), as the layered path takes
  // its head's buffers.
  const QuantMatrix* head = quant_->lm_head ? &*quant_->lm_head : nullptr;
  const int64_t bytes = head ? kernels::quant_matmul_workspace_bytes<float>(head->type, rows, V, H, quant_matmul_) : 0;
  Buffer ws = mem_.allocate(static_cast<size_t>(bytes), MemCategory::Workspace, "quant_matmul.workspace");
  if (P || !logits) return;
  kernels::rmsnorm_forward(x, static_cast<const float*>(fn.data), ptr<float>(xf), ptr<float>(rstd), rows, H,
                           float(cfg_.rms_eps));
  if (head) {
    kernels::quant_matmul(head->type, ptr<float>(xf), head->data, logits, rows, V, H, 0, 0, quant_matmul_, ws.data(),
                          bytes);
  } else {
    kernels::matmul(ptr<float>(xf), static_cast<const float*>(params_.global(model::g::kLmHead).data), logits, rows, V,
                    H, false, true);
  }
}

}  // namespace hs::infer
