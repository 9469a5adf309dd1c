// Atomic file replacement: write under a temporary name in the target's directory, fsync, rename over
// the target, fsync the directory. A reader of the target sees either the old file or the complete new
// one, never a prefix, even across a crash or power loss.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace hs {

// An operating-system call failed. The message names the operation, the path and strerror(errno).
class IoError : public std::runtime_error {
 public:
  IoError(std::string_view operation, const std::filesystem::path& path, int error_number);
  int error_number() const { return error_number_; }

 private:
  int error_number_;
};

// A file that only appears under its target name on commit(). The temporary is named
// `.<target name>.tmp-<pid>-<random>` and lives beside the target (rename is only atomic within one
// file system). Any failure inside a member function, and destruction before commit(), removes the
// temporary; the target is never touched until the rename.
class AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path target);
  ~AtomicFile();
  AtomicFile(AtomicFile&& other) noexcept;
  AtomicFile& operator=(AtomicFile&& other) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Reserves disk space for `bytes` in all (fallocate, keeping the size), so a disk too small fails
  // now rather than hours into a conversion. A file system without fallocate is not an error.
  void reserve(uint64_t bytes);
  // Appends bytes (buffered; large pieces go straight to the kernel). Throws IoError (ENOSPC, EFBIG, ...).
  void write(std::span<const std::byte> bytes);
  void write(std::string_view text) { write(std::as_bytes(std::span(text.data(), text.size()))); }
  // Replaces bytes already written at `offset` (a header whose counts are known only at the end).
  void write_at(uint64_t offset, std::span<const std::byte> bytes);

  // Flushes, fsyncs and closes: the contents are durable under the temporary name, not yet visible.
  // Lets a multi-file writer finish every file before making any of them visible.
  void finish();
  // finish() if not done, then renames over the target and fsyncs the directory. If only the
  // directory fsync fails the complete file is already in place; the IoError says so.
  void commit();
  // Removes the temporary now (idempotent; a committed file is left alone).
  void discard() noexcept;

  const std::filesystem::path& target() const { return target_; }
  const std::filesystem::path& temp_path() const { return temp_; }
  uint64_t bytes_written() const { return written_; }
  bool committed() const { return committed_; }

 private:
  void flush_buffer();
  void write_fully(const std::byte* data, size_t n);
  [[noreturn]] void fail(std::string_view operation, int error_number);

  std::filesystem::path target_;
  std::filesystem::path temp_;
  int fd_ = -1;
  bool finished_ = false;
  bool committed_ = false;
  uint64_t written_ = 0;
  std::vector<std::byte> buffer_;
};

// Writes a small file (config.json, an index) atomically.
void write_file_atomically(const std::filesystem::path& target, std::string_view contents);

// fsync of a directory, which makes a rename or unlink inside it durable.
void fsync_directory(const std::filesystem::path& dir);

}  // namespace hs
