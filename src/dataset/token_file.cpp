#include "dataset/token_file.h"

#include <fcntl.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>

namespace hs::dataset {

static_assert(std::endian::native == std::endian::little, "token files are little-endian, as is the host they are mapped on");

namespace {

constexpr char kMagic[8] = {'H', 'S', 'T', 'O', 'K', 'E', 'N', 'S'};
constexpr size_t kFixedHeader = 72;  // fields up to and including the checksum
constexpr size_t kAlign = 64;        // the ids start on a cache line
constexpr uint32_t kNoEndOfText = 0xFFFFFFFFu;
constexpr uint32_t kFlagLossMask = 1u;  // version 2's flags (offset 60)

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint64_t fnv1a(uint64_t h, const std::byte* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<uint8_t>(p[i]);
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t data_offset_for(int64_t vocab) {
  const uint64_t end = kFixedHeader + 2 * static_cast<uint64_t>(vocab);
  return (end + kAlign - 1) / kAlign * kAlign;
}

template <typename T>
void put(std::vector<std::byte>& b, size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof v);
}

template <typename T>
T get(const std::byte* p, size_t at) {
  T v;
  std::memcpy(&v, p + at, sizeof v);
  return v;
}

// Bytes [0, 64) and the length table: the checksum covers both.
uint64_t header_checksum(const std::byte* fixed, const std::byte* table, size_t table_bytes) {
  uint64_t h = fnv1a(0xcbf29ce484222325ull, fixed, 64);
  return fnv1a(h, table, table_bytes);
}

std::vector<std::byte> encode_header(const TokenFileHeader& h, const std::vector<uint16_t>& token_bytes) {
  std::vector<std::byte> b(h.data_offset);
  std::memcpy(b.data(), kMagic, 8);
  put<uint32_t>(b, 8, h.version);
  put<uint32_t>(b, 12, h.dtype_bytes);
  put<uint64_t>(b, 16, h.fingerprint);
  put<int64_t>(b, 24, h.vocab_size);
  put<int64_t>(b, 32, h.tokens);
  put<int64_t>(b, 40, h.documents);
  put<int64_t>(b, 48, h.text_bytes);
  put<uint32_t>(b, 56, h.end_of_text.value_or(kNoEndOfText));
  put<uint32_t>(b, 60, h.loss_mask ? kFlagLossMask : 0u);
  std::memcpy(b.data() + kFixedHeader, token_bytes.data(), 2 * token_bytes.size());
  put<uint64_t>(b, 64, header_checksum(b.data(), b.data() + kFixedHeader, 2 * token_bytes.size()));
  return b;
}

std::string hex(uint64_t v) {
  char s[24];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}

// Drops the pages around [p, p + n) from this process's mapping; they are read again from the page cache if touched.
// One fault can map far more than the page it touched: the cached neighbours (fault-around) or the whole large folio
// the page cache holds it in, up to 2 MiB (measured on Linux 6.18 / ext4: releasing only the pages read left the
// resident set growing by the file's size), so the aligned 2 MiB around the range goes.
void release_pages(const std::byte* p, size_t n, const std::byte* map, size_t map_size) {
  if (n == 0) return;
  constexpr uintptr_t kWindow = 2 << 20;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(map), hi = lo + map_size;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t a = std::max(reinterpret_cast<uintptr_t>(p) & ~(kWindow - 1), lo);
  const uintptr_t b = std::min((reinterpret_cast<uintptr_t>(p) + n + kWindow - 1) & ~(kWindow - 1),
                               (hi + page - 1) & ~(page - 1));
  madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED);
}

// The offset just past the last block boundary in `text` (see add_text_file), or 0 when there is none.
size_t last_safe_cut(std::string_view text) {
  for (size_t i = text.size(); i-- > 1;) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (text[i - 1] == '\n' && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))) return i;
  }
  return 0;
}

}  // namespace

