// Internals of OffloadEngine shared by its source files (engine.cc: residency and copies;
// engine_failures.cc: copy failures; engine_policy.cc: policies, prefetch, rescue; engine_info.cc:
// statistics and descriptions).
// Not part of the engine's interface.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "offload/engine.h"
#include "offload/pinned_pool.h"

namespace spillway {

// `config`, or InvalidArgumentError naming what ValidateOffloadConfig refused.
const OffloadConfig& CheckedOffloadConfig(const OffloadConfig& config);

// Depth of EngineLocks the calling thread holds.
extern thread_local int engine_depth;

// Storages whose hold the engine gave up while the calling thread held its lock (the entry that
// kept them went): let go of when the thread's outermost EngineLock goes, with the lock released.
// From torch 2.10 on, the last release of a storage that has a Python object takes the GIL and
// may run Python (the object's dealloc); made under the lock, it would wait for the GIL while a
// Python thread that holds the GIL waits for the engine: a deadlock. It may also come back to the
// engine (a finalizer that saves or drops a tensor).
void DeferRelease(std::shared_ptr<Storage> storage);
// Lets go of what the calling thread deferred (and what that deferred in turn).
void ReleaseDeferred() noexcept;

// The engine's lock, also marking the thread as inside the engine. Lock order: the GIL (when the
// caller holds it), then this, then an allocator's lock. Nothing under this lock waits for the
// GIL: storages are let go of after it (DeferRelease), the allocator's stack gatherer records
// nothing inside the engine, and out-of-memory observers hear of a reload's failure from the
// engine's caller. The one storage reference taken under it, AddKeeper's storage factory, is the
// pack hook's, whose caller holds the GIL already (a first reference from 1 to 2 increfs the
// storage's Python object). The torch layer asserts this in debug (sanitizer) builds.
class EngineLock {
 public:
  explicit EngineLock(std::recursive_mutex& mutex) : lock_(mutex) { ++engine_depth; }
  ~EngineLock() {
    --engine_depth;
    lock_.unlock();
    if (engine_depth == 0) ReleaseDeferred();
  }
  EngineLock(const EngineLock&) = delete;
  EngineLock& operator=(const EngineLock&) = delete;

 private:
  std::unique_lock<std::recursive_mutex> lock_;
};

// Marks the engine as running a policy for the scope, so that allocations the policy makes (and
// the pressure handler they trigger) do not start another; restores the previous mark.
class PolicyScope {
 public:
  explicit PolicyScope(bool& flag) : flag_(flag), saved_(flag) { flag_ = true; }
  ~PolicyScope() { flag_ = saved_; }
  PolicyScope(const PolicyScope&) = delete;
  PolicyScope& operator=(const PolicyScope&) = delete;

 private:
  bool& flag_;
  bool saved_;
};

struct OffloadEngine::Entry {
  const void* key = nullptr;
  std::shared_ptr<Storage> storage;
  size_t nbytes = 0;
  int device = 0;
  StreamRef producer;
  uint64_t seq = 0;
  // The seq of each save with keepers still registered, and how many: where a backward may read
  // the storage (a storage saved by two graphs alive at once is read at both saves), so where
  // offloaded_ lists it for prefetch.
  absl::flat_hash_map<uint64_t, int> saves;
  Residency state = Residency::kResident;
  absl::flat_hash_map<KeeperId, ViewInfo> keepers;
  void* host = nullptr;  // pinned copy: spilling, spilled, reloading, or prefetched and unused
  EventHandle copy_done = nullptr;  // the latest D2H or H2D copy of this entry
  StreamRef block_stream;           // allocation stream of the current device block
  bool acquired = false;            // handed to a consumer since its last spill
  bool prefetched = false;          // reloaded ahead of use, not yet acquired
  bool acquiring = false;           // inside Acquire: its own prefetch must not spill it
  bool policy_refused = false;      // a spill was refused for a reason that will not change
  bool saved_under_off = false;     // saved in an "off" block: never spilled, whatever comes later
  // policy_refused covers saves below the min_bytes in force when they were saved, too.
  // The reason of the last refused spill, counted when it was refused; cleared by a spill, so
  // that a refusal after one counts again.
  std::string_view skipped_for;
  // A consumer waits since then (none: nobody waits). A steady clock: stall_us is a duration, and
  // a wall-clock step while backward waited would count it wrong (negative, even).
  std::optional<std::chrono::steady_clock::time_point> stall_since;
  std::string failure;  // why the bytes are lost (state kFailed)
  // Reloaded while still spilling: the D2H copy the reload reads from, until seen complete. Its
  // failure fails the entry although it is reloading by then (FailInFlight).
  EventHandle spill_done = nullptr;
  // How many stream errors the device's allocator had found (CachingAllocator::StreamErrorsFound)
  // just before the latest copy (and the spill_done copy) was enqueued: a failure it found
  // later, and passed on, may be that copy's; one it found before was an earlier copy's.
  uint64_t errors_found_before_copy = 0;
  uint64_t errors_found_before_spill = 0;
  // kFailed: the state the failure interrupted, so that dropping the entry still orders reuse of
  // its block and host buffer after a copy that may be running (FailInFlight fails every copy in
  // flight in one direction, the healthy ones too).
  Residency failed_while = Residency::kResident;
  int64_t spill_count = 0;
  int64_t reload_count = 0;
  int64_t last_spill_us = 0;
  int64_t last_reload_us = 0;
};

struct OffloadEngine::DeviceContext {
  DeviceContext(Backend& backend, int device, const OffloadConfig& config)
      : backend(backend),
        device(device),
        d2h(backend.create_stream(device)),
        h2d(backend.create_stream(device)),
        pool(backend, device, PinnedPool::Options{size_t{64} << 20, config.host_limit_bytes}) {}
  ~DeviceContext() {
    try {
      backend.synchronize_stream(device, d2h.handle);
      backend.synchronize_stream(device, h2d.handle);
      for (EventHandle e : events) backend.destroy_event(device, e);
      backend.destroy_stream(device, d2h.handle);
      backend.destroy_stream(device, h2d.handle);
    } catch (const std::exception&) {
      // Destructors cannot report; the backend reclaims its objects when it goes.
    }
  }
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  Backend& backend;
  const int device;
  const StreamRef d2h;
  const StreamRef h2d;
  PinnedPool pool;
  std::vector<EventHandle> events;  // every event this context created (entries borrow them)
  std::vector<EventHandle> spare;   // not borrowed right now
  size_t prefetched_bytes = 0;      // reloaded ahead of use on this device, not yet acquired
  // The most bytes allocated on this device at a save of the latest forward: its footprint, which
  // an adaptive prefetch (OffloadConfig::prefetch_bytes unset) does not take backward's past.
  size_t saving_high = 0;
  // The most bytes spilled at once since the latest forward began: an adaptive prefetch reloads
  // at most an eighth of it ahead (beyond the next save).
  size_t spilled_high = 0;
  // Bytes of prefetches `auto` gave back under its budget since the latest forward began: room
  // backward's own allocations needed, which an adaptive prefetch leaves to them.
  size_t prefetch_room_taken = 0;
  // A save was read since the last save: the next save starts another forward, whose footprint
  // is its own (a larger one before, an evaluation's or another batch size's, says nothing).
  bool read_since_save = false;
};

}  // namespace spillway
