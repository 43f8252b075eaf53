#include "offload/copy_engine.h"

#include <algorithm>
#include <iterator>
#include <utility>

namespace spillway {

CopyEngine::Device::Device(Backend& backend, int device, size_t host_limit_bytes)
    : backend(backend),
      device(device),
      d2h(backend.create_stream(device)),
      h2d(backend.create_stream(device)),
      pool(backend, device, PinnedPool::Options{size_t{64} << 20, host_limit_bytes}) {}

CopyEngine::Device::~Device() {
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

CopyEngine::CopyEngine(CachingAllocator& allocator, size_t host_limit_bytes,
                       FailureHandler on_failure)
    : allocator_(allocator),
      backend_(allocator.backend()),
      host_limit_bytes_(host_limit_bytes),
      on_failure_(std::move(on_failure)),
      devices_(static_cast<size_t>(allocator.device_count())) {}

CopyEngine::~CopyEngine() = default;

CopyEngine::Device& CopyEngine::Of(int device) {
  auto& slot = devices_.at(static_cast<size_t>(device));
  if (slot == nullptr) {
    slot = std::make_unique<Device>(backend_, device, host_limit_bytes_);
    if (host_history_entries_) slot->pool.RecordHistory(true, *host_history_entries_);
  }
  return *slot;
}

const CopyEngine::Device* CopyEngine::Find(int device) const {
  if (device < 0 || static_cast<size_t>(device) >= devices_.size()) return nullptr;
  return devices_[static_cast<size_t>(device)].get();
}

StreamRef CopyEngine::stream(int device, Residency direction) {
  const Device& d = Of(device);
  return direction == Residency::kSpilling ? d.d2h : d.h2d;
}

bool CopyEngine::started(int device) const { return Find(device) != nullptr; }

std::optional<Residency> CopyEngine::DirectionOf(int device, uint64_t stream_id) const {
  const Device* d = Find(device);
  if (d == nullptr) return std::nullopt;
  if (stream_id == d->d2h.id) return Residency::kSpilling;
  if (stream_id == d->h2d.id) return Residency::kReloading;
  return std::nullopt;
}

EventHandle CopyEngine::TakeEvent(int device) {
  Device& d = Of(device);
  if (!d.spare.empty()) {
    EventHandle e = d.spare.back();
    d.spare.pop_back();
    return e;
  }
  EventHandle e = backend_.create_event(device);
  d.events.push_back(e);
  return e;
}

void CopyEngine::Spare(int device, EventHandle event) { Of(device).spare.push_back(event); }

uint64_t CopyEngine::IssueCopy(int device, Residency direction, absl::FunctionRef<void()> copy,
                               absl::FunctionRef<void()> record) {
  // A copy that failed earlier on the stream is reported (once) to whichever call comes next,
  // and that call has no effect. The failure belongs to the copies in flight there (which one is
  // not known): they fail, every time one is heard of, and what did not take effect is issued
  // again. Heard of at the record, it may be this very copy's: the copy is made again too (its
  // source is still intact). A few rounds at most: each one settles a failure of its own.
  constexpr int kMaxRounds = 4;
  bool copied = false;
  uint64_t errors_found_before = 0;
  for (int round = 1;; ++round) {
    try {
      if (!copied) {
        // Read first: a failure found between this read and the copy is blamed on it too
        // (wrongly, but safely); read after, one of the copy's own could pass unblamed.
        errors_found_before = allocator_.StreamErrorsFound(device);
        copy();
      }
      copied = true;
      record();
      return errors_found_before;
    } catch (const BackendError& error) {
      if (!error.earlier_work()) throw;
      on_failure_(device, direction, error.what());
      if (round == kMaxRounds) throw;
      copied = false;
    }
  }
}

void CopyEngine::WaitStream(int device, Residency direction) {
  const StreamRef s = stream(device, direction);
  try {
    backend_.synchronize_stream(device, s.handle);
  } catch (const BackendError& error) {
    on_failure_(device, direction, error.what());
  }
}

void CopyEngine::RecordOnProgramStream(int device, EventHandle event, StreamRef stream) {
  try {
    backend_.record_event(device, event, stream.handle);
  } catch (const BackendError& error) {
    if (error.earlier_work()) throw ProgramStreamError(error);
    throw;
  }
}

bool CopyEngine::PoolCall(int device, absl::FunctionRef<void(PinnedPool&)> call) {
  try {
    call(Of(device).pool);
    return true;
  } catch (const BackendError& error) {
    // The pool polls and records events on both copy streams. A failure it heard on one of them
    // (StreamFailure) is that stream's copies'; any other may be either direction's.
    const auto* heard_on = dynamic_cast<const PinnedPool::StreamFailure*>(&error);
    bool to_host = true;
    bool to_device = true;
    if (heard_on != nullptr) {
      if (const Device* d = Find(device); d != nullptr && heard_on->stream_id() == d->d2h.id) {
        to_device = false;
      } else if (d != nullptr && heard_on->stream_id() == d->h2d.id) {
        to_host = false;
      }
    }
    if (to_host) on_failure_(device, Residency::kSpilling, error.what());
    if (to_device) on_failure_(device, Residency::kReloading, error.what());
    return false;
  }
}

void CopyEngine::FreeHost(int device, void* host, std::optional<StreamRef> last_use) {
  // A failure heard here leaves the buffer itself safely back in the pool.
  PoolCall(device, [&](PinnedPool& pool) { pool.Free(host, last_use); });
}

void CopyEngine::SetHostLimit(size_t bytes) {
  host_limit_bytes_ = bytes;
  ForEachStarted([&](int d) { PoolCall(d, [&](PinnedPool& pool) { pool.SetLimit(bytes); }); });
}

void CopyEngine::TrimHost() {
  ForEachStarted([&](int d) { PoolCall(d, [](PinnedPool& pool) { pool.Trim(); }); });
}

void CopyEngine::RecordHostHistory(bool enabled, size_t max_entries) {
  host_history_entries_.reset();
  if (enabled) host_history_entries_ = max_entries;
  for (const auto& d : devices_) {
    if (d != nullptr) d->pool.RecordHistory(enabled, max_entries);
  }
}

std::vector<SegmentSnapshot> CopyEngine::HostSegments() const {
  std::vector<SegmentSnapshot> out;
  for (const auto& d : devices_) {
    if (d == nullptr) continue;
    std::vector<SegmentSnapshot> chunks = d->pool.Chunks();
    std::move(chunks.begin(), chunks.end(), std::back_inserter(out));
  }
  return out;
}

std::vector<TraceEntry> CopyEngine::HostHistory() const {
  std::vector<TraceEntry> out;
  for (const auto& d : devices_) {
    if (d == nullptr) continue;
    std::vector<TraceEntry> entries = d->pool.history();
    std::move(entries.begin(), entries.end(), std::back_inserter(out));
  }
  // Each pool's entries are in time order already; stable, so equal times keep it.
  std::stable_sort(out.begin(), out.end(),
                   [](const TraceEntry& a, const TraceEntry& b) { return a.time_us < b.time_us; });
  return out;
}

size_t CopyEngine::host_reserved_bytes() const {
  size_t reserved = 0;
  for (const auto& d : devices_) {
    if (d != nullptr) reserved += d->pool.reserved_bytes();
  }
  return reserved;
}

}  // namespace spillway
