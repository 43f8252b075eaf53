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
// How: the pool is the allocator's stream-ordered caching core (allocator/device_allocator.h)
// composed over pinned memory, not a second implementation of it. The core takes its segments
// from a HostMemoryBackend (host_malloc behind device_malloc), sizes them with the uniform size
// policy (SizePolicy::Uniform: the rounding, chunk size and split rule above), and defers a
// freed block's reuse by the events it records on the streams that used it. Every buffer is
// allocated on one stream of the pool's own (kAllocationStream, which no real stream is), so any
// freed buffer serves any request, and every `last_use` is another stream's, waited for. What is
// the pool's own: statuses instead of exceptions, the limit's trimming, failures heard while
// waiting for a last use told to the caller (StreamFailure), and history in the terms of
// PyTorch's host allocator.
//
// Buffers are kGranule-aligned when the backend's chunks are (CUDA and the simulated device both
// give at least 512-byte alignment).
//
// History (off by default): while on, the pool records what it does in the terms of PyTorch's
// own pinned host allocator (its `host_traces`, torch 2.14): see RecordHistory.
//
// Thread-safe: the core's mutex guards all state; the pool adds none. The core holds it across
// backend calls, including the rare `host_malloc` of a new chunk, so that the limit is checked
// and charged atomically.
//
// Errors: allocation failures are statuses (see Allocate); caller mistakes throw
// `InvalidArgumentError`; unexpected backend failures in event or stream calls throw
// `BackendError` (backend.h) and leave the pool consistent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/backend.h"
#include "allocator/device_allocator.h"
#include "allocator/errors.h"
#include "allocator/history.h"
#include "allocator/host_memory_backend.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "allocator/stream_error_ledger.h"

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
  // Larger requests (and a larger `grow_bytes`) are rejected as absurd: no host pins a TiB, and
  // it keeps every block within the core's limits (kMaxRequest).
  static constexpr size_t kMaxBytes = kMaxRequest;

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
  // A failure of stream work the core heard while waiting for a last use.
  struct Heard {
    uint64_t stream;  // StreamRef::id
    BackendError error;
  };
  // The core's sink. The core reports on the thread that called it, under its lock, so each of
  // the pool's calls collects what it caused into a list of its own (CallScope, thread-local)
  // and tells its caller: the failure is that caller's to act on, as it was heard in its call.
  class HeardInCall final : public StreamFailureSink {
   public:
    void OnStreamFailure(int device, uint64_t stream, const BackendError& error) override;
  };
  class CallScope;

  // The core's one allocation stream for every buffer: an id no real stream has (stream ids
  // count up from small numbers), so that no `last_use` is mistaken for it and left unawaited.
  static constexpr StreamRef kAllocationStream{nullptr, ~uint64_t{0}};

  // A buffer of `rounded` bytes from the core: a cached block or a new chunk, nothing reclaimed
  // (the core's ladder would wait for pending buffers on the host). Null when neither serves.
  void* TryTake(size_t rounded);
  // Why `rounded` bytes could not be had: the limit (ResourceExhausted) or the backend
  // (Unavailable).
  absl::Status FailureStatus(size_t bytes, size_t rounded) const;
  // Throws what the core heard during a call: StreamFailure when it names one stream's earlier
  // work, else the BackendError (whose work failed is then not known). Nothing when nothing.
  static void ThrowHeard(const std::vector<Heard>& heard);
  [[noreturn]] void ThrowNotLive(const void* ptr) const;
  DeviceStats Stats() const { return core_.stats(); }

  const int device_;
  // Declared before the core, which uses both to its end: its destructor waits for pending
  // buffers and gives every chunk back through the adaptor.
  HostMemoryBackend host_memory_;
  HeardInCall heard_;
  DeviceAllocator core_;
};

}  // namespace spillway
