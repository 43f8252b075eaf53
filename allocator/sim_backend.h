// A simulated device: the `Backend` the whole stack is tested against on machines without a GPU.
//
// It aims to be honest rather than convenient, so that bugs that would corrupt data on a real GPU
// corrupt data here too:
//  - Device memory is real host memory (512-byte aligned) with a per-device capacity.
//  - Every stream, including each device's default stream, is a FIFO queue run by its own worker
//    thread. Copies, event records and waits are enqueued and run later, in order, on that
//    thread; with `max_jitter` each op first sleeps a random time, so a consumer that skips a
//    wait really reads stale data.
//  - Events follow CUDA: a never-recorded event is complete; a record captures all work enqueued on
//    the stream so far (including the record itself); re-recording replaces the capture.
//  - `device_free` and `host_free` first wait for all work already enqueued on the affected
//    device(s), as `cudaFree` / `cudaFreeHost` implicitly synchronize. This also guarantees a
//    queued copy never touches freed memory.
//  - `memcpy_async` checks at enqueue time that each device-side range lies inside one live device
//    allocation and throws `BackendError` otherwise. Host-side pointers are not checked; like
//    pinned memory in CUDA they must stay valid until the copy has run.
//
// Error reporting (see backend.h): bad device index is an `absl::InvalidArgumentError` status from
// `device_malloc` and an `InvalidArgumentError` exception elsewhere; unknown pointers, streams and
// events and injected faults throw `BackendError`.
//
// Fault injection. All knobs are thread-safe, one-shot unless stated, and count calls from the
// moment they are armed:
//  - `fail_device_malloc_after(n)`: the n-th subsequent `device_malloc` call with a valid device
//    index (1-based, all devices counted together) returns `absl::ResourceExhaustedError`. -1
//    disarms.
//  - `fail_host_malloc(n)`: the next n `host_malloc` calls return `absl::ResourceExhaustedError`.
//    0 disarms.
//  - `fail_copy_after(n)`: the n-th subsequent accepted `memcpy_async` call (1-based, all streams
//    counted together) is enqueued normally but, when its turn comes on the stream's worker, copies
//    nothing (the destination keeps its old bytes) and leaves a sticky error on that stream. Later
//    work on the stream still runs. The error is reported exactly once, by the first of these calls
//    that finds it, which throws `BackendError("memcpy_async", "injected copy failure ...")`, with
//    `earlier_work()` true, and clears it:
//      * `synchronize_stream(stream)`: after draining, so it always finds it;
//      * `synchronize_event(event)`: for an event last recorded on that stream; it checks after
//        waiting, so it always finds it when the event was recorded after the failing copy;
//      * `query_event(event)`, `record_event(event, stream)`, `memcpy_async(..., stream)`: these
//        never wait, so they find it only once the failing copy has run on the worker (for example
//        after a `device_free` on that device, which drains without reporting). A `record_event` or
//        `memcpy_async` that throws has no effect. A `query_event` that would return true for an
//        event recorded after the failing copy finds it too, unless another call took it first
//        (each call takes the stream's error as it looks). A stream keeps its first pending
//        failure only: a second copy failing before anyone looked is not reported on its own.
//    -1 disarms.
//  - `fail_event_after(n)`: the n-th subsequent `create_event` or `record_event` call with valid
//    arguments (1-based, both counted together) throws `BackendError` (operation "create_event" or
//    "record_event", detail "injected event failure") and has no effect. -1 disarms.
// Each `*_after(n)` knob requires n >= 1 or n == -1 and `fail_host_malloc` requires n >= 0;
// anything else throws `InvalidArgumentError`.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "allocator/backend.h"
#include "allocator/sim_link.h"

