// The memory accountant: every byte the engine allocates for a step goes through it, tagged with a
// category, so live and peak bytes are known per category. In planning mode allocations are virtual
// (no memory is touched, data pointers are null) while the bookkeeping is identical, so running the
// real step schedule over shapes alone gives the exact peak the real run would measure.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace hs {

enum class MemCategory : uint8_t {
  Parameters,      // argument: master weights
  OptimizerState,  // argument: AdamW moments
  Batch,           // argument: token ids / targets of the step
  Gradients,       // temp: parameter gradients
  Activations,     // temp: tensors saved for backward
  WeightCasts,     // temp: weights cast to the compute dtype (or gathered shards) for one sub-layer
  Workspace,       // temp: everything else (intermediates, recompute, kernel scratch)
  kCount
};
constexpr size_t kNumMemCategories = static_cast<size_t>(MemCategory::kCount);
std::string_view category_name(MemCategory c);
// Argument categories live between steps; the others are the step's temp.
constexpr bool is_argument(MemCategory c) {
  return c == MemCategory::Parameters || c == MemCategory::OptimizerState || c == MemCategory::Batch;
}

class MemoryAccountant;

// memset of a large buffer split between the OpenMP threads (one thread alone leaves the others idle).
void zero_bytes(void* p, size_t bytes);
// Buffers of at least this many bytes get their own anonymous mapping, returned to the system when freed, so that the
// resident set follows the accountant; SIZE_MAX when every buffer stays in the heap (under AddressSanitizer).
size_t own_mapping_min_bytes();

// This process's peak resident set (VmHWM of /proc/self/status: the current program image's own, where
// getrusage's ru_maxrss also counts the image before an exec, e.g. a test process that forked it).
size_t peak_resident_bytes();

// An allocation owned by the caller; returns its bytes to the accountant when destroyed.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  ~Buffer() { reset(); }

  void reset();
  void* data() const { return data_; }
  template <typename T> T* as() const { return static_cast<T*>(data_); }
  size_t bytes() const { return bytes_; }
  bool empty() const { return owner_ == nullptr; }
  MemCategory category() const { return cat_; }

 private:
  friend class MemoryAccountant;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemoryAccountant* owner_ = nullptr;
  uint64_t id_ = 0;
  MemCategory cat_ = MemCategory::Workspace;
  bool mapped_ = false;  // its own mapping (munmap), else the heap (free)
};

// The data of a buffer as E*: a free function, so it reads the same inside templates.
template <typename E> E* ptr(const Buffer& b) { return b.as<E>(); }

struct LiveBuffer {
  std::string tag;
  MemCategory category;
  size_t bytes;
};

// Live bytes per category at one moment, plus the largest buffers live then.
struct MemorySnapshot {
  std::array<size_t, kNumMemCategories> bytes{};
  std::vector<LiveBuffer> largest;  // descending by size
  size_t total() const;
  size_t argument() const;
  size_t temp() const;
};

class MemoryAccountant {
 public:
  explicit MemoryAccountant(bool planning = false, size_t largest_tracked = 12);
  ~MemoryAccountant();
  MemoryAccountant(const MemoryAccountant&) = delete;
  MemoryAccountant& operator=(const MemoryAccountant&) = delete;

  // Allocates `bytes` (64-byte aligned; from 64 KiB on, a mapping of its own that is unmapped when freed, so that the
  // resident set follows the live bytes: memory.cpp). zero=true clears the memory (real mode only).
  // Throws std::bad_alloc with a message naming the tag when the system refuses.
  Buffer allocate(size_t bytes, MemCategory cat, std::string_view tag, bool zero = false);
  template <typename T>
  Buffer allocate_n(size_t n, MemCategory cat, std::string_view tag, bool zero = false) {
    return allocate(n * sizeof(T), cat, tag, zero);
  }

  bool planning() const { return planning_; }
  size_t live(MemCategory c) const;
  size_t live_total() const;
  size_t peak_total() const;
  // The largest value each category reached on its own (not necessarily at the global peak).
  size_t peak(MemCategory c) const;
  // Live bytes per category at the moment the total peaked, and the largest buffers then.
  MemorySnapshot at_peak() const;
  MemorySnapshot now() const;
  // Forget the history: peaks restart from what is live now.
  void reset_peak();
  size_t allocations() const { return n_allocs_; }

 private:
  friend class Buffer;
  void release(Buffer& b);
  std::vector<LiveBuffer> largest_live_locked() const;

  bool planning_;
  size_t largest_tracked_;
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  size_t n_allocs_ = 0;
  std::array<size_t, kNumMemCategories> live_{};
  std::array<size_t, kNumMemCategories> cat_peak_{};
  size_t live_total_ = 0;
  MemorySnapshot peak_;
  std::unordered_map<uint64_t, LiveBuffer> live_buffers_;
};

// Human-readable byte counts: "1.50 GiB".
std::string format_bytes(double bytes);
// Parses "80GB", "95GiB", "512MiB", "1e9"; throws std::invalid_argument with the reason.
size_t parse_bytes(std::string_view text);

// Pieces cut one after another from one workspace buffer, each rounded up to 64 bytes (a cache line: every piece
// stays aligned for 512-bit loads). With a null base it only counts, so the same calls first size the buffer.
class Carve {
 public:
  explicit Carve(void* base) : base_(static_cast<char*>(base)) {}
  template <typename E>
  E* take(int64_t n) {
    E* p = base_ ? reinterpret_cast<E*>(base_ + used_) : nullptr;
    used_ += (static_cast<size_t>(n) * sizeof(E) + 63) / 64 * 64;
    return p;
  }
  size_t bytes() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace hs
