#include "core/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>

namespace hs {

using namespace std::string_literals;

namespace {

// Small pieces are gathered so a file of many tiny tensors costs few system calls; pieces at least
// this big are written directly.
constexpr size_t kBufferBytes = size_t(1) << 20;

std::string describe(std::string_view operation, const std::filesystem::path& path, int error_number) {
  std::string msg(operation);
  msg += " '";
  msg += path.string();
  msg += "': ";
  msg += std::strerror(error_number);
  return msg;
}

std::filesystem::path directory_of(const std::filesystem::path& p) {
  std::filesystem::path dir = p.parent_path();
  return dir.empty() ? std::filesystem::path(".") : dir;
}

}  // namespace

IoError::IoError(std::string_view operation, const std::filesystem::path& path, int error_number)
    : std::runtime_error(describe(operation, path, error_number)), error_number_(error_number) {}

AtomicFile::AtomicFile(std::filesystem::path target) : target_(std::move(target)) {
  const std::string name = target_.filename().string();
  if (name.empty() || name == "." || name == "..")
    throw std::invalid_argument("AtomicFile: target '"s + target_.string() + "' is not a file path");
  std::random_device rd;
  // O_EXCL never reuses an existing file; a clash of pid and 32 random bits just draws again.
  for (int attempt = 0; attempt < 16; ++attempt) {
    char suffix[64];
    std::snprintf(suffix, sizeof suffix, ".tmp-%ld-%08x", static_cast<long>(::getpid()), static_cast<unsigned>(rd()));
    temp_ = directory_of(target_) / ("." + name + suffix);
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ >= 0) return;
    if (errno != EEXIST) break;
  }
  const int err = errno;
  throw IoError("cannot create temporary file", temp_, err);
}

AtomicFile::~AtomicFile() { discard(); }

AtomicFile::AtomicFile(AtomicFile&& other) noexcept
    : target_(std::move(other.target_)),
      temp_(std::move(other.temp_)),
      fd_(std::exchange(other.fd_, -1)),
      finished_(other.finished_),
      committed_(other.committed_),
      written_(other.written_),
      buffer_(std::move(other.buffer_)) {
  other.temp_.clear();
}

AtomicFile& AtomicFile::operator=(AtomicFile&& other) noexcept {
  if (this != &other) {
    discard();
    target_ = std::move(other.target_);
    temp_ = std::move(other.temp_);
    other.temp_.clear();
    fd_ = std::exchange(other.fd_, -1);
    finished_ = other.finished_;
    committed_ = other.committed_;
    written_ = other.written_;
    buffer_ = std::move(other.buffer_);
  }
  return *this;
}

void AtomicFile::discard() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
  temp_.clear();
  buffer_.clear();
}

void AtomicFile::fail(std::string_view operation, int error_number) {
  const std::filesystem::path where = temp_;
  discard();
  throw IoError(operation, where, error_number);
}

void AtomicFile::reserve(uint64_t bytes) {
  if (fd_ < 0 || finished_)
    throw std::logic_error("AtomicFile: reserve for '"s + target_.string() + "' after finish or failure");
  if (bytes == 0) return;
  int rc;
  do {
    rc = ::fallocate(fd_, FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  const int err = rc == 0 ? 0 : errno;
  if (err != 0 && err != EOPNOTSUPP && err != ENOSYS) fail("cannot reserve "s + std::to_string(bytes) + " bytes for", err);
}

void AtomicFile::write_fully(const std::byte* data, size_t n) {
  while (n > 0) {
    // Linux transfers at most ~2 GiB per call; larger requests are split here rather than relying on
    // short writes.
    const size_t chunk = n < (size_t(1) << 30) ? n : (size_t(1) << 30);
    const ssize_t got = ::write(fd_, data, chunk);
    if (got < 0) {
      if (errno == EINTR) continue;
      fail("cannot write", errno);
    }
    if (got == 0) fail("cannot write", EIO);
    data += got;
    n -= static_cast<size_t>(got);
  }
}

void AtomicFile::flush_buffer() {
  if (buffer_.empty()) return;
  write_fully(buffer_.data(), buffer_.size());
  buffer_.clear();
}

void AtomicFile::write(std::span<const std::byte> bytes) {
  if (fd_ < 0 || finished_)
    throw std::logic_error("AtomicFile: write to '"s + target_.string() + "' after finish or failure");
  if (bytes.empty()) return;
  if (buffer_.size() + bytes.size() > kBufferBytes) flush_buffer();
  if (bytes.size() >= kBufferBytes) {
    write_fully(bytes.data(), bytes.size());
  } else {
    if (buffer_.capacity() < kBufferBytes) buffer_.reserve(kBufferBytes);
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
  }
  written_ += bytes.size();
}

void AtomicFile::write_at(uint64_t offset, std::span<const std::byte> bytes) {
  if (fd_ < 0 || finished_)
    throw std::logic_error("AtomicFile: write_at to '"s + target_.string() + "' after finish or failure");
  if (offset + bytes.size() > written_)
    throw std::logic_error("AtomicFile: write_at past the bytes written to '"s + target_.string() + "'");
  flush_buffer();
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t got = ::pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      fail("cannot write", errno);
    }
    if (got == 0) fail("cannot write", EIO);
    done += static_cast<size_t>(got);
  }
}

void AtomicFile::finish() {
  if (finished_) return;
  if (fd_ < 0) throw std::logic_error("AtomicFile: finish of '"s + target_.string() + "' after failure");
  flush_buffer();
  if (::fsync(fd_) != 0) fail("cannot fsync", errno);
  const int fd = std::exchange(fd_, -1);
  // close() can report a deferred write error (NFS, quotas); treat it like a failed write.
  if (::close(fd) != 0) fail("cannot close", errno);
  buffer_ = {};
  finished_ = true;
}

void AtomicFile::commit() {
  if (committed_) return;
  finish();
  if (::rename(temp_.c_str(), target_.c_str()) != 0) {
    const int err = errno;
    const std::filesystem::path where = temp_;
    discard();
    throw IoError("cannot rename '"s + where.string() + "' to", target_, err);
  }
  committed_ = true;
  temp_.clear();
  try {
    fsync_directory(directory_of(target_));
  } catch (const IoError& e) {
    throw IoError("the file is complete, but the rename may not survive a crash: cannot fsync directory of",
                  target_, e.error_number());
  }
}

void fsync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw IoError("cannot open directory", dir, errno);
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError("cannot fsync directory", dir, err);
  }
  ::close(fd);
}

void write_file_atomically(const std::filesystem::path& target, std::string_view contents) {
  AtomicFile file(target);
  file.write(contents);
  file.commit();
}

}  // namespace hs
