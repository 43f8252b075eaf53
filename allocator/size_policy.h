// Size classes: how a request is rounded, which pool serves it, how large a new segment is and
// when a free block is split. The rules are PyTorch's (c10/cuda/CUDACachingAllocator.cpp), so
// memory behaviour is directly comparable with the default allocator.
#pragma once

#include <cstddef>

#include "allocator/config.h"

namespace spillway {

inline constexpr size_t kMinBlockSize = 512;                // every size is a multiple of this
inline constexpr size_t kSmallSize = size_t{1} << 20;       // largest small-pool request
inline constexpr size_t kSmallBuffer = size_t{2} << 20;     // small-pool segment size
inline constexpr size_t kLargeBuffer = size_t{20} << 20;    // segment for 1–10 MiB requests
inline constexpr size_t kMinLargeAlloc = size_t{10} << 20;  // from here a request gets its own
inline constexpr size_t kRoundLarge = size_t{2} << 20;      // ... segment rounded to 2 MiB
// Requests above this (1 TiB) are rejected outright as absurd: no device has that much memory.
// It keeps every rounding computation far from overflow and every block size within a Block's
// 32-bit count of kMinBlockSize units (block.h).
inline constexpr size_t kMaxRequest = size_t{1} << 40;

enum class PoolKind : uint8_t { kSmall = 0, kLarge = 1 };

class SizePolicy {
 public:
  explicit SizePolicy(const AllocatorConfig& config)
      : config_(config), max_split_below_large_buffer_(config.max_split_size < kLargeBuffer) {}

  // Block size for a request of `size` (> 0, <= kMaxRequest) bytes.
  size_t RoundSize(size_t size) const;
  static PoolKind PoolFor(size_t rounded) {
    return rounded <= kSmallSize ? PoolKind::kSmall : PoolKind::kLarge;
  }
  // Bytes to ask the backend for when no cached block fits (PyTorch's sizes: a 2 MiB segment
  // for small requests, 20 MiB for 1-10 MiB ones, so the next few come from the same segment).
  static size_t SegmentSize(size_t rounded);
  // The least segment that holds the request: what to ask for when SegmentSize does not fit.
  static size_t SmallestSegmentSize(size_t rounded);
  // The segment to take first for a new request: SegmentSize, unless that would leave a remainder
  // that no request below max_split_size could use.
  size_t FullSegmentSize(size_t rounded) const;
  // The least segment that may serve the request: SmallestSegmentSize, or FullSegmentSize when the
  // least one would break an oversize rule.
  size_t LeastSegmentSize(size_t rounded) const;
  // Whether carving `size` bytes out of a free block of `block_size` leaves a remainder worth
  // keeping as its own free block.
  bool ShouldSplit(PoolKind pool, size_t block_size, size_t size) const;
  // Whether a cached free block of `block_size` may serve a request of `size` (PyTorch's
  // oversize rules: never hand an unsplittable oversize block to a small request, and never
  // waste more than kLargeBuffer on an oversize request).
  bool AcceptsBlock(size_t block_size, size_t size) const;
  size_t max_split_size() const { return config_.max_split_size; }
  // PyTorch's "oversize" (its statistics' oversize_allocations / oversize_segments): a block or
  // segment of at least max_split_size bytes. Never, when max_split_size is unlimited.
  bool IsOversize(size_t size) const { return size >= config_.max_split_size; }

 private:
  size_t RoundUpPower2Division(size_t size, size_t divisions) const;
  AllocatorConfig config_;
  // Only a max_split_size under kLargeBuffer can make PyTorch's shared segment leave an unusable
  // remainder; set once, so the default configuration's malloc skips FullSegmentSize's search.
  bool max_split_below_large_buffer_;
};

}  // namespace spillway
