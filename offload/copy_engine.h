// The offload engine's I/O: per device, a copy stream each way (device to host for spills, host to
// device for reloads), the events that order copies against the program's streams, and the pinned
// host pool the copies go through. It issues copies and waits for them, and it tells in which
// direction a failure it found lies; which entries that fails is its owner's to say (the copies in
// flight are the entry table's knowledge), through the failure handler.
//
// A backend reports a failed asynchronous copy once, to the first call that looks at its stream,
// which need not be the call for the copy that failed: a copy call that hears of an earlier
// failure is made again (IssueCopy), and a failed copy of the program's own, heard of on the
// program's stream, is the program's error (ProgramStreamError), never the engine's.
//
// Threads: none of its own. Its owner's lock guards it; its calls take the backend's and the pinned
// pool's locks (below the engine's in the lock order) and call the failure handler on the calling
// thread, with that lock held.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "allocator/errors.h"
#include "offload/entry_table.h"
#include "offload/pinned_pool.h"

namespace spillway {

// A copy the program enqueued on one of its own streams failed, and a call the engine made on
// that stream was the first to find it (backends report a failed copy once): the program's
// error, passed on to the engine's caller rather than blamed on the engine's copies or swallowed.
class ProgramStreamError : public BackendError {
 public:
  explicit ProgramStreamError(const BackendError& error) : BackendError(error) {}
};

class CopyEngine {
 public:
  // Told of a failure found in `direction` (kSpilling: the device-to-host stream; kReloading: the
  // host-to-device one) on `device`: any copy in flight that way may be the one that failed.
  using FailureHandler =
      std::function<void(int device, Residency direction, const std::string& why)>;

  CopyEngine(CachingAllocator& allocator, size_t host_limit_bytes, FailureHandler on_failure);
  // Waits for the copy streams, then destroys them and the events.
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // The device's copy stream in `direction`; its streams and pool are made at the first call for
  // it (on CUDA, a device's context is made by its first stream: not for devices never used).
  StreamRef stream(int device, Residency direction);
  bool started(int device) const;
  // Calls `visit(device)` for each device whose streams were made, in order (the policy runs
  // this at every save: no list is built for it).
  template <typename Visit>
  void ForEachStarted(Visit visit) const {
    for (const auto& d : devices_) {
      if (d != nullptr) visit(d->device);
    }
  }
  // kSpilling for `device`'s copy-out stream, kReloading for its copy-back one, else none (none
  // for a device never started, too).
  std::optional<Residency> DirectionOf(int device, uint64_t stream_id) const;

  // An event of the device's, to be given back with Spare when nothing waits on it any more.
  EventHandle TakeEvent(int device);
  void Spare(int device, EventHandle event);

  // Enqueues `copy` and then `record` (its done event) on the copy stream of `direction`, sorting
  // out failures of earlier copies found there. Returns the allocator's count of stream errors
  // found just before the copy was enqueued (Entry::errors_found_before_copy).
  [[nodiscard]] uint64_t IssueCopy(int device, Residency direction, absl::FunctionRef<void()> copy,
                                   absl::FunctionRef<void()> record);
  // Waits on the host for the copy stream of `direction`; a failure found there goes to the
  // failure handler.
  void WaitStream(int device, Residency direction);
  // Records `event` on a stream of the program's. A copy the program enqueued there that failed
  // is the program's error: thrown as ProgramStreamError.
  void RecordOnProgramStream(int device, EventHandle event, StreamRef stream);

  // Runs `call` on the device's pinned pool. A failure of earlier copies it hears of goes to the
  // failure handler (the direction it was heard on, else both), and PoolCall returns false.
  bool PoolCall(int device, absl::FunctionRef<void(PinnedPool&)> call);
  // Gives a pinned buffer back, reused once `last_use` (a copy stream) has passed it.
  void FreeHost(int device, void* host, std::optional<StreamRef> last_use);
  // Pools made from now on take this limit; those made already are told.
  void SetHostLimit(size_t bytes);
  // Every wholly free pinned chunk goes back to the system.
  void TrimHost();
  size_t host_reserved_bytes() const;

  // The pinned pools' history (PinnedPool::RecordHistory), on the pools made from now on too.
  void RecordHostHistory(bool enabled, size_t max_entries);
  bool host_history_enabled() const { return host_history_entries_.has_value(); }
  // Every started device's pinned chunks, by device, then address.
  std::vector<SegmentSnapshot> HostSegments() const;
  // The pools' histories in one list, oldest first (PyTorch has one host allocator, and one
  // list of its entries).
  std::vector<TraceEntry> HostHistory() const;

 private:
  struct Device {
    Device(Backend& backend, int device, size_t host_limit_bytes);
    ~Device();
    Device(const Device&) = delete;
    Device& operator=(const Device&) = delete;

    Backend& backend;
    const int device;
    const StreamRef d2h;
    const StreamRef h2d;
    PinnedPool pool;
    std::vector<EventHandle> events;  // every event this device created (entries borrow them)
    std::vector<EventHandle> spare;   // not borrowed right now
  };
  Device& Of(int device);
  const Device* Find(int device) const;

  CachingAllocator& allocator_;
  Backend& backend_;
  size_t host_limit_bytes_;
  std::optional<size_t> host_history_entries_;  // while the pools record their history
  const FailureHandler on_failure_;
  std::vector<std::unique_ptr<Device>> devices_;
};

}  // namespace spillway
