// SplitMix64: a fixed, platform-independent 64-bit mixer (deterministic replica hashing,
// synthetic weights). Not for security.
#ifndef MOE_RUNTIME_HASH_H_
#define MOE_RUNTIME_HASH_H_

#include <cstdint>

namespace moe {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace moe

#endif  // MOE_RUNTIME_HASH_H_
