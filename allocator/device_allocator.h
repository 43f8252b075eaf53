// The stream-ordered caching core: the caching allocator of one device's memory (pools, best-fit
// search, split and merge, stream-ordered reuse, the memory limit, a soft limit, the
// out-of-memory ladder, statistics and history). The same core serves pinned host memory: over a
// HostMemoryBackend (host_memory_backend.h), with the uniform size policy, it is the offload
// engine's PinnedPool (offload/pinned_pool.h), so that best fit, split, coalesce and the
// event-deferred reuse of freed blocks exist once. What it
// finds out about other work while waiting for streams (a failed copy) it reports to a
// StreamFailureSink and keeps no record of; which allocations are guesses that may not reclaim
// memory, and which are to be declined at the soft limit, is the caller's to say (MallocOptions).
// What the soft limit stands for (the offload engine's budget) and what to do when an allocation
// is declined there is BudgetAdaptor's (budget_adaptor.h), composed around it by the front.
//
// One mutex guards everything; public methods take it, private ones expect it held, and no public
// method calls another, so the mutex need not be recursive. The failure sink and the free-memory
// callbacks are the only code of others it calls: the sink under the mutex (lock order: this
// mutex, then the sink's), the callbacks with the mutex released.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "allocator/address_table.h"
#include "allocator/backend.h"
#include "allocator/block.h"
#include "allocator/config.h"
#include "allocator/history.h"
#include "allocator/size_policy.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "allocator/stream_error_ledger.h"
#include "allocator/stream_slots.h"

namespace spillway {

// Asked, on the out-of-memory path, to give back at least `bytes` of device memory on `device`;
// returns how many bytes it released. Called without any allocator lock held, first for what the
// least new segment needs, then for twice as much each time while it still releases memory and
// the request does not fit.
using FreeMemoryCallback = std::function<size_t(int device, size_t bytes)>;
// Returns the registered callbacks (owned by the multi-device front).
using FreeMemoryCallbacksFn = std::function<std::vector<FreeMemoryCallback>()>;

// How far one Malloc may go.
struct MallocOptions {
  // An allocation that would take allocated bytes past the soft limit is not made: Malloc returns
  // nullptr, so that the caller can relieve the pressure first (outside this lock) and ask again
  // without it. (Checked under the lock Malloc takes anyway: no second lock, no stale count.)
  bool decline_past_soft_limit = false;
  // False: only a cached block or a new segment may serve. When neither does, Malloc throws
  // OutOfMemoryError at once: no cached segment is released, no pending use waited for, no holder
  // asked, and nothing counts it (not num_alloc_retries, not num_ooms, not the history). For
  // guesses that take only the memory there is (see speculative.h).
  bool reclaim = true;
};

struct AllocationInfo {
  void* ptr = nullptr;
  size_t size = 0;       // block size after rounding
  size_t requested = 0;  // caller's size
  int device = 0;
  StreamRef stream;
  PoolKind pool = PoolKind::kSmall;  // the pool of the block's segment
};

struct SegmentRange {
  void* base = nullptr;
  size_t size = 0;
  int device = 0;
};

class DeviceAllocator {
 public:
  // `failures` hears of the failures of stream work found while waiting for stream uses; it must
  // outlive the allocator.
  DeviceAllocator(Backend& backend, int device, const AllocatorConfig& config,
                  FreeMemoryCallbacksFn callbacks, StreamFailureSink& failures);
  // Same, with size classes of the caller's (SizePolicy::Uniform for pinned host memory) instead
  // of PyTorch's under `config`'s settings.
  DeviceAllocator(Backend& backend, int device, SizePolicy policy, const AllocatorConfig& config,
                  FreeMemoryCallbacksFn callbacks, StreamFailureSink& failures);
  ~DeviceAllocator();
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;

