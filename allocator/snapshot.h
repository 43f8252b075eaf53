// A point-in-time view of every segment and block, plus the history ring: the raw material of
// PyTorch-format memory snapshots (built by the torch layer) and of Spillway's own reports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string_view>
#include <vector>

#include "allocator/history.h"
#include "allocator/size_policy.h"

namespace spillway {

enum class BlockState { kActiveAllocated, kActivePendingFree, kInactive };

// PyTorch's spelling: "active_allocated", "active_pending_free", "inactive".
std::string_view BlockStateName(BlockState state);

struct BlockSnapshot {
  uintptr_t address = 0;
  size_t size = 0;
  size_t requested_size = 0;  // 0 when inactive (free)
  BlockState state = BlockState::kInactive;
  TraceContext context;
  TraceCategory category = TraceCategory::kUnknown;  // of a live allocation (SetTraceCategory)
};

struct SegmentSnapshot {
  int device = 0;
  uintptr_t address = 0;
  size_t total_size = 0;
  size_t allocated_size = 0;
  size_t active_size = 0;
  size_t requested_size = 0;
  uint64_t stream = 0;  // StreamRef::id
  PoolKind pool = PoolKind::kSmall;
  TraceContext context;               // of the allocation that made the segment
  std::vector<BlockSnapshot> blocks;  // address order
};

struct Snapshot {
  std::vector<SegmentSnapshot> segments;               // by device, then address
  std::vector<std::vector<TraceEntry>> device_traces;  // one list per device, oldest first
  // Of every device, oldest first (CachingAllocator::RecordAnnotation).
  std::vector<AnnotationEntry> external_annotations;
  // Stream id -> the stream's handle as an integer, for every stream a segment was ever made for
  // (segments and trace entries name streams by id; PyTorch's snapshots name them by handle).
  std::map<uint64_t, uintptr_t> stream_handles;

  // How PyTorch-format snapshots name stream `id`: by its handle (so a default stream reads 0,
  // as in PyTorch's own); an id with no handle (an OOM entry's 0) stays as it is.
  uintptr_t StreamValue(uint64_t id) const {
    const auto it = stream_handles.find(id);
    return it != stream_handles.end() ? it->second : static_cast<uintptr_t>(id);
  }
};

}  // namespace spillway