TokenFileWriter::TokenFileWriter(const std::filesystem::path& path, Vocabulary vocab, Encoder encoder,
                                 WriterOptions options)
    : file_(path), vocab_(std::move(vocab)), encoder_(std::move(encoder)), options_(std::move(options)) {
  if (vocab_.size < 1 || vocab_.size > (int64_t(1) << 32))
    throw std::invalid_argument("token file '" + path.string() + "': vocabulary size " + std::to_string(vocab_.size) +
                                " is outside 1..2^32");
  if (static_cast<int64_t>(vocab_.token_bytes.size()) != vocab_.size)
    throw std::invalid_argument("token file '" + path.string() + "': the byte-length table has " +
                                std::to_string(vocab_.token_bytes.size()) + " entries for a vocabulary of " +
                                std::to_string(vocab_.size));
  if (vocab_.end_of_text && *vocab_.end_of_text >= vocab_.size)
    throw std::invalid_argument("token file '" + path.string() + "': end-of-text id is outside the vocabulary");
  if (options_.threads <= 0) options_.threads = omp_get_max_threads();
  if (options_.block_bytes == 0) options_.block_bytes = 1;
  header_.version = 1;  // 2 once a document brings a loss mask
  header_.dtype_bytes = vocab_.size <= 65536 ? 2 : 4;
  header_.fingerprint = vocab_.fingerprint;
  header_.vocab_size = vocab_.size;
  header_.end_of_text = vocab_.end_of_text;
  header_.data_offset = data_offset_for(vocab_.size);
  // The counts are known only at the end: a placeholder now, the real header on commit.
  std::vector<std::byte> zeros(header_.data_offset);
  file_.write(zeros);
  start_ = now_seconds();
}

TokenFileWriter::~TokenFileWriter() = default;

void TokenFileWriter::queue(std::string text, bool starts_document) {
  pending_bytes_ += text.size();
  pending_.push_back({std::move(text), starts_document});
  if (pending_bytes_ >= options_.block_bytes) flush();
}

void TokenFileWriter::add_document(std::string_view text) {
  queue(std::string(text), true);
}

void TokenFileWriter::add_text_file(const std::filesystem::path& text) {
  std::ifstream f(text, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read text file '" + text.string() + "'");
  std::string carry;
  bool first = true;
  std::vector<char> buf(options_.block_bytes);
  for (;;) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const size_t got = static_cast<size_t>(f.gcount());
    if (f.bad()) throw std::runtime_error("error reading text file '" + text.string() + "'");
    carry.append(buf.data(), got);
    const bool eof = got < buf.size();
    if (eof) break;
    const size_t cut = last_safe_cut(carry);
    if (cut == 0) continue;  // no boundary yet: read on
    queue(carry.substr(0, cut), first);
    carry.erase(0, cut);
    first = false;
  }
  if (first || !carry.empty()) queue(std::move(carry), first);
}

