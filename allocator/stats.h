// Allocator statistics with PyTorch's names and meanings, so `torch.cuda.memory_stats()` users
// read Spillway's numbers the way they read the default allocator's.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <string>

#include "allocator/size_policy.h"

namespace spillway {

struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;  // accumulated increases
  int64_t freed = 0;      // accumulated decreases

  void Increase(int64_t amount) {
    current += amount;
    allocated += amount;
    peak = std::max(peak, current);
  }
  void Decrease(int64_t amount) {
    current -= amount;
    freed += amount;
  }
  void ResetAccumulated() { allocated = freed = 0; }
  void ResetPeak() { peak = current; }
};

// Index 0: all pools ("all"), 1: small pool, 2: large pool.
struct StatArray {
  std::array<Stat, 3> by_pool;

  // Applies to "all" and to the given pool.
  void Increase(PoolKind pool, int64_t amount) {
    by_pool[0].Increase(amount);
    by_pool[1 + static_cast<int>(pool)].Increase(amount);
  }
  void Decrease(PoolKind pool, int64_t amount) {
    by_pool[0].Decrease(amount);
    by_pool[1 + static_cast<int>(pool)].Decrease(amount);
  }
  const Stat& all() const { return by_pool[0]; }
  const Stat& pool(PoolKind kind) const { return by_pool[1 + static_cast<int>(kind)]; }
};

struct DeviceStats {
  StatArray allocation;      // allocated blocks
  StatArray segment;         // backend allocations
  StatArray active;          // allocated or awaiting stream events
  StatArray inactive_split;  // free blocks inside split segments
  StatArray allocated_bytes;
  StatArray reserved_bytes;
  StatArray active_bytes;
  StatArray inactive_split_bytes;
  StatArray requested_bytes;  // bytes callers asked for, before rounding
  // Only with max_split_size set: allocated blocks / segments of at least max_split_size bytes
  // (PyTorch counts them without a per-pool split).
  Stat oversize_allocations;
  Stat oversize_segments;
  int64_t num_alloc_retries = 0;  // backend allocation retried after releasing cache
  int64_t num_ooms = 0;
  int64_t num_sync_all_streams = 0;
  int64_t num_device_alloc = 0;
  int64_t num_device_free = 0;
  // Freed blocks never reused because a stream that used them could not be waited for (its
  // failure went to the stream-error observer). Current values: a reset leaves them.
  int64_t quarantined_blocks = 0;
  int64_t quarantined_bytes = 0;

  void ResetAccumulated();
  void ResetPeak();
};

// Flattens to the keys of `torch.cuda.memory_stats()`: "allocated_bytes.all.current",
// "segment.small_pool.peak", ..., "oversize_allocations.current", ..., "num_ooms", ...,
// "max_split_size" (the configured value; -1 when unlimited, as PyTorch reports SIZE_MAX), and
// Spillway's "spillway.quarantined_blocks" / "spillway.quarantined_bytes".
std::map<std::string, int64_t> FlattenStats(const DeviceStats& stats, size_t max_split_size);

}  // namespace spillway
