#include "offload/engine.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"
#include "allocator/format.h"
#include "allocator/history.h"

namespace spillway {

namespace {

thread_local int engine_depth = 0;

// The engine's lock, also marking the thread as inside the engine.
class EngineLock {
 public:
  explicit EngineLock(std::recursive_mutex& mutex) : lock_(mutex) { ++engine_depth; }
  ~EngineLock() { --engine_depth; }
  EngineLock(const EngineLock&) = delete;
  EngineLock& operator=(const EngineLock&) = delete;

 private:
  std::lock_guard<std::recursive_mutex> lock_;
};

}  // namespace

bool OffloadEngine::InsideEngineOnThisThread() { return engine_depth > 0; }

std::string_view OffloadEventName(OffloadEvent::Kind kind) {
  switch (kind) {
    case OffloadEvent::Kind::kSpill:
      return "spill";
    case OffloadEvent::Kind::kReload:
      return "reload";
    case OffloadEvent::Kind::kDropSpilled:
      return "drop_spilled";
    case OffloadEvent::Kind::kFailed:
      return "failed";
  }
  return "unknown";
}

std::vector<OffloadEvent> OffloadEngine::Events() const {
  EngineLock lock(mutex_);
  return {events_.begin(), events_.end()};
}

std::string_view ResidencyName(Residency residency) {
  switch (residency) {
    case Residency::kResident:
      return "resident";
    case Residency::kSpilling:
      return "spilling";
    case Residency::kSpilled:
      return "spilled";
    case Residency::kReloading:
      return "reloading";
    case Residency::kFailed:
      return "failed";
  }
  return "unknown";
}

struct OffloadEngine::Entry {
  const void* key = nullptr;
  std::shared_ptr<Storage> storage;
  size_t nbytes = 0;
  int device = 0;
  StreamRef producer;
  uint64_t seq = 0;
  Residency state = Residency::kResident;
  absl::flat_hash_map<KeeperId, ViewInfo> keepers;
  void* host = nullptr;             // pinned copy while spilling, spilled or reloading
  EventHandle copy_done = nullptr;  // the latest D2H or H2D copy of this entry
  StreamRef block_stream;           // allocation stream of the current device block
  bool acquired = false;            // handed to a consumer since its last spill
  bool prefetched = false;          // reloaded ahead of use, not yet acquired
  bool acquiring = false;           // inside Acquire: its own prefetch must not spill it
  bool policy_refused = false;      // a spill was refused for a reason that will not change
  int64_t stall_since_us = 0;       // consumer is waiting since then (0 = nobody waits)
  std::string failure;              // why the bytes are lost (state kFailed)
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
};

void OffloadEngine::Note(OffloadEvent::Kind kind, const Entry& e) {
  if (events_.size() == kMaxEvents) events_.pop_front();
  events_.push_back(OffloadEvent{NowMicros(), kind, e.device, e.key, e.nbytes});
}

OffloadEngine::OffloadEngine(CachingAllocator& allocator, OffloadConfig config)
    : allocator_(allocator), backend_(allocator.backend()), config_(std::move(config)) {
  devices_.resize(static_cast<size_t>(allocator_.device_count()));
  oom_callback_id_ = allocator_.AddFreeMemoryCallback(
      [this](int device, size_t bytes) { return ReleaseMemory(device, bytes); });
  allocator_.SetPressureHandler([this](int device) { OnPressure(device); });
  allocator_.SetStreamErrorObserver([this](const StreamError& error) { OnStreamError(error); });
  UpdateWatermarks();
}

OffloadEngine::~OffloadEngine() {
  allocator_.RemoveFreeMemoryCallback(oom_callback_id_);
  allocator_.SetPressureHandler({});
  allocator_.SetStreamErrorObserver({});
  for (int d = 0; d < allocator_.device_count(); ++d) {
    allocator_.SetWatermark(d, std::numeric_limits<size_t>::max());
  }
  EngineLock lock(mutex_);
  try {
    Synchronize();
  } catch (const std::exception&) {
  }
  // Entries still alive give their host copies back before the pools go.
  for (auto& [key, entry] : entries_) ReleaseHost(*entry, std::nullopt);
  entries_.clear();
}

OffloadEngine::DeviceContext& OffloadEngine::Device(int device) {
  auto& slot = devices_.at(static_cast<size_t>(device));
  if (slot == nullptr) slot = std::make_unique<DeviceContext>(backend_, device, config_);
  return *slot;
}

EventHandle OffloadEngine::TakeEvent(DeviceContext& dc) {
  if (!dc.spare.empty()) {
    EventHandle e = dc.spare.back();
    dc.spare.pop_back();
    return e;
  }
  EventHandle e = backend_.create_event(dc.device);
  dc.events.push_back(e);
  return e;
}

std::optional<KeeperId> OffloadEngine::AddKeeper(const void* key,
                                                 const StorageFactory& make_storage, ViewInfo view,
                                                 StreamRef producer) {
  if (key == nullptr || !make_storage) {
    throw InvalidArgumentError("OffloadEngine::AddKeeper: key and storage factory must be given");
  }
  EngineLock lock(mutex_);
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    std::shared_ptr<Storage> storage = make_storage();
    if (storage == nullptr) {
      throw InvalidArgumentError("OffloadEngine::AddKeeper: the storage factory returned null");
    }
    const size_t nbytes = storage->nbytes();
    if (nbytes == 0) {
      CountSkip(kSkipEmpty);
      return std::nullopt;
    }
    const auto info = allocator_.Lookup(storage->data());
    if (!info || info->ptr != storage->data() || info->requested < nbytes) {
      CountSkip(kSkipForeign);
      return std::nullopt;
    }
    auto entry = std::make_unique<Entry>();
    entry->key = key;
    entry->storage = std::move(storage);
    entry->nbytes = nbytes;
    entry->device = info->device;
    entry->producer = producer;
    entry->block_stream = info->stream;
    entry->seq = next_seq_++;
    if (nbytes < config_.min_bytes) {
      entry->policy_refused = true;
      CountSkip(kSkipSmall);
    }
    by_seq_[entry->seq] = entry.get();
    it = entries_.emplace(key, std::move(entry)).first;
    ++stats_.num_entries;
  }
  Entry& e = *it->second;
  const KeeperId id = next_keeper_++;
  e.keepers.emplace(id, std::move(view));
  keepers_[id] = &e;
  ++stats_.num_keepers;
  RunPolicy();
  return id;
}