void TokenFileWriter::flush() {
  if (pending_.empty()) return;
  const int n = static_cast<int>(pending_.size());
  std::vector<std::vector<uint32_t>> ids(static_cast<size_t>(n));
  if (n == 1) {
    ids[0] = encoder_(pending_[0].text, options_.threads);
  } else {
    std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1) num_threads(options_.threads)
    for (int i = 0; i < n; ++i) {
      try {
        ids[static_cast<size_t>(i)] = encoder_(pending_[static_cast<size_t>(i)].text, 1);
      } catch (...) {
#pragma omp critical
        error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
  }
  std::vector<std::byte> out;
  for (int i = 0; i < n; ++i) {
    const Piece& p = pending_[static_cast<size_t>(i)];
    std::vector<uint32_t>& v = ids[static_cast<size_t>(i)];
    if (p.starts_document) {
      if (header_.documents > 0) {
        if (!vocab_.end_of_text)
          throw std::invalid_argument("token file '" + file_.target().string() +
                                      "': the tokenizer has no end-of-text token to separate documents; "
                                      "write one file per document");
        v.insert(v.begin(), *vocab_.end_of_text);
      }
      ++header_.documents;
    }
    out.resize(v.size() * header_.dtype_bytes);
    for (size_t j = 0; j < v.size(); ++j) {
      if (v[j] >= static_cast<uint64_t>(vocab_.size))
        throw std::runtime_error("token file '" + file_.target().string() + "': the tokenizer gave id " +
                                 std::to_string(v[j]) + ", outside its vocabulary of " + std::to_string(vocab_.size));
      if (header_.dtype_bytes == 2) {
        const uint16_t x = static_cast<uint16_t>(v[j]);
        std::memcpy(out.data() + 2 * j, &x, 2);
      } else {
        std::memcpy(out.data() + 4 * j, &v[j], 4);
      }
    }
    file_.write(out);
    header_.tokens += static_cast<int64_t>(v.size());
    header_.text_bytes += static_cast<int64_t>(p.text.size());
    if (has_mask_) mask_.resize(static_cast<size_t>(header_.tokens), 1);
  }
  pending_.clear();
  pending_bytes_ = 0;
  if (options_.progress)
    options_.progress({static_cast<uint64_t>(header_.text_bytes), options_.bytes_total, header_.tokens,
                       header_.documents, now_seconds() - start_});
}

void TokenFileWriter::add_tokens(std::span<const int32_t> ids, std::span<const uint8_t> loss_mask) {
  const std::string name = "token file '" + file_.target().string() + "'";
  if (ids.size() != loss_mask.size())
    throw std::invalid_argument(name + ": a document of " + std::to_string(ids.size()) + " ids came with a loss mask of " +
                                std::to_string(loss_mask.size()) + " entries; give one per id");
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab_.size)
      throw std::invalid_argument(name + ": id " + std::to_string(ids[i]) + " at " + std::to_string(i) +
                                  " is outside the vocabulary of " + std::to_string(vocab_.size));
  flush();  // the documents queued before this one come first
  if (!has_mask_) {
    has_mask_ = true;
    mask_.assign(static_cast<size_t>(header_.tokens), 1);
  }
  std::vector<uint32_t> v;
  if (header_.documents > 0) {
    if (!vocab_.end_of_text)
      throw std::invalid_argument(name + ": the tokenizer has no end-of-text token to separate documents; "
                                         "write one file per document");
    v.push_back(*vocab_.end_of_text);
    mask_.push_back(1);  // the separator ends the previous document and is predicted
  }
  ++header_.documents;
  for (size_t i = 0; i < ids.size(); ++i) {
    v.push_back(static_cast<uint32_t>(ids[i]));
    mask_.push_back(loss_mask[i] != 0 ? 1 : 0);
    header_.text_bytes += vocab_.token_bytes[static_cast<size_t>(ids[i])];
  }
  std::vector<std::byte> out(v.size() * header_.dtype_bytes);
  for (size_t j = 0; j < v.size(); ++j) {
    if (header_.dtype_bytes == 2) {
      const uint16_t x = static_cast<uint16_t>(v[j]);
      std::memcpy(out.data() + 2 * j, &x, 2);
    } else {
      std::memcpy(out.data() + 4 * j, &v[j], 4);
    }
  }
  file_.write(out);
  header_.tokens += static_cast<int64_t>(v.size());
}

TokenFileHeader TokenFileWriter::commit() {
  flush();
  if (has_mask_) {
    header_.version = 2;
    header_.loss_mask = true;
    file_.write(std::as_bytes(std::span<const uint8_t>(mask_)));
  }
  file_.write_at(0, encode_header(header_, vocab_.token_bytes));
  file_.commit();
  return header_;
}

