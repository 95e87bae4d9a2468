// The keyed hash behind normlab::dropout's mask (normlab/kernels/dropout.py has the definition and the reference),
// shared by the C++ kernels that drop elements with it: dropout_cpu.cpp and attention_cpu.cpp.
//   keep element i of a contiguous tensor  <=>  h(i) >= threshold(p),
//   h(i) = mix32(mix32(i ^ k0) + k1), (k0, k1) = the two halves of splitmix64(seed).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace normlab {

// Wellons' lowbias32 mixer.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

struct DropoutKey {
  uint32_t k0, k1, threshold;

  // splitmix64's finalizer spreads every seed bit over both keys, so nearby seeds give unrelated masks.
  DropoutKey(int64_t seed, double p) {
    uint64_t z = static_cast<uint64_t>(seed) + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    k0 = static_cast<uint32_t>(z);
    k1 = static_cast<uint32_t>(z >> 32);
    threshold = static_cast<uint32_t>(std::min(std::llround(p * 4294967296.0), 4294967295LL));
  }

  // Branch-free, so loops over i vectorize (8 hashes per AVX2 instruction sequence).
  inline bool keep(int64_t i) const { return mix32(mix32(static_cast<uint32_t>(i) ^ k0) + k1) >= threshold; }
};

}  // namespace normlab
