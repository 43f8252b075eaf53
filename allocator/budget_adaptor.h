// A budget on one device's allocated bytes (the offload engine's watermark), as an adaptor around
// the device core, RMM style: the core is a stream-ordered caching allocator with a generic soft
// limit (DeviceAllocator::SetSoftLimit); this adaptor says what that level is for and what happens
// at it. It sets the core's soft limit to the budget, asks the core to decline an allocation that
// would pass it, runs the pressure handler (the offload engine, which spills to make room) and then
// allocates regardless, whatever the handler managed: a budget is a target, not a limit.
//
// Why the level lives in the core as a soft limit and not here: the core must check it under the
// lock its Malloc takes anyway (a count read outside it would let two threads pass the level
// together, unannounced, and cost a second synchronisation on every allocation); the core's own
// choices under it (await the pending uses of blocks a spill's copies still read, take a segment
// of the request's size) work on its pending queues and free index; and a fraction is resolved
// when the device first reserves memory, under that lock, before the segment is kept.
//
// Threads and locks: no lock of its own and no state but references, so any thread may call it
// at once. The handler runs in the allocating thread with no allocator lock held, inside a
// CallbackGuard::Call of the front's guard (replacing the handler waits for calls in progress).
#pragma once

#include <cstddef>
#include <functional>

#include "allocator/backend.h"
#include "allocator/callback_guard.h"
#include "allocator/device_allocator.h"

namespace spillway {

// Told that an allocation of `incoming_bytes` (after the size policy's rounding) would take
// `device`'s allocated bytes past its budget, before the allocation is made.
using PressureHandler = std::function<void(int device, size_t incoming_bytes)>;

class BudgetAdaptor {
 public:
  // `upstream`, `guard` and `handler` must outlive the adaptor; `handler` is the front's cell,
  // shared by every device's adaptor.
  BudgetAdaptor(DeviceAllocator& upstream, CallbackGuard& guard,
                const CallbackCell<PressureHandler>& handler)
      : upstream_(upstream), guard_(guard), handler_(handler) {}
  BudgetAdaptor(const BudgetAdaptor&) = delete;
  BudgetAdaptor& operator=(const BudgetAdaptor&) = delete;

  // The budget: `bytes` (SIZE_MAX: none), or `fraction` in (0, 1] of the device's capacity,
  // resolved when the device first reserves memory (see DeviceAllocator::SetSoftLimitFraction).
  // Throws InvalidArgumentError for a fraction out of range.
  void SetWatermark(size_t bytes) { upstream_.SetSoftLimit(bytes); }
  void SetWatermarkFraction(double fraction);

  // Allocates `size` bytes on `stream` through `allocate(MallocOptions)`, which calls the core
  // with `context` and whatever the caller wraps around it (the front dispatches stream errors).
  // `reclaim`: MallocOptions::reclaim of both calls. Inline: it is on every allocation's path.
  template <typename Allocate>
  void* Malloc(size_t size, StreamRef stream, bool reclaim, Allocate&& allocate) {
    void* ptr = allocate(MallocOptions{.decline_past_soft_limit = true, .reclaim = reclaim});
    if (ptr != nullptr) return ptr;
    RelievePressure(size, stream);
    return allocate(MallocOptions{.decline_past_soft_limit = false, .reclaim = reclaim});
  }

 private:
  // Over the budget: the handler makes room before the allocation is made, so allocated bytes
  // stay under the budget rather than pass it and come back down. Not for a request that fits
  // nowhere: `auto` would spill everything for it, for nothing.
  void RelievePressure(size_t size, StreamRef stream);

  DeviceAllocator& upstream_;
  CallbackGuard& guard_;
  const CallbackCell<PressureHandler>& handler_;
};

}  // namespace spillway