  // `size` in [1, kMaxRequest]. Throws OutOfMemoryError when the ladder is exhausted (or, without
  // `options.reclaim`, skipped). Returns nullptr only with `options.decline_past_soft_limit`, over
  // the soft limit. `context` is moved from only when the allocation is made.
  void* Malloc(size_t size, StreamRef stream, TraceContext& context, MallocOptions options);
  // The soft limit: a level of device memory the allocator may pass (unlike the memory limit) but
  // prefers not to. Allocated bytes: Malloc declines an allocation past it when asked to
  // (MallocOptions::decline_past_soft_limit). Reserved bytes: before taking a segment past it,
  // Malloc awaits the pending stream uses of the requesting stream's blocks until one serves (see
  // AwaitPendingUntilFit), and takes a segment of the request's own size when only that stays
  // under it. `bytes` (SIZE_MAX: none, the default), or `fraction` in (0, 1] of the device's
  // capacity (its limit, its total memory when it has none or a larger one). A fraction is
  // resolved under the mutex, when the device first reserves memory (the total is asked before
  // the segment is kept: should that fail, the allocation fails whole) and again whenever the
  // limit changes: a device nobody allocates on is never asked for its total (on CUDA that would
  // create its context), and until it reserves memory nothing is allocated there to limit.
  void SetSoftLimit(size_t bytes);
  void SetSoftLimitFraction(double fraction);
  // What an allocation of `size` bytes takes (the size policy's rounding).
  size_t RoundSize(size_t size) const { return policy_.RoundSize(size); }
  // False when a request of `size` on `stream` fits nowhere, whatever is freed: the least segment
  // that would serve it is larger than the device, or than the limit and every segment of its
  // stream that it may use. The holders (the offload engine) are not asked to make room for it.
  bool CouldEverFit(size_t size, StreamRef stream) const;
  // Returns false (and changes nothing) when `ptr` is not a live allocation of this device.
  bool Free(void* ptr, TraceContext context);
  // Marks `ptr` as used by `stream`, a stream of `stream_device`: when freed it is reused only
  // after work enqueued on `stream` up to the free has completed (polled through an event; for a
  // stream of another device, the free waits for it on the host). Returns false when `ptr` is not
  // a live allocation here.
  bool RecordStream(void* ptr, StreamRef stream, int stream_device);
  // Names the live allocation at `ptr` for Revive: a tag unique on this device (never 0), or 0
  // when `ptr` is not a live allocation here. Tagging it again replaces the tag.
  uint64_t TagForRevival(const void* ptr);
  // Takes back a block freed while its stream uses were still running: the pending free at `ptr`
  // of the allocation tagged `tag` becomes a live allocation again, as it was (address, size,
  // stream, requested size), with its stream uses recorded anew, so that its next free waits for
  // them again. Its pending events go back to the spares: the work they stood for is awaited
  // again by that next free. False (nothing changed) when there is no such pending free: its
  // free completed (the memory may be another allocation's by now, even one pending at the same
  // address: the tag tells them apart), it was quarantined (a use that can never be waited for),
  // or it was taken back already. The history records it as the free completed and an
  // allocation (`context`), so that snapshots replay. For the offload engine: a spill whose copy
  // to the host has not finished, wanted back.
  bool Revive(void* ptr, uint64_t tag, TraceContext context);
  std::optional<AllocationInfo> Lookup(const void* ptr) const;
  // Raises the category of the live allocation at `ptr` to `category` (see TraceCategory); its
  // free's trace entries and the snapshot's block carry it. (CachingAllocator asks only while
  // history is recorded.) Returns false when `ptr` is not a live allocation here.
  bool SetTraceCategory(const void* ptr, TraceCategory category);
  // Records an "annotate" entry for the live allocation that starts at `ptr`, carrying `labels`
  // and `context` (see CachingAllocator::AnnotateMemory), while history is recorded. Returns
  // false when `ptr` is not a live allocation here.
  bool Annotate(const void* ptr, TraceLabelsRef labels, TraceContext context);
  // The live allocation `ptr` points into (its start included): what a second storage over
  // Spillway's memory (from_numpy, DLPack) or a view's data pointer belongs to.
  std::optional<AllocationInfo> LookupContaining(const void* ptr) const;
  // The segment (one backend allocation) that contains `ptr`, live or free: for PyTorch's
  // getBaseAllocation. Null when no segment of this device contains it.
  std::optional<SegmentRange> SegmentOf(const void* ptr) const;
  // What `ptr` is when it is not a live allocation: for error messages.
  std::string DescribeForeign(const void* ptr) const;

  void EmptyCache();
  // A fraction of total device memory in [0, 1], as PyTorch's: 0 allows no new memory (a limit
  // of one byte), 1 the whole device.
  void SetMemoryFraction(double fraction);
  void SetMemoryLimit(size_t bytes);
  size_t memory_limit() const;  // 0 = none
  // The device's memory as the backend reports it, asked once (on CUDA the first question
  // creates the device's context).
  size_t total_memory() const;
  std::optional<double> memory_fraction() const;  // as last set; none when never set

  DeviceStats stats() const;
  void ResetPeakStats();
  void ResetAccumulatedStats();

