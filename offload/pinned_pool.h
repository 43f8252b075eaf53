// Pinned (page-locked) host memory for the offload engine.
//
// Offloaded activations land in pinned buffers because only page-locked memory can be the host
// side of an asynchronous copy. Pinning is expensive (cudaHostAlloc costs milliseconds per call),
// so buffers are cached across training steps. PyTorch's CachingHostAllocator rounds every
// request to a power of two, which can waste half of the pinned memory; this pool does not:
//  - Sizes are rounded up to kGranule (512 B) only.
//  - Chunks of at least `grow_bytes` are taken from the backend and carved into buffers best fit
//    (smallest sufficient free block, O(log n)); freed buffers coalesce with free neighbours of
//    the same chunk.
//  - Waste guarantee: a free block is split when the remainder is at least
//    max(kGranule, round(bytes) / 64), so for every buffer
//        round(bytes) <= buffer_size(p) < round(bytes) + max(512 B, round(bytes) / 64),
//    where round(bytes) is `bytes` rounded up to 512 B: beyond the 512-byte rounding, a buffer
//    is never more than max(512 B, 1/64 of its size) larger than asked for.
//  - `limit_bytes` caps the pinned bytes held from the backend.
//  - A buffer freed with `last_use` is reused only once the work on that stream (the copy that
//    filled or drained it) has completed; the pool never blocks the host to find out.
//
// Buffers are kGranule-aligned when the backend's chunks are (CUDA and the simulated device both
// give at least 512-byte alignment).
//
// History (off by default): while on, the pool records what it does in the terms of PyTorch's
// own pinned host allocator (its `host_traces`, torch 2.14): see RecordHistory.
//
// Thread-safe: one mutex guards all state. Public methods take it and never call each other;
// private methods named *Locked expect it held. The mutex is held across backend calls, including
// the rare `host_malloc` of a new chunk, so that the limit is checked and charged atomically.
//
// Errors: allocation failures are statuses (see Allocate); caller mistakes throw
// `InvalidArgumentError`; unexpected backend failures in event or stream calls throw
// `BackendError` (backend.h) and leave the pool consistent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/backend.h"
#include "allocator/backend_raii.h"
#include "allocator/history.h"
#include "allocator/snapshot.h"

namespace spillway {

class PinnedPool {
 public:
  // A failure of earlier work the pool heard of on the stream of a buffer's last use (polling
  // the event it recorded there, recording it, or waiting for the stream): whose work failed is
  // known here.
  class StreamFailure : public BackendError {
   public:
    StreamFailure(const BackendError& error, uint64_t stream_id)
        : BackendError(error), stream_id_(stream_id) {}
    uint64_t stream_id() const { return stream_id_; }  // StreamRef::id

   private:
    uint64_t stream_id_;
  };

  struct Options {
    size_t grow_bytes = size_t{64} << 20;  // new chunks are at least this large
    size_t limit_bytes = 0;                // max pinned bytes reserved; 0 = no limit
  };

  // Every buffer size is a multiple of this.
  static constexpr size_t kGranule = 512;
  // Larger requests (and a larger `grow_bytes`) are rejected as absurd: no host pins 2^50 bytes,
  // and it keeps the rounding arithmetic far from overflow.
  static constexpr size_t kMaxBytes = size_t{1} << 50;

