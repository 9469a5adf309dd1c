#include "dataset/token_source.h"

#include <algorithm>
#include <stdexcept>

namespace hs::dataset {

TokenSource TokenSource::in_memory(std::vector<int32_t> ids, std::vector<uint16_t> token_bytes) {
  TokenSource s;
  s.end_ = static_cast<int64_t>(ids.size());
  s.ids_ = std::make_shared<const std::vector<int32_t>>(std::move(ids));
  if (!token_bytes.empty()) {
    s.owned_bytes_ = std::make_shared<const std::vector<uint16_t>>(std::move(token_bytes));
    s.token_bytes_ = *s.owned_bytes_;
  }
  return s;
}

TokenSource TokenSource::mapped(std::shared_ptr<const TokenFile> file) {
  TokenSource s;
  s.end_ = file->size();
  s.token_bytes_ = file->token_bytes();
  s.file_ = std::move(file);
  return s;
}

TokenSource TokenSource::slice(int64_t begin, int64_t end) const {
  if (begin < 0 || begin > end || end > size())
    throw std::out_of_range("token slice [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " +
                            std::to_string(size()) + " tokens");
  TokenSource s = *this;
  s.begin_ = begin_ + begin;
  s.end_ = begin_ + end;
  return s;
}

void TokenSource::read_mask(int64_t begin, int64_t n, uint8_t* out) const {
  if (begin < 0 || n < 0 || begin + n > size())
    throw std::out_of_range("mask [" + std::to_string(begin) + ", " + std::to_string(begin + n) + ") of " +
                            std::to_string(size()));
  if (file_) file_->read_mask(begin_ + begin, n, out);
  else std::fill_n(out, n, uint8_t{1});
}

std::optional<int32_t> TokenSource::document_separator() const {
  if (!file_ || file_->header().documents < 2 || !file_->header().end_of_text) return std::nullopt;
  return static_cast<int32_t>(*file_->header().end_of_text);
}

void TokenSource::read(int64_t begin, int64_t n, int32_t* out) const {
  if (begin < 0 || n < 0 || begin + n > size())
    throw std::out_of_range("tokens [" + std::to_string(begin) + ", " + std::to_string(begin + n) + ") of " +
                            std::to_string(size()));
  if (file_) {
    file_->read(begin_ + begin, n, out);
  } else {
    const int32_t* p = ids_->data() + begin_ + begin;
    std::copy(p, p + n, out);
  }
}

}  // namespace hs::dataset