  void RecordHistory(bool enabled, size_t max_entries);
  bool history_enabled() const;
  void ClearHistory();
  std::vector<TraceEntry> history() const;
  std::vector<SegmentSnapshot> SnapshotSegments() const;
  // Adds this device's streams (id -> handle) to `out`.
  void CollectStreamHandles(std::map<uint64_t, uintptr_t>& out) const;
  // Size of the largest cached free block (PyTorch's cacheInfo).
  size_t LargestFreeBlock() const;
  // Host bytes the block arena and the address table hold (they grow with the peak number of
  // blocks; EmptyCache gives back what neither the live blocks nor the round since the previous
  // EmptyCache needed: see AddressTable::ShrinkToFit).
  size_t MetadataBytes() const;
  // Completes pending stream-use frees whose events have fired. Malloc does this on its own.
  void ProcessEvents();
  // Returns once the calls under way on other threads have returned: a failure one of them took
  // from the backend has then reached the sink. (Whoever reads the sink's record to learn of every
  // failure found so far asks this first.)
  void AwaitReports() const;
  int device() const { return device_; }

 private:
  struct Pending {
    EventHandle event;
    BlockId block;
    StreamHandle use;  // the stream the event was recorded on (pending_'s key is its id)
  };
  struct Segment {
    size_t size;
    PoolKind pool;
    int64_t freed_at;  // allocation-clock tick at which it last became wholly free (GC age)
    BlockId head;      // first block; merges keep it, splits keep it at the front
    StreamRef stream;  // allocation stream of every block in the segment
    // The context of the allocation that made it (when history gathers them): PyTorch's
    // context_when_segment_allocated, which its segment_alloc and segment_free entries carry.
    TraceContext context;
  };
  using SegmentMap = absl::btree_map<uintptr_t, Segment>;

  FreeIndex& pool(PoolKind kind) { return pools_[static_cast<int>(kind)]; }
  BlockId FindFree(PoolKind kind, StreamRef stream, size_t size);
  // A new segment for a `rounded`-byte request: PyTorch's size, or the least that holds the
  // request when that does not fit. kNoBlock when neither does. `context`: the request's.
  BlockId AllocSegment(PoolKind kind, StreamRef stream, size_t rounded,
                       const TraceContext& context);
  bool CouldEverFitLocked(PoolKind kind, StreamRef stream, size_t rounded) const;
  BlockId NewSegment(PoolKind kind, StreamRef stream, size_t segment_size,
                     const TraceContext& context);
  void* UseBlock(BlockId block, size_t rounded, size_t requested, TraceContext context);
  void FreeBlock(BlockId block);
  bool ReleaseSegment(BlockId block);
  // The out-of-memory ladder's own steps (no callbacks): the wait for pending stream uses, the
  // release of cached segments, a small request in the large pool. kNoBlock if none serves.
  BlockId Reclaim(PoolKind kind, StreamRef stream, size_t rounded, const TraceContext& context);
  // The ladder's last step: the registered holders (the offload engine) give memory back, and
  // the allocator's own steps run again after each round. Unlocks `lock` while they run.
  BlockId AskHolders(PoolKind kind, StreamRef stream, size_t rounded,
                     std::unique_lock<std::mutex>& lock, const TraceContext& context);
  // Adds or removes a free block in its pool's index, keyed by its current size and address.
  void IndexInsert(BlockId block);
  void IndexErase(BlockId block);
  // A freed block waits for one more stream-use event / one event is over; EventDone returns
  // true when it was the last, and the block may be freed.
  void AddPendingEvent(BlockId block);
  bool EventDone(BlockId block);
  // One pending use is over (or waited for): its event goes back to the spares, and the block is
  // freed when it was the last.
  void CompletePending(const Pending& done);
  // The key allocated_ confirms a slot with: the address of block `id`.
  auto AddressOf() const {
    return [this](BlockId id) { return arena_[id].ptr; };
  }
  // One free block spans the whole segment: it can go back to the backend.
  bool WhollyFree(const Segment& segment) const {
    const Block& head = arena_[segment.head];
    return !head.is_split() && head.is_free();
  }
  void ReleaseCachedSegments(size_t until_freed);
  void GarbageCollect(size_t incoming);
  void ProcessEventsLocked();
  // Frees the pending `kind` blocks of `stream`'s own pool, oldest first within each use
  // stream's queue (the queues of different use streams in no set order), until one serves a
  // `rounded`-byte request, and returns that block (kNoBlock if none did). Each waits for its
  // stream uses: where every access follows streams `stream` waits (cudaStreamWaitEvent) and the
  // host goes on; elsewhere the host waits (counted once in num_sync_all_streams).
  BlockId AwaitPendingUntilFit(PoolKind kind, StreamRef stream, size_t rounded);
  // Waits on the host for every pending stream use and frees what waited. False (and nothing
  // counted in num_sync_all_streams) when nothing was pending.
  bool SynchronizeAllEvents();
  EventHandle TakeEvent();
  // Whether the work behind `event` (a stream use on `stream`) is over. A failed copy is over
  // too: the error is kept for the stream's owner and the block becomes reusable.
  bool UseIsOver(uint64_t stream, EventHandle event, bool wait);
  // Waits on the host for `use`, a stream of `device`: Free's way with streams of other devices,
  // and its fallback when no event can be recorded. False when even that fails (the block must
  // then never be reused).
  bool WaitOnHost(int device, const StreamRef& use);
  // Passes a failure of work on `stream` (of `device`) to the sink, for the stream's owner.
  void NoteStreamError(int device, uint64_t stream, const BackendError& error);
  // `labels` null: the recording thread's (HistoryRing::Record).
  void Trace(TraceAction action, uintptr_t addr, size_t size, uint64_t stream, TraceContext context,
             TraceCategory category = TraceCategory::kUnknown, TraceLabelsRef labels = nullptr);
  // Trace of an allocation's event: its stream's id and its extras are looked up only when
  // history is on. The events carry the caller's size, as PyTorch's do (memory_viz draws those);
  // a free, the block's category; free_completed, the frames of the allocation it ends, as
  // PyTorch's (without them its viewer shows a freed block as having no frames); an annotation,
  // its own labels.
  void TraceBlock(TraceAction action, BlockId id, TraceContext context,
                  TraceLabelsRef labels = nullptr) {
    if (history_.enabled()) TraceBlockRecorded(action, id, std::move(context), std::move(labels));
  }
  void TraceBlockRecorded(TraceAction action, BlockId id, TraceContext context,
                          TraceLabelsRef labels);
  [[noreturn]] void ThrowOutOfMemory(size_t requested, size_t rounded);
  size_t LargestFreeBlockLocked() const;
  size_t ComputeLimit() const;
  // The segment whose range holds `address`, or segments_.end().
  SegmentMap::const_iterator SegmentContaining(uintptr_t address) const;
  AllocationInfo InfoLocked(const Block& b) const;
  // soft_limit_ from soft_limit_fraction_, when one is set (see SetSoftLimit).
  void ResolveSoftLimit();
  size_t TotalMemory() const;
  // limit_, resolved first if a configured fraction is still pending. Under mutex_.
  size_t Limit() const;

