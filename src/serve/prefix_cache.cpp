#include "serve/prefix_cache.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace hs::serve {

PrefixCache::PrefixCache(size_t budget_bytes, MemoryAccountant& mem, infer::MtpDrafter* mtp, size_t hidden_row_bytes)
    : budget_(budget_bytes), mem_(mem), mtp_(mtp), hidden_row_bytes_(hidden_row_bytes) {}

size_t PrefixCache::node_bytes(const infer::Decoder& dec, const infer::MtpDrafter* mtp, size_t hidden_row_bytes) {
  return dec.recurrent_bytes_per_slot() + static_cast<size_t>(kChunk) * dec.kv_bytes_per_position() +
         (mtp ? static_cast<size_t>(kChunk) * mtp->kv_bytes_per_position() + hidden_row_bytes : 0);
}

namespace {
// The MTP layer's positions a node of the edge `end` holds: [end - 65, end - 1), from 0 for the first chunk.
int64_t mtp_from(int64_t end) { return std::max<int64_t>(0, end - PrefixCache::kChunk - 1); }
}  // namespace

PrefixCache::Node* PrefixCache::find(std::span<const int32_t> ids, int64_t n) {
  Node* at = &root_;
  for (int64_t e = 0; e < n && at; e += kChunk) {
    const std::vector<int32_t> key(ids.begin() + e, ids.begin() + e + kChunk);
    auto it = at->children.find(key);
    at = it == at->children.end() ? nullptr : it->second.get();
  }
  return at;
}

int64_t PrefixCache::restore(infer::Decoder& dec, int64_t slot, std::span<const int32_t> ids, int64_t limit,
                             void* mtp_hidden) {
  std::vector<Node*> path;
  Node* at = &root_;
  for (int64_t e = 0; e + kChunk <= std::min<int64_t>(limit, static_cast<int64_t>(ids.size())); e += kChunk) {
    const std::vector<int32_t> key(ids.begin() + e, ids.begin() + e + kChunk);
    auto it = at->children.find(key);
    if (it == at->children.end()) break;
    at = it->second.get();
    path.push_back(at);
  }
  if (path.empty()) return 0;
  const uint64_t now = ++clock_;
  for (size_t i = 0; i < path.size(); ++i) {
    const int64_t from = static_cast<int64_t>(i) * kChunk;
    dec.load_kv(slot, from, from + kChunk, path[i]->kv.data());
    if (mtp_) mtp_->load_kv(slot, mtp_from(from + kChunk), from + kChunk - 1, path[i]->mtp_kv.data());
    path[i]->used = now;
  }
  const int64_t n = static_cast<int64_t>(path.size()) * kChunk;
  dec.load_recurrent(slot, path.back()->recurrent.data(), n);
  if (mtp_ && mtp_hidden) std::memcpy(mtp_hidden, path.back()->mtp_hidden.data(), hidden_row_bytes_);
  return n;
}

void PrefixCache::insert(const infer::Decoder& dec, int64_t slot, std::span<const int32_t> ids,
                         const void* mtp_hidden) {
  const int64_t n = static_cast<int64_t>(ids.size());
  if (n == 0 || n % kChunk != 0 || dec.length(slot) != n) return;
  Node* parent = find(ids, n - kChunk);
  if (!parent) return;  // an earlier chunk was evicted meanwhile: its children would be unreachable
  std::vector<int32_t> key(ids.end() - kChunk, ids.end());
  const uint64_t now = ++clock_;
  for (Node* p = parent; p; p = p->parent) p->used = now;  // the path stays newest: evict elsewhere first
  if (auto it = parent->children.find(key); it != parent->children.end()) {
    it->second->used = now;
    return;
  }
  if (mtp_ && !mtp_hidden) return;  // (a caller's error: the node would lack the drafter's part)
  const size_t need = node_bytes(dec, mtp_, hidden_row_bytes_);
  if (need > budget_) return;
  while (bytes_.load() + need > budget_)
    if (!evict_one(parent)) return;
  auto node = std::make_unique<Node>();
  node->parent = parent;
  node->used = now;
  node->kv = mem_.allocate(static_cast<size_t>(kChunk) * dec.kv_bytes_per_position(), MemCategory::Activations,
                           "prefix_cache.kv");
  node->recurrent = mem_.allocate(dec.recurrent_bytes_per_slot(), MemCategory::Activations, "prefix_cache.state");
  dec.save_kv(slot, n - kChunk, n, node->kv.data());
  dec.save_recurrent(slot, node->recurrent.data());
  if (mtp_) {
    node->mtp_kv = mem_.allocate(static_cast<size_t>(kChunk) * mtp_->kv_bytes_per_position(), MemCategory::Activations,
                                 "prefix_cache.mtp_kv");
    node->mtp_hidden = mem_.allocate(hidden_row_bytes_, MemCategory::Activations, "prefix_cache.mtp_hidden");
    mtp_->save_kv(slot, mtp_from(n), n - 1, node->mtp_kv.data());
    std::memcpy(node->mtp_hidden.data(), mtp_hidden, hidden_row_bytes_);
  }
  parent->children.emplace(std::move(key), std::move(node));
  bytes_ += need;
  ++nodes_;
}

// Drops the least recently used leaf that is not `keep` (an ancestor of a node about to be added); false when there
// is none. A linear walk: the tree holds budget / node bytes nodes, and eviction happens once per inserted chunk.
bool PrefixCache::evict_one(const Node* keep) {
  Node* victim = nullptr;
  std::vector<Node*> stack{&root_};
  while (!stack.empty()) {
    Node* x = stack.back();
    stack.pop_back();
    for (auto& [key, child] : x->children) stack.push_back(child.get());
    if (x != &root_ && x != keep && x->children.empty() && (!victim || x->used < victim->used)) victim = x;
  }
  if (!victim) return false;
  bytes_ -= victim->kv.bytes() + victim->recurrent.bytes() + victim->mtp_kv.bytes() + victim->mtp_hidden.bytes();
  --nodes_;
  ++evictions_;
  Node* parent = victim->parent;
  for (auto it = parent->children.begin(); it != parent->children.end(); ++it)
    if (it->second.get() == victim) {
      parent->children.erase(it);
      break;
    }
  return true;
}

}  // namespace hs::serve
