// Spillway's caching allocator: one `DeviceAllocator` per device behind a front that checks
// arguments, resolves streams and devices, gathers trace contexts outside the device locks and
// owns the out-of-memory callbacks. No torch here; the PyTorch adapters and the C ABI wrap it.
//
// What the layers above need beyond a stream-ordered caching allocator is composed here, around
// the device cores, not inside them: each device's StreamErrorLedger (the failures its core found
// while waiting for streams, kept until the observer has them), and the speculative mode (a
// thread's SpeculativeAllocations scope makes this front ask its core for a cached block or a new
// segment only: MallocOptions::reclaim), and each device's BudgetAdaptor (the offload engine's
// watermark, held through the core's soft limit, and the pressure handler run when an allocation
// would pass it).
//
// Threads and locks: every method may be called from any thread. The front's own mutexes
// (gatherer, callbacks) are never held while a device core's is taken; a core calls its ledger
// under its own mutex (order: core, then ledger); callbacks, handlers and the observer run with no
// allocator lock held.
//
// Size 0: `Malloc(0, ...)` returns nullptr and allocates nothing; `Free(nullptr)` is a no-op.
// This matches PyTorch, which never dereferences a zero-byte storage's pointer.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "allocator/backend.h"
#include "allocator/budget_adaptor.h"
#include "allocator/callback_guard.h"
#include "allocator/config.h"
#include "allocator/device_allocator.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "allocator/stream_error_ledger.h"
#include "allocator/stream_memo.h"

namespace spillway {

class CachingAllocator {
 public:
  CachingAllocator(std::shared_ptr<Backend> backend, const AllocatorConfig& config);
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Allocates on `device` for use on `stream`. Throws InvalidArgumentError for a bad device or a
  // size above kMaxRequest, OutOfMemoryError when even the out-of-memory ladder fails (inside a
  // SpeculativeAllocations scope: when no cached block or new segment serves, with no ladder). A
  // pressure handler or free-memory callback (the offload engine) may throw too: a BackendError it
  // heard while making room (a failed copy of the program's on a stream it records on).
  void* Malloc(size_t size, int device, StreamRef stream);
  // Same, resolving a raw stream handle (null = the device's default stream) through the backend.
  void* Malloc(size_t size, int device, StreamHandle stream);
  // The identity of `stream` of `device`, a stream the caller knows lasts as long as the process
  // (PyTorch's default and pool streams): resolved once per thread, then remembered (StreamMemo),
  // so that the hot path makes no backend call for it. Throws InvalidArgumentError for a bad
  // device.
  StreamRef ResolveLastingStream(int device, StreamHandle stream) {
    At(device);  // validate before asking the backend about the stream
    return lasting_streams_.ResolveLasting(device, stream);
  }
  // Frees `ptr`. Throws InvalidArgumentError naming what `ptr` is when it is not a live
  // allocation (foreign pointer, double free, interior pointer).
  void Free(void* ptr);
  void Free(void* ptr, int device);  // faster when the caller knows the device
  // Marks `ptr` as used by `stream`: its reuse after a free waits for the work enqueued there up
  // to the free. `stream` is a stream of the block's own device, or of `stream_device` (as
  // PyTorch's record_stream allows; the free then waits for it on the host). Throws
  // InvalidArgumentError for a pointer that is not a live allocation or a bad device index.
  void RecordStream(void* ptr, StreamRef stream);
  void RecordStream(void* ptr, StreamRef stream, int stream_device);
  // Names the live allocation at `ptr` of `device` so that its free, while still pending (a stream
  // that used it is not done), can be taken back by Revive with the returned tag (0: `ptr` is not
  // a live allocation there). The offload engine's: a spill still copying to the host when
  // backward wants its storage keeps its device copy instead of a round trip
  // (DeviceAllocator::TagForRevival, Revive).
  uint64_t TagForRevival(const void* ptr, int device);
  // The allocation tagged `tag`, freed at `ptr` while a stream still used it, live again; false
  // when its free is no longer pending.
  bool Revive(void* ptr, int device, uint64_t tag);
  std::optional<AllocationInfo> Lookup(const void* ptr) const;
  // What the layers above learned the live allocation at `ptr` holds (see TraceCategory): raises
  // its category, while history is recorded (nothing otherwise: no lookup). A pointer that is no
  // live allocation is ignored.
  void SetTraceCategory(const void* ptr, TraceCategory category);
  // The live allocation `ptr` points into, on any device (interior pointers too).
  std::optional<AllocationInfo> LookupContaining(const void* ptr) const;
  // The segment containing `ptr` on any device (PyTorch's getBaseAllocation), or null.
  std::optional<SegmentRange> SegmentOf(const void* ptr) const;

  void EmptyCache();
  void SetMemoryFraction(double fraction, int device);
  void SetMemoryLimit(size_t bytes, int device);
  size_t memory_limit(int device) const;
  // The device's total memory, asked of the backend once per device (on CUDA the first question
  // creates the device's context: ask only about devices in use).
  size_t total_memory(int device) const;
  std::optional<double> memory_fraction(int device) const;  // as last set; none if never set