OffloadEngine::Entry& OffloadEngine::EntryOf(KeeperId id) const {
  auto it = keepers_.find(id);
  if (it == keepers_.end()) {
    throw InvalidArgumentError(absl::StrFormat(
        "offload keeper %d is not registered (released already, or never added)", id));
  }
  return *it->second;
}

std::shared_ptr<Storage> OffloadEngine::StorageOf(KeeperId id) const {
  EngineLock lock(mutex_);
  auto it = keepers_.find(id);
  return it == keepers_.end() ? nullptr : it->second->storage;
}

void OffloadEngine::WaitResident(KeeperId id) {
  EngineLock lock(mutex_);
  Entry& e = EntryOf(id);
  if (e.state == Residency::kReloading) {
    backend_.synchronize_event(e.device, e.copy_done);
    Refresh(e);
  }
}

void OffloadEngine::RemoveKeeper(KeeperId id) {
  EngineLock lock(mutex_);
  Entry& e = EntryOf(id);
  keepers_.erase(id);
  e.keepers.erase(id);
  if (e.keepers.empty()) Drop(e);
}

void OffloadEngine::Drop(Entry& e) {
  Refresh(e);
  if (e.prefetched) prefetched_bytes_ -= e.nbytes;
  if (e.state == Residency::kSpilling || e.state == Residency::kSpilled) {
    stats_.spilled_bytes.Decrease(static_cast<int64_t>(e.nbytes));
    Note(OffloadEvent::Kind::kDropSpilled, e);
  }
  // A copy may still be reading or writing the host buffer: the pool reuses it only after the
  // stream that ran the copy has passed it.
  const DeviceContext& dc = Device(e.device);
  std::optional<StreamRef> last_use;
  if (e.state == Residency::kSpilling) last_use = dc.d2h;
  if (e.state == Residency::kReloading) {
    last_use = dc.h2d;
    // The copy may still be writing the device block, and no stream need have waited for it (a
    // prefetch nobody acquired). Once freed, the block is reused in the order of the stream it
    // was allocated on, so that stream waits for the copy. (Not a stream use of the engine's
    // copy stream: the storage may outlive the engine and its streams.)
    backend_.stream_wait_event(e.device, e.block_stream.handle, e.copy_done);
  }
  ReleaseHost(e, last_use);
  if (e.copy_done != nullptr) Device(e.device).spare.push_back(e.copy_done);
  by_seq_.erase(e.seq);
  --stats_.num_entries;
  entries_.erase(e.key);  // destroys `e`, releasing the engine's hold on the storage
}