namespace spillway {

class SimBackend : public Backend {
 public:
  struct Options {
    int devices = 1;
    // Per device.
    size_t capacity_bytes = size_t{1} << 30;
    // Pinned host memory limit; 0 = unlimited.
    size_t host_capacity_bytes = 0;
    // Each enqueued op sleeps a uniformly random 0..max_jitter before it runs.
    std::chrono::microseconds max_jitter{0};
    // Seeds the per-stream jitter generators.
    uint64_t seed = 1;
    // What accesses_follow_streams() answers. False by default: under PyTorch, CPU kernels read
    // and write simulated device memory from the host thread, outside every stream. A user whose
    // every access is a stream copy (the allocator's tests) may say true.
    bool accesses_follow_streams = false;
    // Bandwidth of each device's link to the host, per direction (sim_link.h); 0 = unlimited (a
    // copy takes what its memcpy takes).
    uint64_t link_bytes_per_second = 0;
  };

  SimBackend();
  explicit SimBackend(Options options);
  ~SimBackend() override;

  SimBackend(const SimBackend&) = delete;
  SimBackend& operator=(const SimBackend&) = delete;

  std::string_view name() const override { return "sim"; }
  const Options& options() const { return options_; }
  bool accesses_follow_streams() const override { return options_.accesses_follow_streams; }
  int device_count() const override { return options_.devices; }
  MemInfo mem_info(int device) override;

  absl::StatusOr<void*> device_malloc(int device, size_t bytes) override;
  void device_free(int device, void* ptr) override;

  absl::StatusOr<void*> host_malloc(size_t bytes) override;
  void host_free(void* ptr) override;

  StreamRef create_stream(int device) override;
  void destroy_stream(int device, StreamHandle stream) override;
  StreamRef default_stream(int device) override;
  StreamRef resolve_stream(int device, StreamHandle stream) override;
  void synchronize_stream(int device, StreamHandle stream) override;

  EventHandle create_event(int device) override;
  void destroy_event(int device, EventHandle event) override;
  void record_event(int device, EventHandle event, StreamHandle stream) override;
  bool query_event(int device, EventHandle event) override;
  void synchronize_event(int device, EventHandle event) override;
  void stream_wait_event(int device, StreamHandle stream, EventHandle event) override;

  void memcpy_async(int device, void* dst, const void* src, size_t bytes, CopyKind kind,
                    StreamHandle stream) override;

  // A host-controlled gate, like CUDA's cuStreamWaitValue32 on a host word: work enqueued on
  // `stream` after this call runs only once the gate is opened (or destroyed). Lets tests hold
  // a stream busy deterministically instead of relying on timing.
  class StreamGate {
   public:
    void Open();
    // On the held stream's worker: returns once opened. With `waited` (a gate that opens when
    // waited for), also once it answers true, which it is asked every millisecond.
    void Wait(const std::function<bool()>& waited);
    bool opened_by_wait() const;

   private:
    mutable std::mutex mu_;
    std::condition_variable cv_;
    bool open_ = false;
    bool opened_by_wait_ = false;
  };
  // Owner side of a gate: opening it, or dropping it, lets the stream go on.
  class StreamHold {
   public:
    explicit StreamHold(std::shared_ptr<StreamGate> gate) : gate_(std::move(gate)) {}
    ~StreamHold() { gate_->Open(); }
    StreamHold(const StreamHold&) = delete;
    StreamHold& operator=(const StreamHold&) = delete;
    void Open() { gate_->Open(); }
    // Whether the gate opened because something waited for the work behind it (kWhenWaitedFor).
    bool opened_by_wait() const { return gate_->opened_by_wait(); }

   private:
    std::shared_ptr<StreamGate> gate_;
  };
  enum class HoldRelease {
    kByOwner,  // only Open() or the hold's end opens the gate
    // Also opens once a thread blocks until work queued behind the gate is done: the host (a
    // stream or event synchronization) or another stream (a wait on an event recorded behind
    // it). A test then learns whether a wait it expects was made, without a timed guess: with
    // the wait the work goes on, without it the gate stays shut.
    kWhenWaitedFor,
    // Only once the host blocks until such work is done: other streams may wait behind the gate
    // all along (a consumer's wait for a copy) while the test needs the work held until then.
    kWhenHostWaits,
  };
  std::unique_ptr<StreamHold> hold_stream(int device, StreamHandle stream,
                                          HoldRelease release = HoldRelease::kByOwner);

  // Fault injection; exact rules in the file comment.
  void fail_device_malloc_after(int64_t n);
  void fail_host_malloc(int64_t n);
  void fail_copy_after(int64_t n);
  void fail_event_after(int64_t n);

