// Token files: text encoded once by a tokenizer, then memory-mapped by training and evaluation. The format is in
// docs/token_format.md: a small little-endian header (vocabulary fingerprint and size, dtype, counts, the byte count of
// the original text), a table of how many text bytes each id stands for, then the ids, documents separated by the
// end-of-text token.
//
// The writer streams: text is read and encoded in blocks (on all cores), ids are appended to a temporary file that is
// renamed into place only when complete. The reader maps the file and copies out only the windows asked for, dropping
// their pages again, so a file of many GB is read with a flat resident set.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "core/atomic_file.h"

namespace hs::dataset {

// The file is not a valid token file, or does not fit the model or tokenizer it is used with. The message names the
// file, what is wrong and how to fix it.
class TokenFileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What a token file records of the tokenizer that wrote it.
struct Vocabulary {
  uint64_t fingerprint = 0;              // tokenizer::Tokenizer::fingerprint()
  int64_t size = 0;                      // every id is < size
  std::optional<uint32_t> end_of_text;   // the document separator; without one a file holds a single document
  // How many bytes of the original text each id stands for (the length of its token_bytes; the separator, which the
  // writer adds, stands for none). bits per byte = nats / ln 2 / the sum of these over the predicted tokens.
  std::vector<uint16_t> token_bytes;
};

struct TokenFileHeader {
  uint32_t version = 0;
  uint32_t dtype_bytes = 0;  // 2: uint16 ids, 4: uint32 ids
  uint64_t fingerprint = 0;
  int64_t vocab_size = 0;
  int64_t tokens = 0;
  int64_t documents = 0;
  int64_t text_bytes = 0;  // bytes of the original text (separators not counted)
  std::optional<uint32_t> end_of_text;
  uint64_t data_offset = 0;  // where the ids start
  bool loss_mask = false;    // version 2: a loss-mask section follows the ids (one byte per token)
};

// Version 1: header, length table, ids. Version 2 adds flags (bit 0: a loss mask of one byte per token after the ids);
// the writer writes 2 only when a document has a mask, and the reader reads both.
inline constexpr uint32_t kTokenFileVersion = 2;

// Encodes `text` to ids on `threads` threads (1: the calling thread only).
using Encoder = std::function<std::vector<uint32_t>(std::string_view text, int threads)>;

struct WriteProgress {
  uint64_t bytes_done = 0, bytes_total = 0;  // text bytes encoded so far / to encode (0: not known)
  int64_t tokens = 0, documents = 0;
  double seconds = 0;
};

struct WriterOptions {
  int threads = 0;                                  // 0: all OpenMP threads
  size_t block_bytes = size_t(32) << 20;            // text encoded per round (bounds the writer's memory)
  uint64_t bytes_total = 0;                         // for progress only
  std::function<void(const WriteProgress&)> progress;  // after every block; may be empty
};

// Writes a token file: each add_* call appends one document. Nothing appears at `path` until commit(); an exception
// or destruction without commit() leaves no file behind.
class TokenFileWriter {
 public:
  TokenFileWriter(const std::filesystem::path& path, Vocabulary vocab, Encoder encoder, WriterOptions options = {});
  ~TokenFileWriter();
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  // The whole file as one document, read in blocks of options.block_bytes. A block ends just after a newline that
  // is followed by an ASCII letter (the byte-level BPE pre-tokenizers never join a newline with the letter after it,
  // so the ids equal those of encoding the file as one string); a file without such a point is one block.
  void add_text_file(const std::filesystem::path& text);
  // A document held in memory. Short documents are gathered and encoded in parallel, one per thread.
  void add_document(std::string_view text);
  // A pre-tokenized document with its loss mask (loss_mask[i] != 0: predicting ids[i] counts in the loss; as many
  // entries as ids). The file becomes version 2; every other token's mask is 1 (documents added without one, and the
  // separators, which are predicted). Throws std::invalid_argument on a length mismatch or an id outside the
  // vocabulary. Holds one byte per token of the file in memory until commit().
  void add_tokens(std::span<const int32_t> ids, std::span<const uint8_t> loss_mask);
  // Encodes what is pending, writes the header and renames the file into place.
  TokenFileHeader commit();

 private:
  struct Piece {
    std::string text;
    bool starts_document;
  };
  void queue(std::string text, bool starts_document);
  void flush();

  AtomicFile file_;
  Vocabulary vocab_;
  Encoder encoder_;
  WriterOptions options_;
  TokenFileHeader header_;
  std::vector<Piece> pending_;
  size_t pending_bytes_ = 0;
  std::vector<uint8_t> mask_;  // the loss mask, once a document has one (then one byte per token written)
  bool has_mask_ = false;
  double start_ = 0;
};

// A memory-mapped token file, validated on open (header, checksum, size). Ids are checked against the vocabulary
// as they are read.
class TokenFile {
 public:
  // Throws TokenFileError naming the file and the problem (not a token file, truncated, corrupt header, ...).
  static std::shared_ptr<const TokenFile> open(const std::filesystem::path& path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const TokenFileHeader& header() const { return header_; }
  int64_t size() const { return header_.tokens; }
  std::span<const uint16_t> token_bytes() const { return token_bytes_; }
  // Copies ids [begin, begin + n) to out and releases their pages. Throws TokenFileError on an id outside the
  // vocabulary (a corrupt file).
  void read(int64_t begin, int64_t n, int32_t* out) const;
  // Whether the file holds a loss mask (version 2), and its bytes [begin, begin + n) (1: the token is predicted in
  // the loss, 0: not). Without a mask every token counts.
  bool has_mask() const { return header_.loss_mask; }
  void read_mask(int64_t begin, int64_t n, uint8_t* out) const;

 private:
  TokenFile(std::filesystem::path path, const std::byte* map, size_t size);
  std::filesystem::path path_;
  const std::byte* map_ = nullptr;
  size_t map_size_ = 0;
  TokenFileHeader header_;
  std::vector<uint16_t> token_bytes_;
};

// Refuses a token file whose vocabulary does not fit a model of `model_vocab` ids, or (when `fingerprint` is given)
// was written by another tokenizer than the model's (`tokenizer_label` names it in the message).
void check_token_file(const TokenFile& f, int64_t model_vocab, std::optional<uint64_t> fingerprint,
                      const std::string& tokenizer_label);

// The debugging format of `tokenize --raw`: the ids alone, little-endian uint32, written atomically.
void write_raw_tokens(const std::filesystem::path& path, std::span<const uint32_t> ids);

}  // namespace hs::dataset
