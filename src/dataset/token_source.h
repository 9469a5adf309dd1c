// A sequence of token ids that training and evaluation read windows from: held in memory (byte text, or text encoded
// at startup) or a range of a memory-mapped token file. Copies and slices share the storage.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dataset/token_file.h"

namespace hs::dataset {

class TokenSource {
 public:
  TokenSource() = default;
  // `token_bytes[id]`: the bytes of original text id stands for; empty means one byte each (byte tokens).
  static TokenSource in_memory(std::vector<int32_t> ids, std::vector<uint16_t> token_bytes = {});
  static TokenSource mapped(std::shared_ptr<const TokenFile> file);

  int64_t size() const { return end_ - begin_; }
  // Tokens [begin, end) of this source.
  TokenSource slice(int64_t begin, int64_t end) const;
  // Copies tokens [begin, begin + n) of this source to out.
  void read(int64_t begin, int64_t n, int32_t* out) const;
  // Whether the tokens carry a loss mask (a version-2 token file with one), and its bytes [begin, begin + n) (0: a
  // token not predicted in the loss). Without a mask every byte is 1.
  bool has_mask() const { return file_ && file_->has_mask(); }
  void read_mask(int64_t begin, int64_t n, uint8_t* out) const;
  // The bytes of original text token `id` stands for (bits per byte count them).
  int64_t text_bytes(int32_t id) const {
    return token_bytes_.empty() ? 1 : token_bytes_[static_cast<size_t>(id)];
  }
  bool memory_mapped() const { return file_ != nullptr; }
  // The separator written between documents (a token file's end-of-text id) when the tokens hold more than one
  // document; none for a single document, byte tokens or a text encoded at startup. Packed training restarts the
  // model's context after each (train::sample_batch).
  std::optional<int32_t> document_separator() const;

 private:
  std::shared_ptr<const std::vector<int32_t>> ids_;
  std::shared_ptr<const TokenFile> file_;
  std::shared_ptr<const std::vector<uint16_t>> owned_bytes_;
  std::span<const uint16_t> token_bytes_;
  int64_t begin_ = 0, end_ = 0;
};

}  // namespace hs::dataset
