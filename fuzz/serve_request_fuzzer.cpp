// libFuzzer target for the server's request parser (src/serve/request.h); built and run by scripts/fuzz.sh, not by
// CMake. Any body must parse or throw ApiError with a 400 and an OpenAI error body; anything else (another exception,
// a sanitizer report) is a finding. The first byte chooses the endpoint.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "serve/request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hs::serve;
  if (size == 0) return 0;
  const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 4) {
      case 0: parse_completion(body, Endpoint::Chat); break;
      case 1: parse_completion(body, Endpoint::Completion); break;
      case 2: parse_tokenize(body); break;
      default: parse_detokenize(body);
    }
  } catch (const ApiError& e) {
    if (e.status != 400 || !e.body()["error"]["message"].is_string()) __builtin_trap();
  }
  return 0;
}
