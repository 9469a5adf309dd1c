#include "core/memory.h"

#include "core/profile.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <sys/resource.h>

namespace hs {

std::string_view category_name(MemCategory c) {
  switch (c) {
    case MemCategory::Parameters: return "parameters";
    case MemCategory::OptimizerState: return "optimizer_state";
    case MemCategory::Batch: return "batch";
    case MemCategory::Gradients: return "gradients";
    case MemCategory::Activations: return "saved_activations";
    case MemCategory::WeightCasts: return "weight_casts";
    case MemCategory::Workspace: return "workspace";
    case MemCategory::kCount: break;
  }
  return "?";
}

size_t MemorySnapshot::total() const {
  size_t s = 0;
  for (size_t b : bytes) s += b;
  return s;
}
size_t MemorySnapshot::argument() const {
  size_t s = 0;
  for (size_t i = 0; i < kNumMemCategories; ++i)
    if (is_argument(static_cast<MemCategory>(i))) s += bytes[i];
  return s;
}
size_t MemorySnapshot::temp() const { return total() - argument(); }

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = o.data_;
    bytes_ = o.bytes_;
    owner_ = o.owner_;
    id_ = o.id_;
    cat_ = o.cat_;
    mapped_ = o.mapped_;
    o.data_ = nullptr;
    o.bytes_ = 0;
    o.owner_ = nullptr;
    o.id_ = 0;
    o.mapped_ = false;
  }
  return *this;
}

void Buffer::reset() {
  if (owner_) owner_->release(*this);
  data_ = nullptr;
  bytes_ = 0;
  owner_ = nullptr;
  id_ = 0;
  mapped_ = false;
}

namespace {

// Buffers of at least kMappedBytes (64 KiB) get their own anonymous mapping (kept for reuse only within the peak:
// MappingCache below), so that the process
// holds what the accountant counts. From glibc's heap (which main() keeps from shrinking, and which fragments as a
// step's buffers of many sizes come and go) the `small` training step's peak resident set, less a `tiny` run's, was
// 71-206 MiB above its accountant peak at batch 8 x 512 (+17-32%); from mappings of 64 KiB and more it is 5-8 MiB
// (+1.2-1.9%; tests/memory_rss_test.cpp). Each mapping starts on a 2 MiB boundary and asks for transparent huge pages, so a
// large buffer faults in 512 pages at a time (the heap had huge pages too: main.cpp); it ends at the next 4 KiB page.
// Zeroed allocations are still cleared (a fresh mapping reads as zeros already, but pages never touched would not be
// resident: an embedding gradient touches only its batch's rows, so the process would hold less than the accountant
// counts, and a device allocator would not). Under AddressSanitizer everything stays in the heap (its redzones guard
// heap blocks only).
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HS_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(HS_ASAN)
constexpr size_t kMappedBytes = ~size_t{0};
#else
constexpr size_t kMappedBytes = size_t{1} << 16;
#endif
constexpr size_t kHugePage = size_t{2} << 20;
}  // namespace

size_t own_mapping_min_bytes() { return kMappedBytes; }

size_t peak_resident_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return static_cast<size_t>(std::stoull(line.substr(6))) * 1024;  // kB
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<size_t>(u.ru_maxrss) * 1024;
}