std::shared_ptr<const TokenFile> TokenFile::open(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError("cannot open token file", path, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw TokenFileError("token file '" + path.string() + "' is not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < kFixedHeader) {
    ::close(fd);
    throw TokenFileError("token file '" + path.string() + "' is truncated: " + std::to_string(size) +
                         " bytes, less than the " + std::to_string(kFixedHeader) + "-byte header");
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file open
  if (m == MAP_FAILED) throw IoError("cannot mmap token file", path, err);
  // Training reads windows at random places: no read-ahead of pages that will not be used.
  madvise(m, size, MADV_RANDOM);
  try {
    return std::shared_ptr<const TokenFile>(new TokenFile(path, static_cast<const std::byte*>(m), size));
  } catch (...) {
    ::munmap(m, size);
    throw;
  }
}

TokenFile::TokenFile(std::filesystem::path path, const std::byte* map, size_t size)
    : path_(std::move(path)), map_(map), map_size_(size) {
  const std::string name = "token file '" + path_.string() + "'";
  if (std::memcmp(map_, kMagic, 8) != 0)
    throw TokenFileError(name + " is not a hybridscan token file (no HSTOKENS magic); write one with "
                                "`hybridscan tokenize --tokenizer PATH --text FILE --out DATA`");
  TokenFileHeader& h = header_;
  h.version = get<uint32_t>(map_, 8);
  if (h.version < 1 || h.version > kTokenFileVersion)
    throw TokenFileError(name + " has format version " + std::to_string(h.version) + "; this build reads versions 1 to " +
                         std::to_string(kTokenFileVersion) + " (re-tokenize the text, or use a newer hybridscan)");
  const uint32_t flags = get<uint32_t>(map_, 60);
  if ((h.version == 1 && flags != 0) || (flags & ~kFlagLossMask) != 0)
    throw TokenFileError(name + " has unknown flags " + std::to_string(flags) + " for its version " +
                         std::to_string(h.version) + " (re-tokenize the text)");
  h.loss_mask = (flags & kFlagLossMask) != 0;
  h.dtype_bytes = get<uint32_t>(map_, 12);
  h.fingerprint = get<uint64_t>(map_, 16);
  h.vocab_size = get<int64_t>(map_, 24);
  h.tokens = get<int64_t>(map_, 32);
  h.documents = get<int64_t>(map_, 40);
  h.text_bytes = get<int64_t>(map_, 48);
  const uint32_t eot = get<uint32_t>(map_, 56);
  if (eot != kNoEndOfText) h.end_of_text = eot;
  if (h.vocab_size < 1 || h.vocab_size > (int64_t(1) << 32))
    throw TokenFileError(name + " has a corrupt header: vocabulary size " + std::to_string(h.vocab_size));
  h.data_offset = data_offset_for(h.vocab_size);
  if (map_size_ < h.data_offset)
    throw TokenFileError(name + " is truncated: " + std::to_string(map_size_) + " bytes, less than its " +
                         std::to_string(h.data_offset) + "-byte header");
  if (get<uint64_t>(map_, 64) != header_checksum(map_, map_ + kFixedHeader, 2 * static_cast<size_t>(h.vocab_size)))
    throw TokenFileError(name + " has a corrupt header (checksum mismatch); re-tokenize the text");
  if ((h.dtype_bytes != 2 && h.dtype_bytes != 4) || (h.dtype_bytes == 2 && h.vocab_size > 65536) || h.tokens < 0 ||
      h.documents < 0 || h.text_bytes < 0 || (h.end_of_text && *h.end_of_text >= h.vocab_size))
    throw TokenFileError(name + " has an inconsistent header (dtype, counts or end-of-text id)");
  const uint64_t per_token = h.dtype_bytes + (h.loss_mask ? 1 : 0);
  // (A token count past what the file could hold is refused before multiplying: the product could wrap around.)
  if (static_cast<uint64_t>(h.tokens) > (map_size_ - h.data_offset) / per_token)
    throw TokenFileError(name + " is truncated: its header describes " + std::to_string(h.tokens) + " tokens, more than " +
                         std::to_string(map_size_) + " bytes can hold");
  const uint64_t expected = h.data_offset + static_cast<uint64_t>(h.tokens) * per_token;
  if (map_size_ != expected)
    throw TokenFileError(name + (map_size_ < expected ? " is truncated" : " has trailing bytes") + ": " +
                         std::to_string(map_size_) + " bytes, but its header describes " + std::to_string(h.tokens) +
                         " tokens in " + std::to_string(expected) + " bytes");
  token_bytes_.resize(static_cast<size_t>(h.vocab_size));
  std::memcpy(token_bytes_.data(), map_ + kFixedHeader, 2 * token_bytes_.size());
  release_pages(map_, h.data_offset, map_, map_size_);
}

TokenFile::~TokenFile() { ::munmap(const_cast<std::byte*>(map_), map_size_); }

void TokenFile::read(int64_t begin, int64_t n, int32_t* out) const {
  if (begin < 0 || n < 0 || begin + n > header_.tokens)
    throw std::out_of_range("token file '" + path_.string() + "': tokens [" + std::to_string(begin) + ", " +
                            std::to_string(begin + n) + ") outside its " + std::to_string(header_.tokens));
  const std::byte* p = map_ + header_.data_offset + static_cast<uint64_t>(begin) * header_.dtype_bytes;
  uint32_t bad = 0;
  int64_t bad_at = -1;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t id;
    if (header_.dtype_bytes == 2) id = get<uint16_t>(p, 2 * static_cast<size_t>(i));
    else id = get<uint32_t>(p, 4 * static_cast<size_t>(i));
    if (id >= header_.vocab_size && bad_at < 0) bad = id, bad_at = begin + i;
    out[i] = static_cast<int32_t>(id);
  }
  release_pages(p, static_cast<size_t>(n) * header_.dtype_bytes, map_, map_size_);
  if (bad_at >= 0)
    throw TokenFileError("token file '" + path_.string() + "' is corrupt: token " + std::to_string(bad_at) + " is id " +
                         std::to_string(bad) + ", outside its vocabulary of " + std::to_string(header_.vocab_size));
}

void TokenFile::read_mask(int64_t begin, int64_t n, uint8_t* out) const {
  if (begin < 0 || n < 0 || begin + n > header_.tokens)
    throw std::out_of_range("token file '" + path_.string() + "': mask [" + std::to_string(begin) + ", " +
                            std::to_string(begin + n) + ") outside its " + std::to_string(header_.tokens));
  if (!header_.loss_mask) {
    std::fill_n(out, n, uint8_t{1});
    return;
  }
  const std::byte* p = map_ + header_.data_offset + static_cast<uint64_t>(header_.tokens) * header_.dtype_bytes +
                       static_cast<uint64_t>(begin);
  std::memcpy(out, p, static_cast<size_t>(n));
  release_pages(p, static_cast<size_t>(n), map_, map_size_);
}

void check_token_file(const TokenFile& f, int64_t model_vocab, std::optional<uint64_t> fingerprint,
                      const std::string& tokenizer_label) {
  const TokenFileHeader& h = f.header();
  if (h.vocab_size > model_vocab)
    throw TokenFileError("token file '" + f.path().string() + "' holds ids of a vocabulary of " +
                         std::to_string(h.vocab_size) + ", more than the model's vocab_size " +
                         std::to_string(model_vocab) + "; tokenize the text with the model's own tokenizer");
  if (fingerprint && *fingerprint != h.fingerprint)
    throw TokenFileError("token file '" + f.path().string() + "' was written by a tokenizer with fingerprint " +
                         hex(h.fingerprint) + ", but the model's tokenizer " + tokenizer_label + " has fingerprint " +
                         hex(*fingerprint) + "; re-tokenize with `hybridscan tokenize --tokenizer " + tokenizer_label +
                         "`");
}

void write_raw_tokens(const std::filesystem::path& path, std::span<const uint32_t> ids) {
  AtomicFile f(path);
  f.write(std::as_bytes(ids));
  f.commit();
}

}  // namespace hs::dataset