  DeviceStats stats(int device) const;
  std::map<std::string, int64_t> FlatStats(int device) const {
    return FlattenStats(stats(device), config_.max_split_size);
  }
  void ResetPeakStats(int device);
  void ResetAccumulatedStats(int device);
  size_t LargestFreeBlock(int device) const;
  // Host memory the device's own bookkeeping holds (see DeviceAllocator::MetadataBytes).
  size_t MetadataBytes(int device) const;
  void ProcessEvents(int device);

  // History. `max_entries` 0 means the configured `history_entries`. The gatherer (may be
  // empty) runs outside every allocator lock at each allocation, and at each free unless
  // `free_context` is false (PyTorch's context="alloc": frees, the more frequent event on a
  // training step's hot path, then carry no context), while recording is on.
  // Stopping (enabled false) clears the history, as PyTorch's allocator does.
  void RecordHistory(bool enabled, size_t max_entries = 0, ContextGatherer gatherer = {},
                     bool free_context = true);
  bool history_enabled() const { return recording_.load(std::memory_order_relaxed); }
  // Drops the recorded entries of every device, and the annotations; recording continues if it
  // was on.
  void ClearHistory();
  Snapshot TakeSnapshot() const;

  // What PyTorch's allocator records beside the trace (torch calls its c10 allocator's
  // recordAnnotation, push/popCompileContext and set/getUserMetadata; the c10 adapter forwards
  // them here, and the torch layer calls them itself for the simulated device). None of it is on
  // the allocation path: trace entries take the thread's labels when recorded (HistoryRing).
  //
  // An annotation (a record_function range's "START" or "END") for the snapshot's
  // external_annotations, while history is recorded; `device` is the caller's current device,
  // recorded as given. Kept, oldest first, in a ring of the history's capacity; dropped with the
  // history (ClearHistory, or stopping).
  void RecordAnnotation(int device, std::vector<std::pair<std::string, std::string>> metadata);
  // The calling thread's compile-context stack; the trace entries it records carry its top. As in
  // PyTorch, both are ignored while history is not recorded, so a pop after recording started
  // may meet an empty stack, which stays empty.
  void PushCompileContext(std::string context);
  void PopCompileContext();
  // The calling thread's user metadata, carried by the trace entries it records from now on ("":
  // none). Kept whether or not history is recorded, as PyTorch keeps it.
  void SetUserMetadata(std::string metadata);
  std::string user_metadata() const;
  // An "annotate" trace entry for the live allocation that starts at `ptr` (torch 2.14's
  // annotateMemory, behind torch.cuda.memory._annotate_tensor): the allocation's address, size
  // and stream, the frames gathered here, the thread's compile context, and `metadata` as its
  // user metadata. Only while history is recorded (nothing, not even a lookup, otherwise); a null
  // `ptr` is ignored. Throws InvalidArgumentError naming what `ptr` is when it is not the start of
  // a live allocation.
  void AnnotateMemory(const void* ptr, std::string metadata);

  // Memory pressure: before a Malloc that would take `device`'s allocated bytes past its
  // watermark (by `incoming_bytes`, the request after the size policy's rounding), the handler runs
  // (outside every allocator lock, in the allocating thread); the allocation is made after it
  // returns, whatever it managed. The offload engine uses it to hold allocated bytes under its
  // budget. SIZE_MAX disables. (Each device's BudgetAdaptor carries this out.)
  using PressureHandler = spillway::PressureHandler;
  // Replacing or clearing the handler (or the observer below, or removing a free-memory callback)
  // returns once no call of the old one is running on another thread, so its owner may go.
  void SetPressureHandler(PressureHandler handler);
  void SetWatermark(int device, size_t bytes);
  // A fraction in (0, 1] of the device's limit (total memory without one), resolved when the
  // device first reserves memory: see DeviceAllocator::SetSoftLimitFraction.
  void SetWatermarkFraction(int device, double fraction);

  // Told of StreamErrors (failed asynchronous work found while processing stream uses), outside
  // every allocator lock, possibly more than once each (see StreamError::seq). An observer that
  // throws is told again at the next look; its exception goes nowhere but to DeliverStreamErrors.
  // The offload engine uses it to fail the copies it had in flight.
  using StreamErrorObserver = std::function<void(const StreamError&)>;
  void SetStreamErrorObserver(StreamErrorObserver observer);
  // Passes to the observer, now, the errors of `device` found and not yet passed on (a call
  // found them, and passes them on only as it returns), those another thread is passing on
  // included, and waits for one another thread has taken from the backend and is noting. What
  // the observer throws comes out of here (the errors stay pending). Call it
  // with no allocator lock held.
  void DeliverStreamErrors(int device);
  // How many stream errors `device`'s allocator has found (StreamError::found_by == device) so
  // far: one numbered above what this returned before some work was enqueued was found after
  // that work was, so it may be that work's own.
  uint64_t StreamErrorsFound(int device);

