// What the c10 CUDA allocator adapter (cuda_allocator.cc) hands torch, converted from the core's
// types: statistics (DeviceStats), snapshots (SnapshotInfo with its segments, trace entries and
// record_function annotations) and the trace contexts torch gathers, both ways. Pure functions of
// their arguments, no state and no locks: the adapter takes the core's copies first.
//
// The c10 types changed across the torch releases the adapter builds against (2.4-2.15): what
// differs is handled here, with torch_compat.h's macros or, where a member's release is
// unverified, with requires-expressions in templates (see c10_convert.cc).
#pragma once

#if defined(SPILLWAY_TORCH_CUDA_ALLOCATOR)

#include <c10/cuda/CUDACachingAllocator.h>

#include <cstddef>
#include <memory>
#include <string>
#include <unordered_set>

#include "allocator/config.h"
#include "allocator/history.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"

namespace spillway::torch_layer {

namespace cca = c10::cuda::CUDACachingAllocator;

// The pool id type moved between namespaces across releases (c10::cuda, then c10); every
// release's releasePool(device, id) takes it, so take it from there.
template <typename T>
struct SecondParameter;
template <typename R, typename C, typename A, typename B>
struct SecondParameter<R (C::*)(A, B)> {
  using type = B;
};
using MempoolId = SecondParameter<decltype(&cca::CUDAAllocator::releasePool)>::type;

// Wraps torch's own context (a c10::GatheredContext, e.g. a CapturedTraceback) so the core can
// store it; AsC10Context takes it back out (null for a context torch did not gather).
TraceContext WrapC10Context(std::shared_ptr<c10::GatheredContext> context);
std::shared_ptr<c10::GatheredContext> AsC10Context(const TraceContext& context);

// torch's DeviceStats; `max_split_size` SIZE_MAX (no limit) reads as -1, as PyTorch's does.
cca::DeviceStats ToC10Stats(const DeviceStats& stats, size_t max_split_size);

// torch's SnapshotInfo of the default pool: the trace entries whose action torch's
// skip_actions names are left out, and so are "annotate" entries on a release whose TraceEntry
// has no such action (before 2.14, where nothing asks for them).
cca::SnapshotInfo ToC10Snapshot(const Snapshot& snap, const AllocatorConfig& config,
                                const std::unordered_set<std::string>& skip_actions);

}  // namespace spillway::torch_layer

#endif  // SPILLWAY_TORCH_CUDA_ALLOCATOR