void OffloadEngine::FreeHostBuffer(int device, void* host, std::optional<StreamRef> last_use) {
  try {
    Device(device).pool.Free(host, last_use);
  } catch (const BackendError& error) {
    // Work on a copy stream failed earlier (the pool's event record found it); the buffer itself
    // went back safely.
    FailInFlight(device, Residency::kSpilling, error.what());
    FailInFlight(device, Residency::kReloading, error.what());
  }
}

void OffloadEngine::ReleaseHost(Entry& e, std::optional<StreamRef> last_use) {
  if (e.host == nullptr) return;
  FreeHostBuffer(e.device, e.host, last_use);
  e.host = nullptr;
  stats_.host_bytes.Decrease(static_cast<int64_t>(e.nbytes));
}

void OffloadEngine::MarkFailed(Entry& e, const std::string& why) {
  // The device copy is gone (spilling), or the bytes never arrived (reloading).
  if (e.state == Residency::kSpilling) {
    stats_.spilled_bytes.Decrease(static_cast<int64_t>(e.nbytes));
    Note(OffloadEvent::Kind::kFailed, e);
  }
  e.state = Residency::kFailed;
  e.failure = why;
}

void OffloadEngine::FailInFlight(int device, Residency in_flight, const std::string& why) {
  // A backend reports a failed asynchronous copy to whoever looks first, not necessarily for
  // the copy that failed. Any copy in flight in that direction may be the one: none of their
  // bytes can be trusted, and an error at use beats silently wrong data.
  for (auto& [seq, entry] : by_seq_) {
    if (entry->device == device && entry->state == in_flight) MarkFailed(*entry, why);
  }
}

void OffloadEngine::OnStreamError(const StreamError& error) {
  EngineLock lock(mutex_);
  if (error.device < 0 || error.device >= static_cast<int>(devices_.size())) return;
  const DeviceContext* dc = devices_[static_cast<size_t>(error.device)].get();
  if (dc == nullptr) return;
  if (error.stream == dc->d2h.id) FailInFlight(error.device, Residency::kSpilling, error.message);
  if (error.stream == dc->h2d.id) FailInFlight(error.device, Residency::kReloading, error.message);
}

void OffloadEngine::Refresh(Entry& e, bool wait) {
  if (e.state != Residency::kSpilling && e.state != Residency::kReloading) return;
  bool done = false;
  try {
    if (wait) {
      backend_.synchronize_event(e.device, e.copy_done);
      done = true;
    } else {
      done = backend_.query_event(e.device, e.copy_done);
    }
  } catch (const BackendError& error) {
    FailInFlight(e.device, e.state, error.what());
    return;
  }
  if (!done) return;
  if (e.state == Residency::kSpilling) {
    e.state = Residency::kSpilled;
    return;
  }
  e.state = Residency::kResident;
  if (e.stall_since_us != 0) {
    stats_.stall_us += NowMicros() - e.stall_since_us;
    e.stall_since_us = 0;
  }
  ReleaseHost(e, std::nullopt);  // the H2D copy has completed
}