  Backend& backend_;
  const int device_;
  const SizePolicy policy_;
  const double gc_threshold_;
  const FreeMemoryCallbacksFn callbacks_;
  StreamFailureSink& failures_;
  mutable size_t total_memory_ = 0;  // fetched on first need (TotalMemory); guarded by mutex_

  mutable std::mutex mutex_;
  FreeIndex pools_[2];  // trees keyed by stream slot
  BlockArena arena_;
  AddressTable allocated_;  // live allocations by address
  StreamSlots streams_;     // the streams blocks name by slot
  SegmentMap segments_;
  absl::flat_hash_map<uint64_t, std::deque<Pending>> pending_;  // by stream id
  // Every stream a segment was made for, kept after its segments go: trace entries outlive them.
  absl::flat_hash_map<uint64_t, StreamHandle> stream_handles_;
  std::vector<EventHandle> spare_events_;
  DeviceStats stats_;
  // Bytes of every block freed so far. Unlike stats_, never reset: AskHolders reads progress here.
  uint64_t bytes_freed_ = 0;
  HistoryRing history_;
  std::optional<double> memory_fraction_;
  size_t memory_limit_bytes_ = 0;
  // Effective: min of the two when set, 0 = none. A fraction from the configuration is resolved
  // on the device's first need (Limit()): the device total it needs creates a CUDA context.
  mutable size_t limit_ = 0;
  mutable bool limit_resolved_ = true;
  int64_t clock_ = 0;  // counts segment allocations, ages free segments for GC
  // Guarded by mutex_, as everything here (relaxed atomic loads: plain loads, no cost).
  std::atomic<size_t> soft_limit_{std::numeric_limits<size_t>::max()};
  double soft_limit_fraction_ = 0.0;  // 0: soft_limit_ is in bytes as set
  uint64_t revive_tags_ = 0;          // the last tag TagForRevival gave
};

}  // namespace spillway
