// The server's prefix cache for the hybrid state (docs/serving.md): what a prompt's prefix left in the decoder's
// caches, kept at chunk edges (every 64 tokens) so that a later prompt starting with the same tokens skips their
// prefill. An attention layer's state at position p is its keys and values of [0, p); a Gated DeltaNet layer's is
// its conv window and delta-rule state at p, which sum up the whole prefix. So the cache is a radix tree of
// chunks: the node of the tokens [0, p) hangs under the node of [0, p - 64) and holds the keys and values of its
// own 64 positions and the recurrent part at p; restoring p reads the keys and values along the path and the last
// node's recurrent part.
//
// With speculative decoding (serve --speculative mtp) a node also holds the MTP layer's part: its keys and values
// and the decoder's hidden state (the final norm's output) that its next position reads. The MTP layer's position t
// reads h_t and the token x_{t+1}, so at the edge p its position p - 1 waits for the token after the chunk; the
// scheduler runs it one position behind the decoder, and the node of [0, p) keeps the MTP rows of [p - 65, p - 1)
// and h_{p-1}, all of which depend on the tokens [0, p) alone.
//
// Memory: every node's bytes come from the MemoryAccountant (MemCategory::Activations, "prefix_cache"), at most
// `budget` bytes together; inserting past it evicts the least recently used leaves first. Not thread-safe: the
// scheduler's thread alone uses it (the counters are atomics, for /metrics).
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "core/memory.h"
#include "infer/decoder.h"
#include "infer/speculative.h"

namespace hs::serve {

class PrefixCache {
 public:
  static constexpr int64_t kChunk = 64;  // the delta rule's chunk: snapshots are taken at multiples of it

  // mtp: the drafter of serve --speculative mtp (its part of each node is kept too), or null; hidden_row_bytes: one
  // row of the decoder's hidden state in the compute dtype (with mtp).
  PrefixCache(size_t budget_bytes, MemoryAccountant& mem, infer::MtpDrafter* mtp = nullptr,
              size_t hidden_row_bytes = 0);

  // Restores into `slot` the longest cached prefix of `ids` that ends on a chunk edge at most `limit` tokens long,
  // and returns its length (0: nothing cached; the slot is then left as it was). Marks the path as used. With the
  // drafter: its keys and values of [0, n - 1) too, and h_{n-1} to mtp_hidden (one row).
  int64_t restore(infer::Decoder& dec, int64_t slot, std::span<const int32_t> ids, int64_t limit,
                  void* mtp_hidden = nullptr);
  // Called with the slot prefilled exactly to `ids.size()`, a chunk edge: keeps the snapshot of [0, ids.size()) if
  // the chunk before it is cached (or it is the first) and it is not cached yet. Evicts to stay within the budget.
  // With the drafter: its slot holds the keys and values of [0, n - 1) and mtp_hidden is h_{n-1} (one row).
  void insert(const infer::Decoder& dec, int64_t slot, std::span<const int32_t> ids,
              const void* mtp_hidden = nullptr);

  size_t budget() const { return budget_; }
  size_t bytes() const { return bytes_.load(); }
  int64_t nodes() const { return nodes_.load(); }
  int64_t evictions() const { return evictions_.load(); }
  // The bytes of one node (a chunk's keys and values plus the recurrent part; with the drafter its 64 rows of keys
  // and values and a hidden row), for planning.
  static size_t node_bytes(const infer::Decoder& dec, const infer::MtpDrafter* mtp = nullptr,
                           size_t hidden_row_bytes = 0);

 private:
  struct Node {
    Node* parent = nullptr;
    std::map<std::vector<int32_t>, std::unique_ptr<Node>> children;  // keyed by the next chunk's tokens
    Buffer kv, recurrent, mtp_kv, mtp_hidden;
    uint64_t used = 0;  // LRU clock
  };
  // The node of the chunks of ids[0, n) (n a multiple of kChunk), or null.
  Node* find(std::span<const int32_t> ids, int64_t n);
  bool evict_one(const Node* keep);

  size_t budget_;
  MemoryAccountant& mem_;
  infer::MtpDrafter* mtp_;
  size_t hidden_row_bytes_;
  Node root_;
  uint64_t clock_ = 0;
  std::atomic<size_t> bytes_{0};
  std::atomic<int64_t> nodes_{0}, evictions_{0};
};

}  // namespace hs::serve