  // Counters for tests.
  // Successful `device_malloc` calls that returned memory (bytes > 0) / `device_free` calls that
  // released memory.
  int64_t num_device_mallocs() const;
  int64_t num_device_frees() const;
  // `device_malloc` calls that returned ResourceExhausted (capacity, host memory or injected).
  int64_t num_failed_device_mallocs() const;
  size_t bytes_in_use(int device) const;
  size_t host_bytes_in_use() const;
  // Events created and not yet destroyed, all devices.
  size_t num_live_events() const;
  // Copies that have run on a worker (failed injected copies excluded). Counted when the copy runs,
  // not when it is enqueued: synchronize before reading them.
  int64_t num_copies() const;
  size_t bytes_copied(CopyKind kind) const;
  // Host threads blocked until work on `stream` is done (a stream or event synchronization), and
  // other streams' workers blocked on one of its events (stream_wait_event): a test learns that a
  // thread or stream it started is waiting there, without a timed guess. A waiter counts from
  // when it blocks until it runs again.
  int host_waiters(int device, StreamHandle stream) const;
  int stream_waiters(int device, StreamHandle stream) const;

 private:
  class Stream;
  struct Event;

  struct FreeDeleter {
    // Simulated memory comes from std::aligned_alloc, which std::free releases.
    // NOLINTNEXTLINE(cppcoreguidelines-no-malloc,cppcoreguidelines-owning-memory)
    void operator()(void* p) const { std::free(p); }
  };

  using AlignedMemory = std::unique_ptr<void, FreeDeleter>;

  struct DeviceAllocation {
    int device;
    size_t bytes;
    AlignedMemory memory;
  };
  struct HostAllocation {
    size_t bytes;
    AlignedMemory memory;
  };

  // All helpers named *Locked require `mu_` held.
  void CheckDeviceLocked(int device) const;
  std::shared_ptr<Stream> FindStreamLocked(std::string_view op, int device,
                                           StreamHandle handle) const;
  Event& FindEventLocked(std::string_view op, int device, EventHandle handle) const;
  void CheckDeviceRangeLocked(const void* ptr, size_t bytes, std::string_view what) const;
  // FindStreamLocked under `mu_`.
  std::shared_ptr<Stream> FindStream(std::string_view op, int device, StreamHandle handle) const;
  // Streams of `device`, or of every device when `device` is -1.
  std::vector<std::shared_ptr<Stream>> StreamsOf(int device) const;
  // Waits for all work enqueued so far on the given device(s); never reports sticky errors.
  void Drain(int device) const;
  // Decrements an armed countdown; true when this call is the one that must fail.
  static bool CountdownFires(int64_t& countdown);

  const Options options_;
  // Thread-safe on its own; used by the streams' workers, never under `mu_`.
  SimLink link_;

  mutable std::mutex mu_;
  // Keyed by address so `memcpy_async` can find the allocation containing a pointer.
  std::map<uintptr_t, DeviceAllocation> device_allocations_;
  absl::flat_hash_map<void*, HostAllocation> host_allocations_;
  std::vector<size_t> device_used_;
  size_t host_used_ = 0;
  // One default stream per device; created streams by handle.
  std::vector<std::shared_ptr<Stream>> default_streams_;
  absl::flat_hash_map<StreamHandle, std::shared_ptr<Stream>> streams_;
  absl::flat_hash_map<EventHandle, std::unique_ptr<Event>> events_;
  uint64_t next_stream_id_ = 1;
  int64_t num_device_mallocs_ = 0;
  int64_t num_device_frees_ = 0;
  int64_t num_failed_device_mallocs_ = 0;
  int64_t device_malloc_countdown_ = -1;
  int64_t host_malloc_failures_ = 0;
  int64_t copy_countdown_ = -1;
  int64_t event_countdown_ = -1;

  // Updated by worker threads, hence atomic rather than under `mu_`.
  std::atomic<int64_t> num_copies_{0};
  std::array<std::atomic<size_t>, 3> bytes_copied_{};
};

}  // namespace spillway