namespace {

// A mapping's length: the request rounded up to a size class, 16 classes per power of two (at least whole pages), so
// that buffers whose size varies a little from step to step (an expert's rows) reuse each other's kept mappings. The
// rounding is address space, not memory: pages past what a buffer touches are never resident.
size_t mapped_length(size_t bytes) {
  size_t pow2 = 4096;
  while (pow2 < bytes) pow2 <<= 1;
  const size_t step = std::max<size_t>(4096, pow2 / 16);
  return (bytes + step - 1) / step * step;
}

void* map_buffer(size_t bytes) {
  const size_t len = mapped_length(bytes);
  if (len < kHugePage) {  // no huge page fits: any page boundary will do
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  void* q = mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (q == MAP_FAILED) return nullptr;
  const uintptr_t at = reinterpret_cast<uintptr_t>(q);
  const uintptr_t start = (at + kHugePage - 1) / kHugePage * kHugePage;
  const size_t head = start - at;
  if (head) munmap(q, head);
  munmap(reinterpret_cast<char*>(start) + len, kHugePage - head);
  void* p = reinterpret_cast<void*>(start);
  madvise(p, len, MADV_HUGEPAGE);  // advice only: without it the buffer still works, with 4 KiB pages
  return p;
}

// Freed mappings are kept for the next buffer of the same length (a training step or a decoded token allocates the
// same sizes as the one before, and a fresh mapping costs its page faults and the kernel's clearing again: against
// glibc's heap the `small` training step ran at 0.83x with a fresh mapping per buffer, 0.96x with this cache and the
// size classes of mapped_length; bench/ab_train_step.sh), but only while the mappings held, live and kept, stay within
// the most the process has had live at once: so the resident set still never exceeds the accountants' peak. A new
// mapping that would go beyond it first unmaps kept ones, the largest first.
class MappingCache {
 public:
  void* take(size_t len) {
    std::vector<std::pair<void*, size_t>> drop;
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_ += len;
      peak_ = std::max(peak_, live_);
      auto it = kept_.find(len);
      if (it != kept_.end()) {
        p = it->second;
        kept_.erase(it);
        kept_bytes_ -= len;
      } else {
        while (live_ + kept_bytes_ > peak_ && !kept_.empty()) {
          auto last = std::prev(kept_.end());
          drop.emplace_back(last->second, last->first);
          kept_bytes_ -= last->first;
          kept_.erase(last);
        }
      }
    }
    for (auto& [q, n] : drop) unmap(q, n);
    if (!p) p = map_buffer(len);
    if (!p) {
      std::lock_guard<std::mutex> lock(mu_);
      live_ -= len;
    }
    return p;
  }
  void give_back(void* p, size_t len) {
    std::lock_guard<std::mutex> lock(mu_);
    live_ -= len;
    kept_.emplace(len, p);
    kept_bytes_ += len;
  }

 private:
  static void unmap(void* p, size_t len) {
    if (munmap(p, len) != 0) std::perror("hybridscan: munmap of a freed buffer");
  }
  std::mutex mu_;
  std::multimap<size_t, void*> kept_;
  size_t live_ = 0, kept_bytes_ = 0, peak_ = 0;
};

MappingCache& mappings() {
  static MappingCache* c = new MappingCache;  // never destroyed: buffers may be freed during static destruction
  return *c;
}

}  // namespace

void zero_bytes(void* p, size_t bytes) {
  // A single thread clears ~10 GB/s here while the other waits; split large buffers between the threads.
  constexpr size_t kPiece = size_t{1} << 18;
  const int64_t pieces = static_cast<int64_t>((bytes + kPiece - 1) / kPiece);
#pragma omp parallel for schedule(static) if (pieces > 1)
  for (int64_t i = 0; i < pieces; ++i) {
    const size_t off = static_cast<size_t>(i) * kPiece;
    std::memset(static_cast<unsigned char*>(p) + off, 0, std::min(kPiece, bytes - off));
  }
}

MemoryAccountant::MemoryAccountant(bool planning, size_t largest_tracked)
    : planning_(planning), largest_tracked_(largest_tracked) {}

MemoryAccountant::~MemoryAccountant() = default;

