#include "allocator/size_policy.h"

#include <algorithm>
#include <bit>

namespace spillway {
namespace {

size_t RoundUp(size_t value, size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Interval index used by roundup_power2_divisions: log2(size) - log2(1 MiB), clamped to [0, 15].
size_t IntervalIndex(size_t size) {
  const int log_size = std::bit_width(size) - 1;
  const int index = log_size - 20;
  if (index < 0) return 0;
  if (index >= static_cast<int>(kRoundupPower2Intervals)) return kRoundupPower2Intervals - 1;
  return static_cast<size_t>(index);
}

}  // namespace

size_t SizePolicy::RoundUpPower2Division(size_t size, size_t divisions) const {
  if (std::has_single_bit(size)) return size;
  const size_t floor = std::bit_floor(size);
  const size_t step = floor / divisions;
  if (step == 0) return floor << 1;
  const size_t rounded_down = size & ~(step - 1);
  return rounded_down == size ? size : rounded_down + step;
}

size_t SizePolicy::RoundSize(size_t size) const {
  if (size < kMinBlockSize) return kMinBlockSize;
  const size_t divisions = config_.roundup_power2_divisions[IntervalIndex(size)];
  // size > kMinBlockSize * divisions, without the product (any power of two is accepted, and
  // a huge one wrapped it to 0).
  if (divisions > 1 && divisions <= (size - 1) / kMinBlockSize) {
    return RoundUp(RoundUpPower2Division(size, divisions), kMinBlockSize);
  }
  return RoundUp(size, kMinBlockSize);
}

SizePolicy SizePolicy::Uniform(size_t segment_bytes) {
  SizePolicy policy{AllocatorConfig{}};
  // At least one block's worth: 0 stands for PyTorch's rules.
  policy.uniform_segment_ = std::max(RoundUp(segment_bytes, kMinBlockSize), kMinBlockSize);
  return policy;
}

size_t SizePolicy::SegmentSize(size_t rounded) const {
  if (uniform_segment_ != 0) return std::max(rounded, uniform_segment_);
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return RoundUp(rounded, kRoundLarge);
}

size_t SizePolicy::SmallestSegmentSize(size_t rounded) const {
  if (uniform_segment_ != 0) return rounded;
  return rounded <= kSmallSize ? kSmallBuffer : RoundUp(rounded, kRoundLarge);
}

size_t SizePolicy::FullSegmentSize(size_t rounded) const {
  const size_t full = SegmentSize(rounded);
  // PyTorch's shared 20 MiB segment, for a request below a max_split_size under 20 MiB (code may
  // set one; the parser may not), leaves a remainder of max_split_size or more: an oversize block
  // that no request below max_split_size may take, so every such request would reserve 20 MiB.
  // Then the least segment whose every block some request may take: the request's own size, or
  // one that is split into the request and a remainder below max_split_size.
  if (!max_split_below_large_buffer_ || IsOversize(rounded) || !IsOversize(full - rounded)) {
    return full;
  }
  for (size_t size = SmallestSegmentSize(rounded); size < full; size += kRoundLarge) {
    if (AcceptsBlock(size, rounded)) return size;
    if (ShouldSplit(PoolKind::kLarge, size, rounded) && !IsOversize(size - rounded)) return size;
  }
  return full;
}

size_t SizePolicy::LeastSegmentSize(size_t rounded) const {
  const size_t full = FullSegmentSize(rounded);
  const size_t least = SmallestSegmentSize(rounded);
  return least < full && AcceptsBlock(least, rounded) ? least : full;
}

bool SizePolicy::ShouldSplit(PoolKind pool, size_t block_size, size_t size) const {
  const size_t remaining = block_size - size;
  // Uniform: a remainder under 1/64 of the request stays with it (the waste bound in the header).
  if (uniform_segment_ != 0) return remaining >= std::max(kMinBlockSize, size / 64);
  if (pool == PoolKind::kSmall) return remaining >= kMinBlockSize;
  return size < config_.max_split_size && remaining > kSmallSize;
}

bool SizePolicy::AcceptsBlock(size_t block_size, size_t size) const {
  const size_t max_split = config_.max_split_size;
  if (size < max_split && block_size >= max_split) return false;
  if (size >= max_split && block_size >= size + kLargeBuffer) return false;
  return true;
}

}  // namespace spillway
