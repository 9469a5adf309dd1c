#include "tokenizer/bpe.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <queue>

namespace hs::tokenizer {

namespace {
// Pieces up to this many bytes merge in place on the stack (quadratic, but with tiny constants); longer ones use a
// heap over a linked list, O(n log n), so that a 100k-byte run costs no more per byte than a word.
constexpr size_t kShortPiece = 48;
}  // namespace

BpeMerges::BpeMerges(const uint32_t (&byte_ids)[256]) {
  std::memcpy(byte_ids_, byte_ids, sizeof byte_ids_);
  reserve(1024);
}

void BpeMerges::reserve(size_t n) {
  size_t cap = std::bit_ceil(std::max<size_t>(16, n * 2));
  if (cap <= slots_.size()) return;
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  shift_ = 64 - std::countr_zero(cap);
  for (const Slot& s : old) {
    if (s.key == kEmpty) continue;
    size_t i = slot_of(s.key);
    while (slots_[i].key != kEmpty) i = (i + 1) & mask_;
    slots_[i] = s;
  }
}

void BpeMerges::grow() { reserve(slots_.size()); }

void BpeMerges::add(uint32_t left, uint32_t right, uint32_t rank, uint32_t merged) {
  if ((count_ + 1) * 2 > slots_.size()) grow();
  const uint64_t key = (static_cast<uint64_t>(left) << 32) | right;
  size_t i = slot_of(key);
  while (slots_[i].key != kEmpty && slots_[i].key != key) i = (i + 1) & mask_;
  if (slots_[i].key == kEmpty) ++count_;
  slots_[i] = Slot{key, rank, merged};
}

void BpeMerges::encode(std::string_view piece, std::vector<uint32_t>& out) const {
  if (piece.size() <= kShortPiece)
    encode_short(piece, out);
  else
    encode_long(piece, out);
}

void BpeMerges::encode_short(std::string_view piece, std::vector<uint32_t>& out) const {
  uint32_t ids[kShortPiece];
  Merge pair[kShortPiece];  // pair[i]: the merge of ids[i], ids[i + 1]
  size_t n = piece.size();
  for (size_t i = 0; i < n; ++i) ids[i] = byte_ids_[static_cast<unsigned char>(piece[i])];
  for (size_t i = 0; i + 1 < n; ++i) pair[i] = find(ids[i], ids[i + 1]);
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i)
      if (pair[i].rank < pair[best].rank) best = i;
    if (pair[best].rank == UINT32_MAX) break;
    ids[best] = pair[best].merged;
    std::memmove(ids + best + 1, ids + best + 2, (n - best - 2) * sizeof ids[0]);
    std::memmove(pair + best, pair + best + 1, (n - best - 2) * sizeof pair[0]);
    --n;
    if (best > 0) pair[best - 1] = find(ids[best - 1], ids[best]);
    if (best + 1 < n) pair[best] = find(ids[best], ids[best + 1]);
  }
  out.insert(out.end(), ids, ids + n);
}

void BpeMerges::encode_long(std::string_view piece, std::vector<uint32_t>& out) const {
  const size_t n = piece.size();
  struct Sym {
    uint32_t id;
    int32_t prev, next;  // -1 at the ends
    bool alive;
  };
  std::vector<Sym> sym(n);
  for (size_t i = 0; i < n; ++i)
    sym[i] = {byte_ids_[static_cast<unsigned char>(piece[i])], static_cast<int32_t>(i) - 1,
              i + 1 < n ? static_cast<int32_t>(i + 1) : -1, true};
  struct Cand {
    uint32_t rank, pos, left, right;  // the pair as it was when pushed; stale once either side changed
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<>> heap;
  const auto push = [&](int32_t pos) {
    if (pos < 0 || sym[pos].next < 0) return;
    const Merge m = find(sym[pos].id, sym[sym[pos].next].id);
    if (m.rank != UINT32_MAX) heap.push({m.rank, static_cast<uint32_t>(pos), sym[pos].id, sym[sym[pos].next].id});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Sym& a = sym[c.pos];
    if (!a.alive || a.next < 0 || a.id != c.left || sym[a.next].id != c.right) continue;
    Sym& b = sym[a.next];
    a.id = find(c.left, c.right).merged;
    b.alive = false;
    a.next = b.next;
    if (b.next >= 0) sym[b.next].prev = static_cast<int32_t>(c.pos);
    push(a.prev);
    push(static_cast<int32_t>(c.pos));
  }
  for (int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
}

}  // namespace hs::tokenizer
