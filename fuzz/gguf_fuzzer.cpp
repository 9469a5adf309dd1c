// libFuzzer target for the GGUF header parser (src/gguf/gguf_file.h); built and run by scripts/fuzz.sh
// (scripts/fuzz.sh gguf), not by CMake. Any input must either parse to a layout whose tensors are aligned, inside the
// file, sized as their type and shape say and overlap no other, or throw FormatError; anything else (another
// exception, a sanitizer report, a broken invariant) is a finding.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "gguf/gguf_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hs::gguf;
  GgufLayout layout;
  try {
    layout = parse_gguf({reinterpret_cast<const std::byte*>(data), size}, "fuzz");
  } catch (const FormatError&) {
    return 0;
  }
  if (layout.alignment == 0 || (layout.alignment & (layout.alignment - 1)) != 0) __builtin_trap();
  std::set<std::string> names;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const TensorInfo& t : layout.tensors) {
    if (!names.insert(t.name).second || t.offset % layout.alignment != 0 ||
        layout.data_start + t.offset + t.nbytes > size || t.nbytes != tensor_nbytes(t.type, t.ne, t.name))
      __builtin_trap();
    ranges.emplace_back(t.offset, t.offset + t.nbytes);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t k = 1; k < ranges.size(); ++k)
    if (ranges[k - 1].second > ranges[k].first) __builtin_trap();
  return 0;
}
