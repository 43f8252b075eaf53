// DeviceAllocator's read-side: what a pointer is, statistics, history and snapshots. The
// allocation paths (malloc, free, split/merge, limits) are in device_allocator.cc, pending stream
// uses in device_allocator_events.cc.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "allocator/device_allocator.h"

namespace spillway {

std::optional<AllocationInfo> DeviceAllocator::Lookup(const void* ptr) const {
  std::lock_guard lock(mutex_);
  const BlockId id = allocated_.Find(reinterpret_cast<uintptr_t>(ptr), AddressOf());
  if (id == kNoBlock) return std::nullopt;
  return InfoLocked(arena_[id]);
}

std::optional<AllocationInfo> DeviceAllocator::LookupContaining(const void* ptr) const {
  std::lock_guard lock(mutex_);
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  const auto segment = SegmentContaining(address);
  if (segment == segments_.end()) return std::nullopt;
  for (BlockId id = segment->second.head; id != kNoBlock; id = arena_[id].next) {
    const Block& b = arena_[id];
    if (address >= b.ptr && address < b.ptr + b.size()) {
      return b.allocated ? std::optional(InfoLocked(b)) : std::nullopt;
    }
  }
  return std::nullopt;
}

AllocationInfo DeviceAllocator::InfoLocked(const Block& b) const {
  // Every block of a segment has the segment's stream; the segment holds its handle.
  const auto segment = SegmentContaining(b.ptr);
  return AllocationInfo{.ptr = reinterpret_cast<void*>(b.ptr),
                        .size = b.size(),
                        .requested = b.requested,
                        .device = device_,
                        .stream = segment->second.stream,
                        .pool = b.pool};
}

DeviceAllocator::SegmentMap::const_iterator DeviceAllocator::SegmentContaining(
    uintptr_t address) const {
  auto it = segments_.upper_bound(address);
  if (it == segments_.begin()) return segments_.end();
  --it;
  return address < it->first + it->second.size ? it : segments_.end();
}

std::optional<SegmentRange> DeviceAllocator::SegmentOf(const void* ptr) const {
  std::lock_guard lock(mutex_);
  const auto it = SegmentContaining(reinterpret_cast<uintptr_t>(ptr));
  if (it == segments_.end()) return std::nullopt;
  return SegmentRange{reinterpret_cast<void*>(it->first), it->second.size, device_};
}

std::string DeviceAllocator::DescribeForeign(const void* ptr) const {
  std::lock_guard lock(mutex_);
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  const auto it = SegmentContaining(address);
  if (it == segments_.end()) return "";
  const Segment& segment = it->second;
  for (BlockId id = segment.head; id != kNoBlock; id = arena_[id].next) {
    const Block& b = arena_[id];
    if (address < b.ptr || address >= b.ptr + b.size()) continue;
    // Freed with stream uses still running, a block is neither allocated nor free yet.
    const char* state = b.pending     ? "freed (awaiting stream uses)"
                        : b.allocated ? "allocated"
                                      : "free";
    if (address != b.ptr) {
      return absl::StrFormat("%p points %d bytes into the %s block at %#x on device %d", ptr,
                             address - b.ptr, state, b.ptr, device_);
    }
    return absl::StrFormat(
        "%p is a %s block on device %d (double free, or a pointer freed already)", ptr, state,
        device_);
  }
  return "";
}

DeviceStats DeviceAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void DeviceAllocator::ResetPeakStats() {
  std::lock_guard lock(mutex_);
  stats_.ResetPeak();
}

void DeviceAllocator::ResetAccumulatedStats() {
  std::lock_guard lock(mutex_);
  stats_.ResetAccumulated();
}

void DeviceAllocator::RecordHistory(bool enabled, size_t max_entries) {
  std::lock_guard lock(mutex_);
  if (enabled) {
    history_.Enable(max_entries);
  } else {
    history_.Disable();
  }
}

bool DeviceAllocator::history_enabled() const {
  std::lock_guard lock(mutex_);
  return history_.enabled();
}

void DeviceAllocator::ClearHistory() {
  std::lock_guard lock(mutex_);
  history_.Clear();
}

std::vector<TraceEntry> DeviceAllocator::history() const {
  std::lock_guard lock(mutex_);
  return history_.Entries();
}

void DeviceAllocator::CollectStreamHandles(std::map<uint64_t, uintptr_t>& out) const {
  std::lock_guard lock(mutex_);
  for (const auto& [id, handle] : stream_handles_) out[id] = reinterpret_cast<uintptr_t>(handle);
}

std::vector<SegmentSnapshot> DeviceAllocator::SnapshotSegments() const {
  std::lock_guard lock(mutex_);
  std::vector<SegmentSnapshot> out;
  out.reserve(segments_.size());
  for (const auto& [base, segment] : segments_) {
    SegmentSnapshot s;
    s.device = device_;
    s.address = base;
    s.total_size = segment.size;
    s.stream = segment.stream.id;
    s.pool = segment.pool;
    s.context = segment.context;
    for (BlockId id = segment.head; id != kNoBlock; id = arena_[id].next) {
      const Block& b = arena_[id];
      BlockSnapshot bs;
      bs.address = b.ptr;
      bs.size = b.size();
      bs.requested_size = b.allocated || b.pending ? b.requested : 0;
      bs.state = b.allocated ? BlockState::kActiveAllocated
                 : b.pending ? BlockState::kActivePendingFree
                             : BlockState::kInactive;
      if (const BlockExtras* extras = arena_.extras(id)) {
        bs.context = extras->context;
        bs.category = extras->category;
      }
      if (b.allocated) s.allocated_size += b.size();
      if (bs.state != BlockState::kInactive) s.active_size += b.size();
      s.requested_size += bs.requested_size;
      s.blocks.push_back(std::move(bs));
    }
    out.push_back(std::move(s));
  }
  return out;
}

size_t DeviceAllocator::LargestFreeBlock() const {
  std::lock_guard lock(mutex_);
  return LargestFreeBlockLocked();
}

size_t DeviceAllocator::MetadataBytes() const {
  std::lock_guard lock(mutex_);
  return arena_.capacity() * BlockArena::kBytesPerId +
         allocated_.capacity() * AddressTable::kBytesPerSlot;
}

size_t DeviceAllocator::LargestFreeBlockLocked() const {
  // O(streams), not a walk over every free block: PyTorch asks (cacheInfo) when it sizes cudnn
  // workspaces.
  return std::max(pools_[0].LargestSize(), pools_[1].LargestSize());
}

}  // namespace spillway
