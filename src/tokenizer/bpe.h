// Byte-level BPE merging as Hugging Face's BPE model does it: start from one token per byte, then repeatedly merge
// the adjacent pair with the lowest merge rank (the leftmost of equals) until no adjacent pair has a merge.
#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

namespace hs::tokenizer {

class BpeMerges {
 public:
  // byte_ids[b]: the token of byte b alone.
  explicit BpeMerges(const uint32_t (&byte_ids)[256]);
  // Merge rank `rank` joins (left, right) into `merged`. A pair given twice keeps its last rank, as HF's map does.
  void add(uint32_t left, uint32_t right, uint32_t rank, uint32_t merged);
  void reserve(size_t n);
  size_t size() const { return count_; }

  // Appends the tokens of `piece` (bytes) to out.
  void encode(std::string_view piece, std::vector<uint32_t>& out) const;

  struct Merge {
    uint32_t rank, merged;
  };
  // The merge of (left, right), rank UINT32_MAX when there is none.
  Merge find(uint32_t left, uint32_t right) const {
    const uint64_t key = (static_cast<uint64_t>(left) << 32) | right;
    for (size_t i = slot_of(key);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == key) return {s.rank, s.merged};
      if (s.key == kEmpty) return {UINT32_MAX, 0};
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  struct Slot {
    uint64_t key = kEmpty;
    uint32_t rank = 0, merged = 0;
  };
  size_t slot_of(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  void grow();
  void encode_short(std::string_view piece, std::vector<uint32_t>& out) const;
  void encode_long(std::string_view piece, std::vector<uint32_t>& out) const;

  uint32_t byte_ids_[256];
  std::vector<Slot> slots_;
  size_t mask_ = 0, count_ = 0;
  int shift_ = 64;
};

}  // namespace hs::tokenizer
