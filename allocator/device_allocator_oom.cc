// DeviceAllocator: the out-of-memory ladder, cheapest step first: what the allocator can do on its
// own (wait for pending stream uses, release cached segments, a small request in large-pool
// space), then what the registered holders (the offload engine) give back, then the error.
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "allocator/device_allocator.h"
#include "allocator/errors.h"
#include "allocator/format.h"

namespace spillway {

BlockId DeviceAllocator::AskHolders(PoolKind kind, StreamRef stream, size_t rounded,
                                    std::unique_lock<std::mutex>& lock,
                                    const TraceContext& context) {
  // Spills for a request that fits nowhere would cost copies now and reloads later for nothing.
  if (!CouldEverFitLocked(kind, stream, rounded)) return kNoBlock;
  const std::vector<FreeMemoryCallback> callbacks = callbacks_();
  // First the least that could serve (what the least new segment needs: spilling 20 MiB for a
  // 2 MiB request costs copies now and reloads later), then twice as much each time while the
  // holders still give memory back: what they free may lie scattered over segments that stay in
  // use, and fit only once more of it is free. The doubling bounds the passes (each one waits for
  // the device) to the logarithm of device memory.
  size_t ask = policy_.LeastSegmentSize(rounded);
  BlockId block = kNoBlock;
  while (block == kNoBlock && !callbacks.empty()) {
    // The holders free through this allocator: the lock must not be held.
    // Bytes freed so far: grows with every free, whatever other threads allocate meanwhile.
    const uint64_t freed_before = bytes_freed_;
    lock.unlock();
    size_t released = 0;
    for (const FreeMemoryCallback& callback : callbacks) {
      released += callback(device_, ask);
      if (released >= ask) break;
    }
    lock.lock();
    // Then everything the allocator can do on its own, once more.
    ProcessEventsLocked();
    block = FindFree(kind, stream, rounded);
    if (block == kNoBlock) block = AllocSegment(kind, stream, rounded, context);
    if (block == kNoBlock) block = Reclaim(kind, stream, rounded, context);
    // Nothing given back (by their word, or by the freed bytes: a holder that says it freed
    // memory but did not must not keep this loop going): asking again cannot help.
    if (released == 0 || bytes_freed_ == freed_before) break;
    ask = ask > std::numeric_limits<size_t>::max() / 2 ? ask : ask * 2;
  }
  return block;
}

bool DeviceAllocator::CouldEverFit(size_t size, StreamRef stream) const {
  std::lock_guard lock(mutex_);
  const size_t rounded = policy_.RoundSize(size);
  return CouldEverFitLocked(policy_.PoolFor(rounded), stream, rounded);
}

bool DeviceAllocator::CouldEverFitLocked(PoolKind kind, StreamRef stream, size_t rounded) const {
  // A new segment is never smaller than the least one that serves (a 512-byte request needs a
  // 2 MiB small-pool segment), whatever the request's own size.
  const size_t least = policy_.LeastSegmentSize(rounded);
  const size_t limit = Limit();
  if (least <= TotalMemory() && (limit == 0 || least <= limit)) return true;
  // Over a limit (one set after memory was reserved, or one below the least segment), a segment
  // already there can still serve, once freed: one large enough that this request may take, of
  // its stream and pool (or of the large pool, for a small request at the edge of memory).
  return std::any_of(segments_.begin(), segments_.end(), [&](const auto& entry) {
    const Segment& segment = entry.second;
    return segment.size >= rounded && segment.stream == stream &&
           (segment.pool == kind || kind == PoolKind::kSmall);
  });
}

BlockId DeviceAllocator::Reclaim(PoolKind kind, StreamRef stream, size_t rounded,
                                 const TraceContext& context) {
  // Wait for every pending stream use and retry: a block that was waiting may serve now. Only if
  // none does, give all wholly free cached segments back to the backend and ask it again.
  // (PyTorch's allocator releases first, which turns a block that just became usable into a
  // device free and a device malloc, each synchronizing the device on CUDA.) With nothing
  // pending there is nothing to wait for, and num_sync_all_streams counts real waits only.
  SynchronizeAllEvents();
  BlockId block = FindFree(kind, stream, rounded);
  if (block == kNoBlock) {
    ReleaseCachedSegments(std::numeric_limits<size_t>::max());
    block = AllocSegment(kind, stream, rounded, context);
  }
  // Beyond PyTorch's allocator: a small request that still has nowhere to go takes free space in
  // a large-pool segment of its stream (split by the large pool's rules) rather than fail, or
  // make the offload engine spill, while megabytes sit free there. Only here, at the edge of
  // memory: it pins that segment, and PyTorch's pool separation is what keeps fragmentation low
  // the rest of the time.
  if (block == kNoBlock && kind == PoolKind::kSmall) {
    block = FindFree(PoolKind::kLarge, stream, rounded);
  }
  return block;
}

void DeviceAllocator::ThrowOutOfMemory(size_t requested, size_t rounded) {
  ++stats_.num_ooms;
  const MemInfo info = backend_.mem_info(device_);
  Trace(TraceAction::kOom, info.free_bytes, requested, 0, nullptr);
  const std::string message = absl::StrFormat(
      "Spillway: out of memory on device %d: tried to allocate %s (rounded to %s). Allocated %s, "
      "reserved %s, limit %s; the device has %s free of %s; largest cached free block %s.",
      device_, FormatBytes(requested), FormatBytes(rounded),
      FormatBytes(static_cast<size_t>(stats_.allocated_bytes.all().current)),
      FormatBytes(static_cast<size_t>(stats_.reserved_bytes.all().current)),
      Limit() == 0 ? std::string("none") : FormatBytes(Limit()), FormatBytes(info.free_bytes),
      FormatBytes(info.total_bytes), FormatBytes(LargestFreeBlockLocked()));
  throw OutOfMemoryError(message, requested, device_);
}

}  // namespace spillway