  // Out-of-memory ladder step: see FreeMemoryCallback. Returns an id for removal.
  uint64_t AddFreeMemoryCallback(FreeMemoryCallback callback);
  void RemoveFreeMemoryCallback(uint64_t id);

  Backend& backend() const { return *backend_; }
  const std::shared_ptr<Backend>& shared_backend() const { return backend_; }
  int device_count() const { return static_cast<int>(devices_.size()); }
  const AllocatorConfig& config() const { return config_; }

 private:
  // Both sit on the hot path: the common cases are inline, the rest out of line.
  DeviceAllocator& At(int device) const {
    if (device < 0 || device >= device_count()) ThrowBadDevice(device);
    return *devices_[static_cast<size_t>(device)];
  }
  [[noreturn]] void ThrowBadDevice(int device) const;
  TraceContext GatherContext() const {
    if (!recording_.load(std::memory_order_relaxed)) return nullptr;
    return GatherContextSlow();
  }
  TraceContext GatherFreeContext() const {
    if (!free_context_.load(std::memory_order_relaxed)) return nullptr;
    return GatherContext();
  }
  TraceContext GatherContextSlow() const;
  // What `ptr` is, for the error of a call that needed a live allocation there.
  std::string DescribeNotLive(const void* ptr) const;
  std::vector<FreeMemoryCallback> Callbacks() const;
  // Calls `find(device)` on the device that answered the last pointer-only call, then on the
  // others, until one returns true; returns that device, or nullptr. PyTorch frees by pointer
  // alone (its deleter gets no device), and a process mostly works on one device (one per rank):
  // trying that one first makes such a free one table lookup instead of one per device.
  template <typename Find>
  DeviceAllocator* FindOwner(Find find) const {
    if (devices_.empty()) return nullptr;  // a CUDA backend on a machine without a device
    const int hint = last_owner_.load(std::memory_order_relaxed);
    if (DeviceAllocator* const first = devices_[static_cast<size_t>(hint)].get(); find(*first)) {
      return first;
    }
    for (int d = 0; d < device_count(); ++d) {
      DeviceAllocator* const device = devices_[static_cast<size_t>(d)].get();
      if (d != hint && find(*device)) {
        last_owner_.store(d, std::memory_order_relaxed);
        return device;
      }
    }
    return nullptr;
  }

  const std::shared_ptr<Backend> backend_;
  const AllocatorConfig config_;
  // One per device, by index; before devices_, which report to them, so that they outlive them.
  std::vector<std::unique_ptr<StreamErrorLedger>> ledgers_;
  std::vector<std::unique_ptr<DeviceAllocator>> devices_;
  mutable std::atomic<int> last_owner_{0};  // see FindOwner
  StreamMemo lasting_streams_{*backend_};   // see ResolveLastingStream

  std::atomic<bool> recording_{false};
  std::atomic<bool> free_context_{true};
  mutable std::mutex gatherer_mutex_;
  ContextGatherer gatherer_;
  // RecordAnnotation's ring: at most annotation_capacity_ entries, the newest.
  mutable std::mutex annotations_mutex_;
  std::deque<AnnotationEntry> annotations_;
  size_t annotation_capacity_ = 0;

  StreamErrorLedger& LedgerOf(const DeviceAllocator& device) const {
    return *ledgers_[static_cast<size_t>(device.device())];
  }
  bool HasStreamErrors(const DeviceAllocator& device) const {
    return LedgerOf(device).has_errors();
  }
  void DispatchStreamErrors(DeviceAllocator& device, bool rethrow = false);
  // `stream` of `stream_device`, or of the block's own device when none is given.
  void RecordStreamOf(void* ptr, StreamRef stream, std::optional<int> stream_device);
  void* MallocOn(DeviceAllocator& allocator, size_t size, StreamRef stream, TraceContext& context,
                 MallocOptions options);
  // Every callback below is called through the guard: replacing or removing one returns only
  // once no call of it is running (the engine's capture `this`).
  mutable CallbackGuard callback_guard_;
  CallbackCell<StreamErrorObserver> stream_error_observer_;
  CallbackCell<PressureHandler> pressure_handler_;
  // One per device, by index, around devices_[d]; after the guard and the handler cell they
  // refer to, so that they go first.
  std::vector<std::unique_ptr<BudgetAdaptor>> budgets_;
  BudgetAdaptor& BudgetOf(const DeviceAllocator& device) const {
    return *budgets_[static_cast<size_t>(device.device())];
  }

  mutable std::mutex callbacks_mutex_;
  std::map<uint64_t, std::shared_ptr<RegisteredCallback<FreeMemoryCallback>>> callbacks_;
  uint64_t next_callback_id_ = 1;
};

}  // namespace spillway
