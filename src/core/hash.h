// SplitMix64: a fast, well-mixed 64-bit hash, the basis of every counter-based random stream in the engine
// (parameter initialisation, data order) so results depend only on (seed, index), never on thread count or order.
#pragma once
#include <cstdint>

namespace hs {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace hs
