// Size classes: how a request is rounded, which pool serves it, how large a new segment is and
// when a free block is split. Two sets of rules:
//  - PyTorch's (c10/cuda/CUDACachingAllocator.cpp), for device memory, so that memory behaviour
//    is directly comparable with the default allocator: two pools, 2 MiB segments for requests up
//    to 1 MiB, 20 MiB for 1-10 MiB, the request rounded to 2 MiB above;
//  - uniform (`Uniform`), for pinned host memory (offload/pinned_pool.h): one pool, segments of
//    at least a given size (pinning costs milliseconds per call: few, large segments), and a
//    remainder split off when it is at least max(512 B, 1/64 of the request), which bounds a
//    block's slack beyond the 512-byte rounding by that much. PyTorch's rounding would waste up
//    to half of the pinned memory its host allocator hands out (powers of two), and its pools
//    would pin 2 MiB for a 512-byte buffer.
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
  // PyTorch's rules, with the configuration's rounding and oversize settings.
  explicit SizePolicy(const AllocatorConfig& config)
      : config_(config), max_split_below_large_buffer_(config.max_split_size < kLargeBuffer) {}
  // The uniform rules: every request in one pool (kLarge), rounded to kMinBlockSize, new segments
  // of max(request, `segment_bytes`).
  static SizePolicy Uniform(size_t segment_bytes);

  // Block size for a request of `size` (> 0, <= kMaxRequest) bytes.
  size_t RoundSize(size_t size) const;
  PoolKind PoolFor(size_t rounded) const {
    return uniform_segment_ == 0 && rounded <= kSmallSize ? PoolKind::kSmall : PoolKind::kLarge;
  }
  // Bytes to ask the backend for when no cached block fits (PyTorch's sizes: a 2 MiB segment
  // for small requests, 20 MiB for 1-10 MiB ones, so the next few come from the same segment).
  size_t SegmentSize(size_t rounded) const;
  // The least segment that holds the request: what to ask for when SegmentSize does not fit.
  size_t SmallestSegmentSize(size_t rounded) const;
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
  // Uniform rules: the least new segment (a multiple of kMinBlockSize); 0: PyTorch's rules.
  size_t uniform_segment_ = 0;
  // Only a max_split_size under kLargeBuffer can make PyTorch's shared segment leave an unusable
  // remainder; set once, so the default configuration's malloc skips FullSegmentSize's search.
  bool max_split_below_large_buffer_;
};

}  // namespace spillway