  // `backend` must outlive the pool. `device` is where the pool's events live: streams passed to
  // Free must belong to it. Throws InvalidArgumentError when `grow_bytes` exceeds kMaxBytes.
  PinnedPool(Backend& backend, int device, Options options);
  // Waits for pending events, then returns every chunk to the backend, including chunks holding
  // buffers never freed: those pointers dangle afterwards.
  ~PinnedPool();

  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A buffer of at least `bytes` bytes, `bytes` in [1, kMaxBytes] (otherwise throws
  // InvalidArgumentError). Failures are statuses, never exceptions:
  //  - ResourceExhausted when the limit forbids it even after returning wholly free chunks; the
  //    message names the requested bytes, the reserved bytes and the limit.
  //  - Unavailable when the backend cannot provide pinned memory, even at the exact size and
  //    after returning wholly free chunks; the message carries the backend's.
  absl::StatusOr<void*> Allocate(size_t bytes);

  // Returns a buffer. With `last_use`, the buffer is reused only after all work enqueued on that
  // stream so far has completed: the pool records one of its own events on the stream and polls
  // it at later Allocate and Trim calls, never blocking the host. Only if the event cannot be
  // recorded does Free wait for the stream on the host; if even that fails, the buffer is never
  // reused (it is returned with its chunk when the pool is destroyed) and the BackendError
  // propagates. Throws InvalidArgumentError for a pointer that is not a live buffer of this pool
  // (unknown, interior or already freed).
  void Free(void* ptr, std::optional<StreamRef> last_use = std::nullopt);

  // Returns to the backend every chunk that is wholly free, counting buffers whose last-use
  // events have completed as free.
  void Trim();

  // Caps the pinned bytes held from the backend from now on (0 = no limit). Lowered under what is
  // reserved, it returns the wholly free chunks (as Trim); buffers handed out stay valid, and the
  // pool grows again only once enough of them came back.
  void SetLimit(size_t limit_bytes);

  // Pinned bytes held from the backend.
  size_t reserved_bytes() const;
  // Bytes of buffers handed out and not yet reusable (live, or freed with work still pending).
  size_t in_use_bytes() const;
  size_t peak_reserved_bytes() const;
  // Size of a live buffer after rounding (at least the requested size). Throws
  // InvalidArgumentError for a pointer that is not a live buffer of this pool.
  size_t buffer_size(const void* ptr) const;
  // Successful `host_malloc` calls made so far (chunks taken from the backend).
  int64_t num_backend_allocs() const;

  // Records the pool's history, as PyTorch's pinned host allocator records its own (torch 2.14's
  // CachingHostAllocator): segment_alloc and segment_free for chunks taken from and given back to
  // the backend; alloc for a buffer handed out, free_requested at its Free, free_completed once
  // it is reusable (at once without `last_use`, else when that last use is over). As in
  // PyTorch's host entries, device is -1, stream 0, and a buffer's size is its size after
  // rounding. At most `max_entries` are kept (0 counts as 1; the oldest go first). Disabling
  // forgets what was recorded, as the allocator's history does. While off, the pool's calls pay
  // one branch for it.
  void RecordHistory(bool enabled, size_t max_entries);
  bool history_enabled() const;
  // Oldest first.
  std::vector<TraceEntry> history() const;
  // Every chunk as a segment (device -1, stream 0: host memory), its blocks in address order:
  // handed out (kActiveAllocated), freed with its last use pending (kActivePendingFree), or free
  // (kInactive). A block's requested size is its size, as in PyTorch's host segments.
  std::vector<SegmentSnapshot> Chunks() const;

 private:
  enum class State { kFree, kAllocated, kPending };

  // A contiguous range of one chunk; the blocks of a chunk tile it in address order.
  struct Block {
    size_t size = 0;
    uintptr_t chunk = 0;  // base address of the chunk it belongs to
    State state = State::kFree;
  };

  // A freed buffer waiting for the last use recorded on its stream.
  struct Pending {
    UniqueEvent event;
    uintptr_t ptr;
  };

  // Free-index key: ordered by (size, address) so `lower_bound` is best fit.
  using FreeKey = std::pair<size_t, uintptr_t>;

  static const char* StateName(State state);
  void ProcessEventsLocked();
  std::optional<uintptr_t> TakeBestFitLocked(size_t rounded);
  absl::StatusOr<uintptr_t> GrowLocked(size_t bytes, size_t rounded);
  absl::StatusOr<UniqueHostBuffer> HostMallocLocked(size_t preferred, size_t rounded);
  uintptr_t AddChunkLocked(UniqueHostBuffer buffer);
  void* UseBlockLocked(uintptr_t ptr, size_t rounded);
  bool DeferLocked(uintptr_t ptr, StreamRef last_use);
  UniqueEvent TakeEventLocked();
  void ReleaseLocked(uintptr_t ptr);
  void InsertFreeLocked(uintptr_t ptr, size_t size, uintptr_t chunk);
  void EraseFreeLocked(uintptr_t ptr);
  size_t TrimLocked();
  bool FitsLimitLocked(size_t chunk_bytes) const;
  absl::Status LimitErrorLocked(size_t bytes, size_t rounded) const;
  const Block& LiveBlockLocked(const void* ptr) const;
  std::string DescribeNonLiveLocked(const void* ptr) const;
  // Inline so that, with history off, a call costs its caller one branch.
  void TraceLocked(TraceAction action, uintptr_t address, size_t size) {
    if (history_.enabled()) RecordLocked(action, address, size);
  }
  void RecordLocked(TraceAction action, uintptr_t address, size_t size);

  Backend& backend_;
  const int device_;
  const size_t grow_bytes_;  // rounded to kGranule
  mutable std::mutex mu_;
  size_t limit_bytes_;  // SetLimit may change it

  // Declared before the events so that members are destroyed events first, chunks last.
  absl::flat_hash_map<uintptr_t, UniqueHostBuffer> chunks_;  // by base address
  absl::btree_map<uintptr_t, Block> blocks_;                 // every block, by address
  absl::btree_set<FreeKey> free_;                            // blocks in State::kFree
  // One FIFO per stream id: events on one stream complete in order, so polling stops at the
  // first incomplete one, and a slow stream does not hold up buffers used on others.
  absl::flat_hash_map<uint64_t, std::deque<Pending>> pending_;
  std::vector<UniqueEvent> spare_events_;
  size_t reserved_ = 0;
  size_t peak_reserved_ = 0;
  size_t in_use_ = 0;
  int64_t num_backend_allocs_ = 0;
  // A failure of earlier work found by Free's event record, rethrown once the buffer is safe.
  std::optional<BackendError> deferred_error_;
  HistoryRing history_;
};

}  // namespace spillway