bool OffloadEngine::Eligible(const Entry& e) const {
  return e.state == Residency::kResident && !e.acquiring && e.storage->data() != nullptr &&
         e.storage->external_holders() == 0;
}

bool OffloadEngine::Spill(Entry& e) {
  DeviceContext& dc = Device(e.device);
  absl::StatusOr<void*> host = absl::UnknownError("not tried");
  try {
    host = dc.pool.Allocate(e.nbytes);
  } catch (const BackendError& error) {
    // The pool polls events on the copy streams: an earlier copy's failure can surface here.
    FailInFlight(e.device, Residency::kSpilling, error.what());
    FailInFlight(e.device, Residency::kReloading, error.what());
    host = dc.pool.Allocate(e.nbytes);
  }
  if (!host.ok()) {
    CountSkip(absl::IsResourceExhausted(host.status()) ? kSkipHostLimit : kSkipNoPinned);
    return false;
  }
  void* device_ptr = e.storage->data();
  try {
    EventHandle produced = TakeEvent(dc);
    backend_.record_event(e.device, produced, e.producer.handle);
    backend_.stream_wait_event(e.device, dc.d2h.handle, produced);
    dc.spare.push_back(produced);  // the wait captured it; reusable at once
    backend_.memcpy_async(e.device, *host, device_ptr, e.nbytes, CopyKind::kDeviceToHost,
                          dc.d2h.handle);
    if (e.copy_done == nullptr) e.copy_done = TakeEvent(dc);
    backend_.record_event(e.device, e.copy_done, dc.d2h.handle);
  } catch (const BackendError& error) {
    // Nothing of this spill ran (a failing call has no effect); an earlier copy's failure may
    // have surfaced here.
    if (error.operation() == "memcpy_async") {
      FailInFlight(e.device, Residency::kSpilling, error.what());
    }
    FreeHostBuffer(e.device, *host, dc.d2h);
    CountSkip(kSkipCopyError);
    return false;
  }
  // In flight from here, accounting included: a failure that the free below happens to find
  // must be able to fail this entry too.
  e.host = *host;
  e.state = Residency::kSpilling;
  e.acquired = false;
  ++e.spill_count;
  e.last_spill_us = NowMicros();
  ++stats_.num_spills;
  stats_.bytes_to_host += static_cast<int64_t>(e.nbytes);
  stats_.spilled_bytes.Increase(static_cast<int64_t>(e.nbytes));
  stats_.host_bytes.Increase(static_cast<int64_t>(e.nbytes));
  Note(OffloadEvent::Kind::kSpill, e);
  // Reuse of the device block waits for the copy: one stream use, then the free.
  allocator_.RecordStream(device_ptr, dc.d2h);
  e.storage->drop_device_memory();
  return true;
}

