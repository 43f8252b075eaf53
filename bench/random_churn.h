// RandomChurn: the random sizes and victims of the RandomAllocations benchmarks, drawn in the
// timed loop from a generator that lives in registers.
//
// Why not arrays drawn up front: a table big enough not to repeat (64k sizes and victims, 1 MiB)
// streams through the caches on every iteration and evicts the allocator's own metadata, a cost
// that grows with the live set and so distorts exactly the 1k -> 100k comparison the benchmark
// exists for. SplitMix64 costs a few instructions per draw, the same at every size.
#pragma once

#include <cstddef>
#include <cstdint>

namespace spillway::bench {

// SplitMix64 (Steele, Lea, Flood 2014) as a stateless mix: well-spread 64-bit values from
// consecutive inputs. Also what the allocator tests build their byte patterns from.
inline constexpr uint64_t kSplitMix64Step = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio
inline uint64_t SplitMix64(uint64_t x) {
  x += kSplitMix64Step;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

class RandomChurn {
 public:
  RandomChurn(size_t live, size_t max_size, uint64_t seed = 42)
      : live_(live), max_size_(max_size), state_(seed), victim_(Below(live)) {}

  // The slot of `live_ptrs` (`live` entries) to free next, uniform. The victim after it is drawn
  // now and its slot prefetched: the array is the benchmark's own (0.8 MiB of pointers at 100k
  // live), and waiting on it would add to the 100k case a cache miss that is not the allocator's.
  template <typename Vector>
  auto& NextVictimSlot(Vector& live_ptrs) {
    auto& slot = live_ptrs[victim_];
    victim_ = Below(live_);
    __builtin_prefetch(&live_ptrs[victim_], 1);
    return slot;
  }
  // Size of the next allocation, uniform in [1, max_size].
  size_t NextSize() { return 1 + Below(max_size_); }

 private:
  // The SplitMix64 generator: full period, passes BigCrush, no memory.
  uint64_t Next() {
    const uint64_t z = SplitMix64(state_);
    state_ += kSplitMix64Step;
    return z;
  }
  // Uniform in [0, n) by the high half of a 128-bit product (Lemire): no division in the loop.
  size_t Below(size_t n) {
    return static_cast<size_t>((static_cast<unsigned __int128>(Next()) * n) >> 64);
  }

  size_t live_;
  size_t max_size_;
  uint64_t state_;
  size_t victim_;  // drawn one call ahead of NextVictimSlot
};

}  // namespace spillway::bench