Buffer MemoryAccountant::allocate(size_t bytes, MemCategory cat, std::string_view tag, bool zero) {
  profile::Scope profile_scope(profile::Phase::Allocation, "allocate");
  Buffer b;
  if (!planning_ && bytes > 0) {
    size_t rounded = (bytes + 63) / 64 * 64;
    const bool mapped = bytes >= kMappedBytes;
    void* p = mapped ? mappings().take(mapped_length(bytes)) : std::aligned_alloc(64, rounded);
    if (!p) {
      std::fprintf(stderr, "hybridscan: out of memory allocating %s for '%.*s' (%s live)\n",
                   format_bytes(static_cast<double>(bytes)).c_str(), static_cast<int>(tag.size()),
                   tag.data(), format_bytes(static_cast<double>(live_total())).c_str());
      throw std::bad_alloc();
    }
    if (zero) zero_bytes(p, rounded);
    b.data_ = p;
    b.mapped_ = mapped;
  }
  std::lock_guard<std::mutex> lock(mu_);
  b.bytes_ = bytes;
  b.owner_ = this;
  b.id_ = next_id_++;
  b.cat_ = cat;
  ++n_allocs_;
  size_t ci = static_cast<size_t>(cat);
  live_[ci] += bytes;
  live_total_ += bytes;
  cat_peak_[ci] = std::max(cat_peak_[ci], live_[ci]);
  live_buffers_.emplace(b.id_, LiveBuffer{std::string(tag), cat, bytes});
  if (live_total_ > peak_.total() || n_allocs_ == 1) {
    peak_.bytes = live_;
    peak_.largest = largest_live_locked();
  }
  return b;
}

void MemoryAccountant::release(Buffer& b) {
  profile::Scope profile_scope(profile::Phase::Allocation, "release");
  if (b.data_) {
    if (b.mapped_) mappings().give_back(b.data_, mapped_length(b.bytes_));
    else std::free(b.data_);
  }
  std::lock_guard<std::mutex> lock(mu_);
  size_t ci = static_cast<size_t>(b.cat_);
  live_[ci] -= b.bytes_;
  live_total_ -= b.bytes_;
  live_buffers_.erase(b.id_);
}

std::vector<LiveBuffer> MemoryAccountant::largest_live_locked() const {
  std::vector<LiveBuffer> v;
  v.reserve(live_buffers_.size());
  for (const auto& [id, lb] : live_buffers_) v.push_back(lb);
  size_t k = std::min(largest_tracked_, v.size());
  std::partial_sort(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end(),
                    [](const LiveBuffer& a, const LiveBuffer& b) {
                      return a.bytes != b.bytes ? a.bytes > b.bytes : a.tag < b.tag;
                    });
  v.resize(k);
  return v;
}

size_t MemoryAccountant::live(MemCategory c) const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_[static_cast<size_t>(c)];
}
size_t MemoryAccountant::live_total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_total_;
}
size_t MemoryAccountant::peak_total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_.total();
}
size_t MemoryAccountant::peak(MemCategory c) const {
  std::lock_guard<std::mutex> lock(mu_);
  return cat_peak_[static_cast<size_t>(c)];
}
MemorySnapshot MemoryAccountant::at_peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}
MemorySnapshot MemoryAccountant::now() const {
  std::lock_guard<std::mutex> lock(mu_);
  MemorySnapshot s;
  s.bytes = live_;
  s.largest = largest_live_locked();
  return s;
}
void MemoryAccountant::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_.bytes = live_;
  peak_.largest = largest_live_locked();
  cat_peak_ = live_;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

size_t parse_bytes(std::string_view text) {
  std::string s(text);
  size_t pos = 0;
  double v;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    throw std::invalid_argument("'" + s + "' is not a size: expected a number with an optional unit such as 80GB or 95GiB");
  }
  std::string unit;
  for (size_t i = pos; i < s.size(); ++i)
    if (!std::isspace(static_cast<unsigned char>(s[i]))) unit += static_cast<char>(std::tolower(static_cast<unsigned char>(s[i])));
  double mult;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "kb" || unit == "k") mult = 1e3;
  else if (unit == "mb" || unit == "m") mult = 1e6;
  else if (unit == "gb" || unit == "g") mult = 1e9;
  else if (unit == "tb" || unit == "t") mult = 1e12;
  else if (unit == "kib") mult = 1024.0;
  else if (unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "gib") mult = 1024.0 * 1024 * 1024;
  else if (unit == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else throw std::invalid_argument("unknown size unit '" + unit + "' in '" + s + "' (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)");
  if (!(v >= 0)) throw std::invalid_argument("size '" + s + "' must not be negative");
  return static_cast<size_t>(v * mult);
}

}  // namespace hs
