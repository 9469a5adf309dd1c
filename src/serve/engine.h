// The server's scheduler (docs/serving.md): one thread owns the Decoder and runs, over and over, a pass that
//   1. frees the slots of requests that ended outside it (a stop string, a client gone),
//   2. admits queued requests into free slots, restoring each one's longest cached prefix (PrefixCache),
//   3. prefills up to `prefill_chunk` prompt tokens (64 at a time, on the delta rule's chunk edges, each edge kept
//      in the prefix cache), a long prompt over several passes,
//   4. runs one decode step for every request past its prompt, all slots at once,
// so a long prompt never stalls the streams already running and each request ends on its own stop condition.
// Request threads (the HTTP handlers) submit Jobs and read their tokens as they come.
//
// With speculative decoding (EngineOptions::draft > 0, serve --speculative mtp) step 4 is generate_speculative's
// step (infer/speculative.h) over the decoding requests: the MTP layer drafts `draft` tokens for each, one
// Decoder::verify checks all of them, each request keeps its longest agreeing prefix and the model's next token
// (greedy), or follows the rejection rule with its own generator (sampled), and the MTP layer catches up on the kept
// positions. Prompts go through the MTP layer too, one position behind the decoder (its position t reads the token
// t + 1), so that the prefix cache's chunks hold its part of the state as well (prefix_cache.h).
#pragma once
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/memory.h"
#include "infer/decoder.h"
#include "infer/generate.h"
#include "infer/speculative.h"
#include "model/params.h"
#include "serve/prefix_cache.h"

namespace hs::serve {

struct EngineOptions {
  int64_t parallel = 4;          // slots: requests decoded together
  int64_t context = 4096;        // positions per slot (prompt + answer)
  int64_t queue = 64;            // requests waiting for a slot beyond the busy ones
  int64_t prefill_chunk = 512;   // prompt tokens per scheduler pass (a multiple of 64)
  size_t cache_bytes = 0;        // prefix cache budget (0: no cache)
  int threads = 0;               // OpenMP threads of the scheduler (0: as the process)
  int64_t draft = 0;             // speculative decoding with the MTP layer: tokens drafted per step (0: off)
};

// One generated token: its id, and with logprobs its log-probability and the most likely alternatives.
struct TokenOut {
  int32_t id = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

// A request inside the engine. The scheduler appends tokens and sets `finished` under `mu` (and notifies `cv`);
// the request's thread reads them and may set `cancel` at any time (the slot is freed at the next pass).
struct Job {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 1;
  infer::Sampling sampling;
  int64_t top_logprobs = -1;  // -1: no logprobs
  std::vector<int32_t> stop_ids;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<TokenOut> tokens;
  bool finished = false;
  std::string finish_reason;  // "stop" (an end id), "length", "cancelled", "error"
  std::string error;
  int64_t cached_tokens = 0;  // prompt tokens restored from the prefix cache
  std::atomic<bool> cancel{false};
};

struct EngineMetrics {
  std::atomic<int64_t> prefill_tokens{0}, decode_tokens{0}, prefill_ns{0}, decode_ns{0}, steps{0};
  std::atomic<int64_t> cache_hits{0}, cache_misses{0}, cached_tokens{0};
  std::atomic<int64_t> busy_slots{0}, queued{0};
  // The longest time between the starts of two consecutive decode steps while requests were decoding: what a prefill
  // between them made the running streams wait (a prompt prefilled whole would show its whole prefill here).
  std::atomic<int64_t> decode_gap_max_ns{0};
  // Speculative decoding: verifications (one per request and step), drafts proposed, and per draft position k
  // (0-based) the verifications whose drafts 1..k+1 were all kept.
  std::atomic<int64_t> spec_verifications{0}, spec_drafted{0};
  std::array<std::atomic<int64_t>, infer::kMaxDraft> spec_accepted{};
};

class Engine {
 public:
  enum class Admit { Ok, Full, Draining };
  // quant: a GGUF model's matrices kept in its quantized blocks (infer::load_gguf_weights; compute fp32), or null.
  Engine(const model::ParamSet& params, DType compute, const EngineOptions& opt, MemoryAccountant& mem,
         const infer::QuantWeights* quant = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a job (its prompt checked by the caller to fit the context with its max_tokens). Full when the slots and
  // the queue are taken, Draining after drain() began.
  Admit submit(std::shared_ptr<Job> job);
  // Stops admitting and waits until every running and queued request has ended.
  void drain();

  const EngineOptions& options() const { return opt_; }
  const EngineMetrics& metrics() const { return metrics_; }
  const PrefixCache* cache() const { return cache_.get(); }
  const infer::Decoder& decoder() const { return dec_; }

 private:
  struct Active {
    std::shared_ptr<Job> job;
    int32_t slot = 0;
    int64_t pos = 0;        // prompt tokens in the slot
    bool started = false;   // the prefix cache was consulted
    int32_t last = 0;       // the last token, fed by the next step
    int64_t generated = 0;
    std::mt19937_64 rng;
    // Speculative decoding: this step's drafts and, sampled, the distributions they were drawn from.
    std::vector<int32_t> drafts;
    std::vector<std::vector<double>> q;
  };
  void loop();
  void pass(std::vector<Active>& active);
  // Samples a token from logits and records it; false when the request ends with it.
  bool emit(Active& a, const float* logits);
  // Records `token` (its logprobs from `logits`); false when the request ends with it.
  bool push(Active& a, int32_t token, const float* logits);
  // Speculative decoding: the MTP layer's prefill of a prompt piece [from, from + m) just prefilled (its hidden
  // rows in phid_ from row 1), and the step of the decoding requests.
  void mtp_prefill(Active& a, int64_t from, int64_t m);
  void speculative_step(const std::vector<Active*>& rows);
  int32_t choose_draft(Active& a, int64_t k, const float* mtp_logits);
  char* slot_row(Buffer& b, int64_t slot) const { return static_cast<char*>(b.data()) + static_cast<size_t>(slot) * hb_; }
  void finish(Active& a, const std::string& reason, const std::string& error = "");

  EngineOptions opt_;
  MemoryAccountant& mem_;
  infer::Decoder dec_;
  size_t hb_ = 0;  // one hidden row in the compute dtype
  std::unique_ptr<infer::MtpDrafter> mtp_;
  std::unique_ptr<PrefixCache> cache_;
  Buffer logits_;
  // Speculative decoding (allocated in this order after logits_, which then has parallel * (draft + 1) rows): the
  // verified rows' hidden states; the MTP layer's step rows (logits, output, input); a prompt piece's hidden rows
  // behind the one the MTP layer still waits on; per slot, that waiting row (h of the last prefilled position) and the
  // MTP logits and output the next draft comes from.
  Buffer hidden_, mlogits_, mhidden_, mh_in_, phid_, pending_, dlogits_, dhidden_;
  std::vector<std::pair<float, int32_t>> scratch_;
  EngineMetrics metrics_;
  std::optional<std::chrono::steady_clock::time_point> last_step_;  // the previous pass's decode step, if it had one

  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<int32_t> free_slots_;
  int64_t running_ = 0;  // jobs in slots
  bool stop_ = false, draining_ = false;
  std::thread thread_;
};

}  // namespace hs::serve
