#include "offload/engine.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"
#include "allocator/format.h"
#include "allocator/history.h"
#include "allocator/speculative.h"
#include "offload/engine_internal.h"

// Residency and copies: spill, reload, drop, synchronization. Keepers are registered in
// engine_keepers.cc, copy failures handled in engine_failures.cc.
namespace spillway {

thread_local int engine_ops = 0;
thread_local const void* engine_lock_holder = nullptr;

namespace {
thread_local std::vector<std::shared_ptr<Storage>> deferred_releases;
}  // namespace

void DeferRelease(std::shared_ptr<Storage> storage) {
  deferred_releases.push_back(std::move(storage));
}

void ReleaseDeferred() noexcept {
  // A release may defer more (its code came back to the engine): until none is left.
  while (!deferred_releases.empty()) {
    std::vector<std::shared_ptr<Storage>> now;
    now.swap(deferred_releases);
    now.clear();
  }
}

bool OffloadEngine::InsideEngineOnThisThread() { return engine_ops > 0; }

void OffloadEngine::Note(OffloadEvent::Kind kind, const Entry& e) {
  if (events_.size() == kMaxEvents) events_.pop_front();
  events_.push_back(OffloadEvent{NowMicros(), kind, e.device, e.key, e.nbytes});
}

const OffloadConfig& CheckedOffloadConfig(const OffloadConfig& config) {
  if (const absl::Status status = ValidateOffloadConfig(config); !status.ok()) {
    throw InvalidArgumentError(std::string(status.message()));
  }
  return config;
}

// Checked before the engine registers its callbacks with the allocator, so a refused
// configuration leaves nothing behind.
OffloadEngine::OffloadEngine(CachingAllocator& allocator, const OffloadConfig& config)
    : allocator_(allocator),
      backend_(allocator.backend()),
      config_(CheckedOffloadConfig(config)),
      copies_(allocator, config_.host_limit_bytes,
              [this](int device, Residency direction, const std::string& why) {
                FailInFlight(device, direction, why);
              }),
      table_(static_cast<size_t>(allocator.device_count())),
      devices_(static_cast<size_t>(allocator.device_count())) {
  table_.SetWindowLimit(WindowLimit(config_));
  oom_callback_id_ = allocator_.AddFreeMemoryCallback(
      [this](int device, size_t bytes) { return ReleaseMemory(device, bytes); });
  allocator_.SetPressureHandler(
      [this](int device, size_t incoming_bytes) { OnPressure(device, incoming_bytes); });
  allocator_.SetStreamErrorObserver([this](const StreamError& error) { OnStreamError(error); });
  try {
    // A budget fraction on a device that holds memory already asks for the device total, which
    // may fail (on CUDA the query creates the context): then the allocator must keep nothing of
    // an engine that never was, its callbacks least of all.
    UpdateWatermarks();
  } catch (...) {
    DetachFromAllocator();
    throw;
  }
}

void OffloadEngine::DetachFromAllocator() {
  allocator_.RemoveFreeMemoryCallback(oom_callback_id_);
  allocator_.SetPressureHandler({});
  allocator_.SetStreamErrorObserver({});
  for (int d = 0; d < allocator_.device_count(); ++d) {
    allocator_.SetWatermark(d, std::numeric_limits<size_t>::max());
  }
}

OffloadEngine::~OffloadEngine() {
  DetachFromAllocator();
  EngineLock lock(mutex_, this);
  try {
    SynchronizeLocked();
  } catch (const std::exception&) {
  }
  // Entries still alive give their host copies back before the pools go (with copies_), and
  // their storages once the lock is released (DeferRelease).
  for (std::unique_ptr<Entry>& entry : table_.TakeAll()) {
    ReleaseHost(*entry, std::nullopt);
    DeferRelease(std::move(entry->storage));
  }
}

void OffloadEngine::WaitResident(KeeperId id) {
  EngineLock lock(mutex_, this);
  Entry& e = EntryOf(id);
  // Through Refresh: a failed copy found by this wait (this entry's or another's) must mark the
  // entries it may belong to failed, not escape with the entry left to pass for resident.
  Refresh(e, /*wait=*/true);
  if (e.state == Residency::kFailed) ThrowLost(e);
}

void OffloadEngine::ThrowLost(const Entry& e) {
  throw Error(absl::StrFormat("the saved storage of %s could not be brought back: %s",
                              FormatBytes(e.nbytes), e.failure));
}

void OffloadEngine::Drop(Entry& e) {
  DiscardCopies(e);
  if (e.copy_done != nullptr) copies_.Spare(e.device, e.copy_done);
  if (e.spill_done != nullptr) copies_.Spare(e.device, e.spill_done);
  --stats_.num_entries;
  // Out of the table, which is left whole before the entry is destroyed (at the end of this
  // scope). The engine's hold on the storage goes once no engine lock is held (DeferRelease).
  std::unique_ptr<Entry> gone = table_.Erase(e);
  if (stats_.num_entries == 0) jumps_.OnEmpty();  // a cycle (a training step) ended
  DeferRelease(std::move(gone->storage));
}

void OffloadEngine::MarkReleased(const void* key, const std::string& why) {
  EngineLock lock(mutex_, this);
  Entry* const entry = table_.Current(key);
  if (entry == nullptr) return;
  Entry& e = *entry;
  DiscardCopies(e);
  // Never reloaded now: its bytes must not hold the prefetch window against older entries.
  table_.LeaveWindow(e);
  // Lost already (a failed copy, an earlier release): its saves keep saying why they were lost.
  if (e.state == Residency::kFailed) return;
  e.state = Residency::kFailed;
  e.failure = why;
}

bool OffloadEngine::EndPrefetch(Entry& e) {
  if (!e.prefetched) return false;
  State(e.device).prefetched_bytes -= e.nbytes;
  e.prefetched = false;
  return true;
}

void OffloadEngine::DiscardCopies(Entry& e) {
  Refresh(e);
  EndPrefetch(e);
  // A copy may still be reading or writing the host buffer: the pool reuses it only after the
  // stream that ran the copy has passed it.
  const Residency copying = e.state == Residency::kFailed ? e.failed_while : e.state;
  std::optional<StreamRef> last_use;
  if (copying == Residency::kSpilling || copying == Residency::kReloading) {
    last_use = copies_.stream(e.device, copying);
  }
  if (copying == Residency::kReloading) {
    // The copy may still be writing the device block, and no stream need have waited for it (a
    // prefetch nobody acquired). Once freed, the block is reused in the order of the stream it
    // was allocated on, so that stream waits for the copy. (Not a stream use of the engine's
    // copy stream: the storage may outlive the engine and its streams.) Where the host itself
    // touches memory (the simulated device's CPU kernels) no stream wait orders its writes: the
    // host waits for the copy, as it does when the stream cannot be made to wait.
    bool ordered = false;
    if (backend_.accesses_follow_streams()) {
      try {
        backend_.stream_wait_event(e.device, e.block_stream.handle, e.copy_done);
        ordered = true;
      } catch (const BackendError&) {
      }
    }
    if (!ordered) {
      try {
        backend_.synchronize_event(e.device, e.copy_done);
      } catch (const BackendError& error) {
        FailInFlight(e.device, Residency::kReloading, error.what());
      }
    }
  }
  ReleaseHost(e, last_use);
  // Counted after the host buffer went back: the pool may have heard there that this entry's
  // spill failed, and MarkFailed took its bytes out of the spilled ones then.
  if (e.state == Residency::kSpilling || e.state == Residency::kSpilled) {
    CountSpilled(e, false);
    Note(OffloadEvent::Kind::kDropSpilled, e);
  }
}

void OffloadEngine::ReleaseHost(Entry& e, std::optional<StreamRef> last_use) {
  if (e.host == nullptr) return;
  copies_.FreeHost(e.device, e.host, last_use);
  e.host = nullptr;
  stats_.host_bytes.Decrease(static_cast<int64_t>(e.nbytes));
}

void OffloadEngine::Refresh(Entry& e, bool wait) {
  if (e.state != Residency::kSpilling && e.state != Residency::kReloading) return;
  // The spill a reload reads from first: the copy stream reports its failure once, to whoever
  // asks first, and the reload's own event lives on the other stream.
  if (e.spill_done != nullptr) {
    if (!CopyDone(e, e.spill_done, Residency::kSpilling, wait)) return;
    copies_.Spare(e.device, e.spill_done);
    e.spill_done = nullptr;
  }
  if (!CopyDone(e, e.copy_done, e.state, wait)) return;
  if (e.state == Residency::kSpilling) {
    e.state = Residency::kSpilled;
    return;
  }
  e.state = Residency::kResident;
  if (e.stall_since.has_value()) {
    stats_.stall_us += std::chrono::duration_cast<std::chrono::microseconds>(
                           std::chrono::steady_clock::now() - *e.stall_since)
                           .count();
    e.stall_since.reset();
  }
  // The H2D copy has completed. A prefetch nobody acquired yet keeps its host copy, so that the
  // out-of-memory rescue can take the device copy back for free (GiveBackPrefetches).
  if (!e.prefetched) ReleaseHost(e, std::nullopt);
}

void OffloadEngine::StartStall(Entry& e) {
  // One reload is one stall, however many views of the storage are acquired while it runs.
  if (e.stall_since.has_value()) return;
  ++stats_.num_stalls;
  e.stall_since = std::chrono::steady_clock::now();
}

bool OffloadEngine::Eligible(const Entry& e) const {
  return e.state == Residency::kResident && !e.acquiring && !e.saved_under_off &&
         e.storage->data() != nullptr && e.storage->external_holders() == 0;
}

bool OffloadEngine::PolicyMaySpill(const Entry& e) {
  return e.state == Residency::kResident && !e.policy_refused && !e.acquired && !e.prefetched &&
         !e.saved_under_off && !e.saved_in_backward;
}

void OffloadEngine::CountSkipOf(Entry& e, std::string_view reason) {
  if (e.skipped_for == reason) return;
  e.skipped_for = reason;
  CountSkipLocked(reason);
}

OffloadEngine::SpillResult OffloadEngine::Spill(Entry& e) {
  // A prefetch keeps its host copy until acquired, and the rescue gives those back rather than
  // copy them out again (GiveBackPrefetches): never a second host buffer for one entry.
  if (e.host != nullptr) return {SpillOutcome::kRefused};
  // The entry's size and block were taken at its first save. A storage resized in place since
  // then (resize_, an out= op), or given other memory, has other bytes: a copy of e.nbytes would
  // leave out what a later save reads, or run past a smaller block. Kept as it is, its saves read
  // the live storage.
  const auto info = allocator_.Lookup(e.storage->data());
  if (e.storage->nbytes() != e.nbytes || !info || info->ptr != e.storage->data()) {
    CountSkipOf(e, kSkipResized);
    e.policy_refused = true;
    return {SpillOutcome::kRefused};
  }
  const StreamRef d2h = copies_.stream(e.device, Residency::kSpilling);
  absl::StatusOr<void*> host = absl::UnknownError("not tried");
  // A failure the pool hears of is an earlier copy's: asked again, it allocates (or hears of the
  // other stream's failure; then this spill is not made now).
  const auto allocate = [&](PinnedPool& pool) { host = pool.Allocate(e.nbytes); };
  if (!copies_.PoolCall(e.device, allocate) && !copies_.PoolCall(e.device, allocate)) {
    CountSkipOf(e, kSkipCopyError);
    return {SpillOutcome::kRefused};
  }
  if (!host.ok()) {
    CountSkipOf(e, absl::IsResourceExhausted(host.status()) ? kSkipHostLimit : kSkipNoPinned);
    return {SpillOutcome::kNoHostMemory};
  }
  void* device_ptr = e.storage->data();
  uint64_t errors_found_before = 0;
  try {
    // Spare again at once, whatever happens next: the wait captures the event when it is issued
    // (nothing takes an event between here and there), and a failed record must not leave it
    // out of the pool, one more event per failure.
    EventHandle produced = copies_.TakeEvent(e.device);
    copies_.Spare(e.device, produced);
    copies_.RecordOnProgramStream(e.device, produced, e.producer);
    backend_.stream_wait_event(e.device, d2h.handle, produced);
    if (e.copy_done == nullptr) e.copy_done = copies_.TakeEvent(e.device);
    errors_found_before = copies_.IssueCopy(
        e.device, Residency::kSpilling,
        [&] {
          backend_.memcpy_async(e.device, *host, device_ptr, e.nbytes, CopyKind::kDeviceToHost,
                                d2h.handle);
        },
        [&] { backend_.record_event(e.device, e.copy_done, d2h.handle); });
  } catch (const ProgramStreamError&) {
    copies_.FreeHost(e.device, *host, d2h);
    throw;
  } catch (const BackendError&) {
    // Nothing of this spill ran (a failing call has no effect), or only its copy, into a buffer
    // the pool reuses after the copy stream has passed it.
    copies_.FreeHost(e.device, *host, d2h);
    CountSkipOf(e, kSkipCopyError);
    return {SpillOutcome::kRefused};
  }
  // In flight from here, accounting included: a failure that the free below happens to find
  // must be able to fail this entry too.
  e.host = *host;
  e.state = Residency::kSpilling;
  e.spilled_block = device_ptr;
  e.errors_found_before_copy = errors_found_before;
  table_.ListOffloaded(e);
  e.acquired = false;
  // Only a prefetch taken back (TakeBack: no host copy) can be spilled while a prefetch, by the
  // out-of-memory rescue: spilled, it is one no more.
  EndPrefetch(e);
  ++e.spill_count;
  e.last_spill_us = NowMicros();
  ++stats_.num_spills;
  stats_.bytes_to_host += static_cast<int64_t>(e.nbytes);
  CountSpilled(e, true);
  stats_.host_bytes.Increase(static_cast<int64_t>(e.nbytes));
  Note(OffloadEvent::Kind::kSpill, e);
  // Reuse of the device block waits for the copy: one stream use, then the free; tagged, so that
  // the engine can take it back while it waits (TakeBack).
  allocator_.RecordStream(device_ptr, d2h);
  e.spilled_tag = allocator_.TagForRevival(device_ptr, e.device);
  e.storage->drop_device_memory();
  e.skipped_for = {};
  return {SpillOutcome::kSpilled, info->size};
}

bool OffloadEngine::TakeBack(Entry& e) {
  // The allocator gives the block back only while the spill's free of it is pending, and only
  // that allocation's (the tag): the memory at that address may be another's by now, the
  // allocator having freed it early for a stream ordered after the copy.
  if (!take_back_ || e.state != Residency::kSpilling) return false;
  const StreamRef d2h = copies_.stream(e.device, Residency::kSpilling);
  void* const block = e.spilled_block;
  if (!allocator_.Revive(block, e.device, e.spilled_tag)) return false;
  if (!e.storage->adopt_device_memory(block)) {
    // Its stream uses were recorded again: freed, it waits for the copy as it did before.
    allocator_.Free(block);
    return false;
  }
  // The copy runs on, reading the block and writing the host buffer: the buffer goes back to the
  // pool once the copy stream has passed it, and the block's next free waits for that stream
  // (Revive recorded its use again). Resident from here, the entry is no copy's any more: a
  // failure of that copy (FailInFlight) loses nothing of it.
  ReleaseHost(e, d2h);
  e.state = Residency::kResident;
  CountSpilled(e, false);
  // Its spill freed nothing: eager's next run of this forward spills that much less
  // (ForwardSpillQuota).
  DeviceState& state = State(e.device);
  if (e.forward == state.forward) state.quota.OnTakenBack(e.nbytes);
  Note(OffloadEvent::Kind::kTakenBack, e);
  ++stats_.num_taken_back;
  stats_.bytes_taken_back += static_cast<int64_t>(e.nbytes);
  return true;
}

bool OffloadEngine::Reload(EngineLock& lock, Entry& e, StreamRef consumer, bool prefetch) {
  if (TakeBack(e)) return true;
  // The memory is allocated with the engine's lock released: the allocation may run the
  // allocator's budget handler and out-of-memory rescue, which take the lock as any caller does
  // (and, for a prefetch's speculative allocation, do nothing). Meanwhile the entry is
  // `allocating`: nobody else reloads it (a read of it waits, a prefetch passes it by), nobody
  // drops it (its last keeper's going leaves that to this call), and nothing reads its storage's
  // pointer.
  e.allocating = true;
  State(e.device).reloading_bytes += e.nbytes;
  void* ptr = nullptr;
  std::exception_ptr failure;
  {
    const EngineLock::Unlocked unlocked(lock);
    try {
      // A prefetch is a guess: it takes free memory only, and a miss is no out-of-memory error
      // (the ladder's waits and cache releases for it cost more than the prefetch could save).
      std::optional<SpeculativeAllocations> speculative;
      if (prefetch) speculative.emplace();
      ptr = e.storage->allocate_device_memory(consumer);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  e.allocating = false;
  State(e.device).reloading_bytes -= e.nbytes;
  allocated_.notify_all();
  if (e.keepers.empty()) {  // only a prefetch's entry can go meanwhile: a read keeps its own
    if (ptr != nullptr) e.storage->drop_device_memory();
    Drop(e);
    return false;
  }
  if (failure != nullptr) {
    try {
      std::rethrow_exception(failure);
    } catch (const OutOfMemoryError& oom) {
      throw OutOfMemoryError(absl::StrFormat("Spillway could not reload a saved storage of %s: %s",
                                             FormatBytes(e.nbytes), oom.what()),
                             oom.requested_bytes(), oom.device());
    }
  }
  // Meanwhile the out-of-memory rescue's waits, or another thread's, may have found this entry's
  // own spill failed, or the program released the storage by force: nothing to reload then.
  if (e.state == Residency::kFailed) {
    e.storage->drop_device_memory();
    ThrowLost(e);
  }
  IssueReload(e, ptr, consumer);
  return true;
}

void OffloadEngine::IssueReload(Entry& e, void* ptr, StreamRef consumer) {
  const StreamRef h2d = copies_.stream(e.device, Residency::kReloading);
  // Reload requested while still spilling: the copy reads the host buffer only after the D2H
  // filled it, and the entry keeps that D2H's event to learn whether it did (spill_done).
  const bool after_spill = e.state == Residency::kSpilling;
  EventHandle reload_done = e.copy_done;
  bool took_reload_done = false;
  uint64_t errors_found_before = 0;
  try {
    // The block may have been used by earlier work on the consumer stream: the H2D copy must
    // not write into it before that work is done (DeepSpeed #8186).
    EventHandle allocated = copies_.TakeEvent(e.device);
    copies_.Spare(e.device, allocated);  // as in Spill: spare again whatever happens next
    copies_.RecordOnProgramStream(e.device, allocated, consumer);
    backend_.stream_wait_event(e.device, h2d.handle, allocated);
    if (after_spill) {
      backend_.stream_wait_event(e.device, h2d.handle, e.copy_done);
      reload_done = copies_.TakeEvent(e.device);
      took_reload_done = true;
    }
    errors_found_before = copies_.IssueCopy(
        e.device, Residency::kReloading,
        [&] {
          backend_.memcpy_async(e.device, ptr, e.host, e.nbytes, CopyKind::kHostToDevice,
                                h2d.handle);
        },
        [&] { backend_.record_event(e.device, reload_done, h2d.handle); });
  } catch (const BackendError&) {
    if (took_reload_done) copies_.Spare(e.device, reload_done);
    // The copy may already be enqueued (only the copy-done record failed): the block goes back
    // with its reuse deferred until the copy stream has passed it.
    allocator_.RecordStream(ptr, h2d);
    e.storage->drop_device_memory();
    throw;
  }
  if (after_spill) {
    e.spill_done = e.copy_done;
    e.copy_done = reload_done;
    e.errors_found_before_spill = e.errors_found_before_copy;
  }
  e.errors_found_before_copy = errors_found_before;
  if (e.state == Residency::kSpilling || e.state == Residency::kSpilled) {
    CountSpilled(e, false);
    Note(OffloadEvent::Kind::kReload, e);
  }
  e.block_stream = consumer;
  e.state = Residency::kReloading;
  ++e.reload_count;
  e.last_reload_us = NowMicros();
  ++stats_.num_reloads;
  stats_.bytes_to_device += static_cast<int64_t>(e.nbytes);
}

void* OffloadEngine::Acquire(KeeperId id, StreamRef consumer) {
  EngineLock lock(mutex_, this);
  const Keeper& keeper = table_.KeeperOf(id);
  Entry& e = *keeper.entry;
  const uint64_t save_seq = keeper.save_seq;  // read now: the policy runs below may add keepers
  // Another thread allocates this storage's memory for a reload (a read of another view, or a
  // prefetch): its reload is issued once that is done, and this read waits for its copy.
  lock.Wait(allocated_, [&e] { return !e.allocating; });
  TakeHeardFailures(e.device);  // before a reload is issued, which they would fail too
  State(e.device).footprint.OnRead();
  jumps_.OnRead(save_seq);
  Refresh(e);
  switch (e.state) {
    case Residency::kFailed:
      ThrowLost(e);
    case Residency::kSpilling:
    case Residency::kSpilled:
      Reload(lock, e, consumer, /*prefetch=*/false);
      if (e.state == Residency::kReloading) StartStall(e);  // not when taken back (TakeBack)
      break;
    case Residency::kReloading:
      StartStall(e);  // prefetched (or acquired through another view), but not finished yet
      break;
    case Residency::kResident:
      if (e.prefetched) ++stats_.num_prefetch_hits;
      break;
  }
  // Acquired from here on, whatever the waits below do: an entry brought back is never spilled
  // by a policy again (PolicyMaySpill), and must not pass for one that was never used.
  e.acquired = true;
  if (EndPrefetch(e)) {
    // Used now: the host copy kept for a give-back goes (if still copying, Refresh frees it).
    if (e.state == Residency::kResident) ReleaseHost(e, std::nullopt);
  }
  if (e.state == Residency::kReloading && !skip_consumer_wait_) {
    backend_.stream_wait_event(e.device, consumer.handle, e.copy_done);
  }
  // A block allocated on another stream (a prefetch) is now used on `consumer` too.
  if (consumer.id != e.block_stream.id) {
    allocator_.RecordStream(e.storage->data(), consumer);
  }
  e.acquiring = true;
  try {
    Prefetch(lock, e.device, save_seq, consumer);
  } catch (...) {
    e.acquiring = false;
    throw;
  }
  e.acquiring = false;
  // The prefetch's own looks at the copy streams (a reload's copy call, another entry's wait) may
  // have found this entry's copy failed: its pointer would hand out bytes that never arrived.
  if (e.state == Residency::kFailed) ThrowLost(e);
  return e.storage->data();
}

void OffloadEngine::TrimHostMemory() {
  EngineLock lock(mutex_, this);
  // Reloads that finished while nobody looked give their host copies back first.
  for (const auto& [seq, entry] : table_.InSaveOrder()) Refresh(*entry);
  copies_.TrimHost();
}

void OffloadEngine::Synchronize() {
  EngineLock lock(mutex_, this);
  SynchronizeLocked();
}

void OffloadEngine::SynchronizeLocked() {
  // Entry by entry first, so that a failed copy marks its own entry failed (see ReleaseMemory);
  // the stream-wide waits then cover the copies of entries dropped meanwhile.
  for (const auto& [seq, entry] : table_.InSaveOrder()) Refresh(*entry, /*wait=*/true);
  copies_.ForEachStarted([&](int device) {
    copies_.WaitStream(device, Residency::kSpilling);
    copies_.WaitStream(device, Residency::kReloading);
  });
  for (const auto& [seq, entry] : table_.InSaveOrder()) Refresh(*entry);
  // The blocks spills gave back waited only for those copies: free them now, so that statistics
  // and snapshots taken after Synchronize show them free rather than pending until the next
  // allocation.
  copies_.ForEachStarted([&](int device) { allocator_.ProcessEvents(device); });
}

const void* OffloadEngine::window_oldest_for_testing(int device) const {
  EngineLock lock(mutex_, this);
  return table_.WindowOldestKey(device);
}

StreamRef OffloadEngine::h2d_stream_for_testing(int device) {
  EngineLock lock(mutex_, this);
  return copies_.stream(device, Residency::kReloading);
}

StreamRef OffloadEngine::d2h_stream_for_testing(int device) {
  EngineLock lock(mutex_, this);
  return copies_.stream(device, Residency::kSpilling);
}

}  // namespace spillway
