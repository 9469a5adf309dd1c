// libFuzzer target for the safetensors header parser; built and run by scripts/fuzz.sh, not by CMake.
// Any input must either parse to a layout that tiles the file or throw FormatError; anything else
// (another exception, a sanitizer report, a broken invariant) is a finding.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>

#include "checkpoint/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hs::checkpoint;
  SafetensorsLayout layout;
  try {
    layout = parse_safetensors({reinterpret_cast<const std::byte*>(data), size}, "fuzz");
  } catch (const FormatError&) {
    return 0;
  }
  uint64_t expected = 0;
  std::set<std::string> names;
  for (const TensorInfo& t : layout.tensors) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    if (t.begin != expected || t.end < t.begin || numel * file_dtype_size(t.dtype) != t.nbytes() ||
        !names.insert(t.name).second)
      __builtin_trap();
    expected = t.end;
  }
  if (layout.data_start() + expected != size) __builtin_trap();
  return 0;
}