void OffloadEngine::Reload(Entry& e, StreamRef consumer) {
  DeviceContext& dc = Device(e.device);
  void* ptr = nullptr;
  try {
    ptr = e.storage->allocate_device_memory(consumer);
  } catch (const OutOfMemoryError& oom) {
    throw OutOfMemoryError(absl::StrFormat("Spillway could not reload a saved storage of %s: %s",
                                           FormatBytes(e.nbytes), oom.what()),
                           oom.requested_bytes(), oom.device());
  }
  try {
    // The block may have been used by earlier work on the consumer stream: the H2D copy must
    // not write into it before that work is done (DeepSpeed #8186).
    EventHandle allocated = TakeEvent(dc);
    backend_.record_event(e.device, allocated, consumer.handle);
    backend_.stream_wait_event(e.device, dc.h2d.handle, allocated);
    dc.spare.push_back(allocated);
    // Reload requested while still spilling: read the host buffer only after the D2H filled it.
    if (e.state == Residency::kSpilling) {
      backend_.stream_wait_event(e.device, dc.h2d.handle, e.copy_done);
    }
    backend_.memcpy_async(e.device, ptr, e.host, e.nbytes, CopyKind::kHostToDevice, dc.h2d.handle);
    backend_.record_event(e.device, e.copy_done, dc.h2d.handle);
  } catch (const BackendError&) {
    // The copy may already be enqueued (only the copy-done record failed): the block goes back
    // with its reuse deferred until the copy stream has passed it.
    allocator_.RecordStream(ptr, dc.h2d);
    e.storage->drop_device_memory();
    throw;
  }
  if (e.state == Residency::kSpilling || e.state == Residency::kSpilled) {
    stats_.spilled_bytes.Decrease(static_cast<int64_t>(e.nbytes));
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
  EngineLock lock(mutex_);
  Entry& e = EntryOf(id);
  Refresh(e);
  switch (e.state) {
    case Residency::kFailed:
      throw Error(absl::StrFormat("the saved storage of %s could not be brought back: %s",
                                  FormatBytes(e.nbytes), e.failure));
    case Residency::kSpilling:
    case Residency::kSpilled:
      Reload(e, consumer);
      ++stats_.num_stalls;
      e.stall_since_us = NowMicros();
      break;
    case Residency::kReloading:
      ++stats_.num_stalls;  // prefetched, but not finished yet
      e.stall_since_us = NowMicros();
      break;
    case Residency::kResident:
      if (e.prefetched) ++stats_.num_prefetch_hits;
      break;
  }
  if (e.prefetched) {
    prefetched_bytes_ -= e.nbytes;
    e.prefetched = false;
  }
  if (e.state == Residency::kReloading && !skip_consumer_wait_) {
    backend_.stream_wait_event(e.device, consumer.handle, e.copy_done);
  }
  // A block allocated on another stream (a prefetch) is now used on `consumer` too.
  if (consumer.id != e.block_stream.id) {
    allocator_.RecordStream(e.storage->data(), consumer);
  }
  e.acquired = true;
  e.acquiring = true;
  try {
    Prefetch(e.seq, consumer);
  } catch (...) {
    e.acquiring = false;
    throw;
  }
  e.acquiring = false;
  return e.storage->data();
}

void OffloadEngine::Prefetch(uint64_t before_seq, StreamRef consumer) {
  if (config_.policy == OffloadPolicy::kOff || config_.prefetch_bytes == 0) return;
  auto it = by_seq_.lower_bound(before_seq);
  while (it != by_seq_.begin() && prefetched_bytes_ < config_.prefetch_bytes) {
    --it;
    Entry& e = *it->second;
    Refresh(e);
    if (e.state != Residency::kSpilled && e.state != Residency::kSpilling) continue;
    if (config_.policy == OffloadPolicy::kAuto &&
        AllocatedBytes(e.device) + e.nbytes > budget_bytes(e.device)) {
      break;  // never prefetch past the budget
    }
    in_policy_ = true;
    try {
      Reload(e, consumer);
    } catch (const std::exception&) {
      in_policy_ = false;
      break;  // prefetch is best effort; Acquire will retry and report
    }
    in_policy_ = false;
    e.prefetched = true;
    prefetched_bytes_ += e.nbytes;
  }
}

void OffloadEngine::ForwardEnd() {
  EngineLock lock(mutex_);
  RunPolicy();
}

void OffloadEngine::BackwardStart(StreamRef consumer) {
  EngineLock lock(mutex_);
  Prefetch(next_seq_, consumer);
}

void OffloadEngine::RunPolicy() {
  EngineLock lock(mutex_);
  if (in_policy_) return;
  in_policy_ = true;
  try {
    if (config_.policy == OffloadPolicy::kEager) {
      for (auto& [seq, entry] : by_seq_) {
        Entry& e = *entry;
        if (!e.policy_refused && !e.acquired && !e.prefetched && Eligible(e)) {
          if (!Spill(e)) e.policy_refused = true;
        }
      }
    } else if (config_.policy == OffloadPolicy::kAuto) {
      for (int d = 0; d < static_cast<int>(devices_.size()); ++d) {
        const size_t budget = budget_bytes(d);
        if (AllocatedBytes(d) > budget) SpillOldest(d, budget - budget / 16, false);
      }
    }
  } catch (...) {
    in_policy_ = false;
    throw;
  }
  in_policy_ = false;
}

size_t OffloadEngine::SpillOldest(int device, size_t target_allocated, bool include_window) {
  // The newest entries (up to the prefetch window) are needed first in backward: keep them.
  uint64_t window_start = next_seq_;
  if (!include_window) {
    size_t window = 0;
    for (auto it = by_seq_.rbegin(); it != by_seq_.rend(); ++it) {
      if (it->second->device != device) continue;
      window += it->second->nbytes;
      if (window > config_.prefetch_bytes) break;
      window_start = it->first;
    }
  }
  size_t released = 0;
  for (auto& [seq, entry] : by_seq_) {
    if (seq >= window_start) break;
    if (AllocatedBytes(device) <= target_allocated) break;
    Entry& e = *entry;
    if (e.device != device || !Eligible(e)) continue;
    if (!include_window && (e.policy_refused || e.acquired || e.prefetched)) continue;
    if (e.prefetched) {
      prefetched_bytes_ -= e.nbytes;
      e.prefetched = false;
    }
    const auto info = allocator_.Lookup(e.storage->data());
    if (Spill(e)) released += info ? info->size : e.nbytes;
  }
  return released;
}

size_t OffloadEngine::ReleaseMemory(int device, size_t bytes) {
  EngineLock lock(mutex_);
  if (config_.policy == OffloadPolicy::kOff) return 0;
  if (device < 0 || device >= static_cast<int>(devices_.size())) return 0;
  const size_t allocated = AllocatedBytes(device);
  const size_t target = allocated > bytes ? allocated - bytes : 0;
  in_policy_ = true;
  size_t released = 0;
  try {
    released = SpillOldest(device, target, true);
  } catch (...) {
    in_policy_ = false;
    throw;
  }
  in_policy_ = false;
  if (released > 0) {
    // The allocator retries right after this returns: the freed blocks must be reusable. Each
    // spill's own event is waited on first: a failed copy is reported once, to the first wait
    // that finds it, and must mark its entry failed rather than escape from the stream-wide wait
    // (leaving the entry to pass for spilled with bytes that never arrived).
    for (auto& [seq, entry] : by_seq_) {
      if (entry->device == device && entry->state == Residency::kSpilling) Refresh(*entry, true);
    }
    try {
      backend_.synchronize_stream(device, Device(device).d2h.handle);
    } catch (const BackendError& error) {
      FailInFlight(device, Residency::kSpilling, error.what());
    }
    for (auto& [seq, entry] : by_seq_) Refresh(*entry);
  }
  return released;
}

void OffloadEngine::OnPressure(int device) {
  EngineLock lock(mutex_);
  if (in_policy_ || config_.policy != OffloadPolicy::kAuto) return;
  const size_t budget = budget_bytes(device);
  in_policy_ = true;
  try {
    SpillOldest(device, budget - budget / 16, false);
  } catch (...) {
    in_policy_ = false;
    throw;
  }
  in_policy_ = false;
}

void OffloadEngine::Synchronize() {
  EngineLock lock(mutex_);
  // Entry by entry first, so that a failed copy marks its own entry failed (see ReleaseMemory);
  // the stream-wide waits then cover the copies of entries dropped meanwhile.
  for (auto& [seq, entry] : by_seq_) Refresh(*entry, /*wait=*/true);
  for (const auto& dc : devices_) {
    if (dc == nullptr) continue;
    try {
      backend_.synchronize_stream(dc->device, dc->d2h.handle);
    } catch (const BackendError& error) {
      FailInFlight(dc->device, Residency::kSpilling, error.what());
    }
    try {
      backend_.synchronize_stream(dc->device, dc->h2d.handle);
    } catch (const BackendError& error) {
      FailInFlight(dc->device, Residency::kReloading, error.what());
    }
  }
  for (auto& [seq, entry] : by_seq_) Refresh(*entry);
}

StreamRef OffloadEngine::h2d_stream_for_testing(int device) {
  EngineLock lock(mutex_);
  return Device(device).h2d;
}

size_t OffloadEngine::AllocatedBytes(int device) const {
  return static_cast<size_t>(allocator_.stats(device).allocated_bytes.all().current);
}

size_t OffloadEngine::budget_bytes(int device) const {
  EngineLock lock(mutex_);
  if (config_.budget_bytes != 0) return config_.budget_bytes;
  size_t limit = allocator_.memory_limit(device);
  if (limit == 0) limit = backend_.mem_info(device).total_bytes;
  return static_cast<size_t>(config_.budget_fraction * static_cast<double>(limit));
}

void OffloadEngine::UpdateWatermarks() {
  for (int d = 0; d < allocator_.device_count(); ++d) {
    allocator_.SetWatermark(d, config_.policy == OffloadPolicy::kAuto
                                   ? budget_bytes(d)
                                   : std::numeric_limits<size_t>::max());
  }
}

void OffloadEngine::SetConfig(const OffloadConfig& config) {
  EngineLock lock(mutex_);
  config_ = config;
  for (auto& [seq, entry] : by_seq_) {
    entry->policy_refused = entry->nbytes < config_.min_bytes;
  }
  UpdateWatermarks();
}

OffloadConfig OffloadEngine::config() const {
  EngineLock lock(mutex_);
  return config_;
}

std::optional<EntryInfo> OffloadEngine::Describe(const void* key) const {
  EngineLock lock(mutex_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  const Entry& e = *it->second;
  EntryInfo info;
  info.key = e.key;
  info.data = e.storage->data();
  info.nbytes = e.nbytes;
  info.device = e.device;
  info.residency = e.state;
  info.external_holders = e.storage->external_holders();
  for (const auto& [id, view] : e.keepers) info.keepers.push_back(KeeperInfo{id, view});
  std::sort(info.keepers.begin(), info.keepers.end(),
            [](const KeeperInfo& a, const KeeperInfo& b) { return a.id < b.id; });
  info.spill_count = e.spill_count;
  info.reload_count = e.reload_count;
  info.last_spill_us = e.last_spill_us;
  info.last_reload_us = e.last_reload_us;
  return info;
}

std::optional<EntryInfo> OffloadEngine::DescribeKeeper(KeeperId id) const {
  EngineLock lock(mutex_);
  auto it = keepers_.find(id);
  if (it == keepers_.end()) return std::nullopt;
  return Describe(it->second->key);
}

std::vector<const void*> OffloadEngine::EntryKeys() const {
  EngineLock lock(mutex_);
  std::vector<const void*> keys;
  keys.reserve(by_seq_.size());
  for (const auto& [seq, entry] : by_seq_) keys.push_back(entry->key);
  return keys;
}

void OffloadEngine::CountSkip(std::string_view reason) {
  EngineLock lock(mutex_);
  ++stats_.skipped[std::string(reason)];
}

void OffloadEngine::DeclareSkipReason(std::string_view reason) {
  EngineLock lock(mutex_);
  stats_.skipped.try_emplace(std::string(reason), 0);
}

OffloadStats OffloadEngine::stats() const {
  EngineLock lock(mutex_);
  OffloadStats out = stats_;
  out.host_reserved_bytes = 0;
  for (const auto& dc : devices_) {
    if (dc != nullptr) out.host_reserved_bytes += static_cast<int64_t>(dc->pool.reserved_bytes());
  }
  return out;
}

void OffloadEngine::ResetPeakStats() {
  EngineLock lock(mutex_);
  stats_.spilled_bytes.ResetPeak();
  stats_.host_bytes.ResetPeak();
}

}  // namespace spillway
