#include "allocator/caching_allocator.h"

#include <algorithm>
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"
#include "allocator/format.h"
#include "allocator/speculative.h"

namespace spillway {

std::string_view BlockStateName(BlockState state) {
  switch (state) {
    case BlockState::kActiveAllocated:
      return "active_allocated";
    case BlockState::kActivePendingFree:
      return "active_pending_free";
    case BlockState::kInactive:
      return "inactive";
  }
  return "inactive";
}

CachingAllocator::CachingAllocator(std::shared_ptr<Backend> backend, const AllocatorConfig& config)
    : backend_(std::move(backend)), config_(config) {
  if (backend_ == nullptr) throw InvalidArgumentError("CachingAllocator needs a backend, got null");
  if (const absl::Status status = ValidateAllocatorConfig(config_); !status.ok()) {
    throw InvalidArgumentError(std::string(status.message()));
  }
  const int count = backend_->device_count();
  ledgers_.reserve(static_cast<size_t>(count));
  devices_.reserve(static_cast<size_t>(count));
  budgets_.reserve(static_cast<size_t>(count));
  for (int d = 0; d < count; ++d) {
    ledgers_.push_back(std::make_unique<StreamErrorLedger>(d));
    devices_.push_back(std::make_unique<DeviceAllocator>(
        *backend_, d, config_, [this] { return Callbacks(); }, *ledgers_.back()));
    budgets_.push_back(
        std::make_unique<BudgetAdaptor>(*devices_.back(), callback_guard_, pressure_handler_));
  }
}

void CachingAllocator::ThrowBadDevice(int device) const {
  if (device_count() == 0) {
    throw InvalidArgumentError(absl::StrFormat(
        "device index %d is out of range: the %s backend has no device (is a GPU visible?)", device,
        backend_->name()));
  }
  throw InvalidArgumentError(absl::StrFormat(
      "device index %d is out of range: the %s backend has %d device(s), valid indices are "
      "0..%d",
      device, backend_->name(), device_count(), device_count() - 1));
}

TraceContext CachingAllocator::GatherContextSlow() const {
  ContextGatherer gatherer;
  {
    std::lock_guard lock(gatherer_mutex_);
    gatherer = gatherer_;
  }
  return gatherer ? gatherer() : nullptr;
}

void* CachingAllocator::Malloc(size_t size, int device, StreamRef stream) {
  DeviceAllocator& allocator = At(device);
  if (size == 0) return nullptr;
  if (size > kMaxRequest) {
    throw InvalidArgumentError(absl::StrFormat(
        "allocation of %d bytes (%s) on device %d is larger than any device: Spillway accepts "
        "sizes up to %d bytes (%s)",
        size, FormatBytes(size), device, kMaxRequest, FormatBytes(kMaxRequest)));
  }
  TraceContext context = GatherContext();
  // A guess (a prefetch) takes only what is there: its core runs no ladder for it. The budget
  // (the offload engine's watermark) is the adaptor's: it may run the pressure handler between
  // a declined first call and the second.
  return BudgetOf(allocator).Malloc(
      size, stream, /*reclaim=*/!SpeculativeAllocations::Active(),
      [&](MallocOptions options) { return MallocOn(allocator, size, stream, context, options); });
}

void* CachingAllocator::MallocOn(DeviceAllocator& allocator, size_t size, StreamRef stream,
                                 TraceContext& context, MallocOptions options) {
  void* ptr = nullptr;
  try {
    ptr = allocator.Malloc(size, stream, context, options);
  } catch (...) {
    if (HasStreamErrors(allocator)) DispatchStreamErrors(allocator);
    throw;
  }
  if (HasStreamErrors(allocator)) DispatchStreamErrors(allocator);
  return ptr;
}

void CachingAllocator::SetPressureHandler(PressureHandler handler) {
  pressure_handler_.Set(callback_guard_, std::move(handler));
}

void CachingAllocator::SetWatermark(int device, size_t bytes) {
  BudgetOf(At(device)).SetWatermark(bytes);
}

void CachingAllocator::SetWatermarkFraction(int device, double fraction) {
  BudgetOf(At(device)).SetWatermarkFraction(fraction);
}

void* CachingAllocator::Malloc(size_t size, int device, StreamHandle stream) {
  At(device);  // validate before asking the backend about the stream
  return Malloc(size, device, backend_->resolve_stream(device, stream));
}

void CachingAllocator::Free(void* ptr, int device) {
  if (ptr == nullptr) return;
  DeviceAllocator& allocator = At(device);
  if (allocator.Free(ptr, GatherFreeContext())) {
    if (HasStreamErrors(allocator)) DispatchStreamErrors(allocator);
    return;
  }
  Free(ptr);  // not on that device: search the others, or explain what the pointer is
}

void CachingAllocator::Free(void* ptr) {
  if (ptr == nullptr) return;
  const TraceContext context = GatherFreeContext();
  if (DeviceAllocator* owner =
          FindOwner([&](DeviceAllocator& device) { return device.Free(ptr, context); })) {
    if (HasStreamErrors(*owner)) DispatchStreamErrors(*owner);
    return;
  }
  throw InvalidArgumentError("free: " + DescribeNotLive(ptr));
}

std::string CachingAllocator::DescribeNotLive(const void* ptr) const {
  for (const auto& device : devices_) {
    std::string what = device->DescribeForeign(ptr);
    if (!what.empty()) return what;
  }
  return absl::StrFormat("%p was not allocated by Spillway (no segment contains it)", ptr);
}

void CachingAllocator::AnnotateMemory(const void* ptr, std::string metadata) {
  // As PyTorch's: no effect while history is off, and nothing to key an annotation to for a null
  // pointer (an empty storage's, or a spilled one's: its bytes are on the host).
  if (!recording_.load(std::memory_order_relaxed) || ptr == nullptr) return;
  // The thread's compile context, with the annotation as the user metadata: the trace entry's
  // user_metadata is the annotation, not what the thread set for its allocations.
  const TraceLabelsRef& current = trace_labels::Current();
  auto labels = std::make_shared<const TraceLabels>(TraceLabels{
      current != nullptr ? current->compile_context : std::string(), std::move(metadata)});
  const TraceContext context = GatherContext();
  if (FindOwner([&](DeviceAllocator& device) { return device.Annotate(ptr, labels, context); })) {
    return;
  }
  throw InvalidArgumentError(
      "annotate: " + DescribeNotLive(ptr) +
      "; an annotation names a live allocation by the address it starts at (a tensor's "
      "untyped_storage().data_ptr())");
}

void CachingAllocator::RecordStream(void* ptr, StreamRef stream) {
  RecordStreamOf(ptr, stream, std::nullopt);
}

void CachingAllocator::RecordStream(void* ptr, StreamRef stream, int stream_device) {
  At(stream_device);  // a bad index is the caller's error, named as such
  RecordStreamOf(ptr, stream, stream_device);
}

void CachingAllocator::RecordStreamOf(void* ptr, StreamRef stream,
                                      std::optional<int> stream_device) {
  if (FindOwner([&](DeviceAllocator& device) {
        return device.RecordStream(ptr, stream, stream_device.value_or(device.device()));
      })) {
    return;
  }
  throw InvalidArgumentError(absl::StrFormat(
      "record_stream: %p is not a live allocation of Spillway (freed already, or foreign)", ptr));
}

uint64_t CachingAllocator::TagForRevival(const void* ptr, int device) {
  return At(device).TagForRevival(ptr);
}

bool CachingAllocator::Revive(void* ptr, int device, uint64_t tag) {
  return At(device).Revive(ptr, tag, GatherContext());
}

std::optional<AllocationInfo> CachingAllocator::Lookup(const void* ptr) const {
  std::optional<AllocationInfo> info;
  FindOwner([&](const DeviceAllocator& device) { return (info = device.Lookup(ptr)).has_value(); });
  return info;
}

void CachingAllocator::SetTraceCategory(const void* ptr, TraceCategory category) {
  if (!recording_.load(std::memory_order_relaxed)) return;
  FindOwner([&](DeviceAllocator& device) { return device.SetTraceCategory(ptr, category); });
}

std::optional<AllocationInfo> CachingAllocator::LookupContaining(const void* ptr) const {
  std::optional<AllocationInfo> info;
  FindOwner([&](const DeviceAllocator& device) {
    return (info = device.LookupContaining(ptr)).has_value();
  });
  return info;
}

void CachingAllocator::EmptyCache() {
  // Every device, even past one whose release failed (its segments stay cached, whole): the
  // others' cached memory still goes back. The first failure is reported.
  std::exception_ptr first_failure;
  for (const auto& device : devices_) {
    try {
      device->EmptyCache();
    } catch (...) {
      if (first_failure == nullptr) first_failure = std::current_exception();
    }
    if (HasStreamErrors(*device)) DispatchStreamErrors(*device);
  }
  if (first_failure != nullptr) std::rethrow_exception(first_failure);
}

void CachingAllocator::SetStreamErrorObserver(StreamErrorObserver observer) {
  stream_error_observer_.Set(callback_guard_, std::move(observer));
}

void CachingAllocator::DeliverStreamErrors(int device) {
  // Not from the flag: see DispatchStreamErrors.
  DispatchStreamErrors(At(device), /*rethrow=*/true);
}

uint64_t CachingAllocator::StreamErrorsFound(int device) {
  DeviceAllocator& allocator = At(device);
  // A failure another thread took from the backend is reported under the core's lock: wait for
  // it, so that an error found before the caller's next work is not numbered as if after it.
  allocator.AwaitReports();
  return LedgerOf(allocator).found();
}

void CachingAllocator::DispatchStreamErrors(DeviceAllocator& device, bool rethrow) {
  // Pending until this delivery is over: the observer may wait here for a lock held by a thread
  // that asks for the device's errors meanwhile (DeliverStreamErrors), and that thread must not
  // find them gone. It gets them too; the observer acts on each once (StreamError::seq).
  // Read once the core's calls under way are over, not on the flag alone: a thread that took a
  // failure from the backend reports it under the core's lock, and a caller whose own look at the
  // stream found nothing since must not trust a copy of the ledger before the failure is in it.
  device.AwaitReports();
  StreamErrorLedger& ledger = LedgerOf(device);
  const std::vector<StreamError> errors = ledger.Pending();
  if (errors.empty()) return;
  {
    const auto observer = stream_error_observer_.Get();
    const CallbackGuard::Call call(callback_guard_, observer.get());
    if (call) {
      try {
        for (const StreamError& error : errors) observer->fn(error);
      } catch (...) {
        // Still pending: the observer is told again at the next look. Thrown from an allocation
        // or a free, the error would take the place of a block allocated already (lost), or
        // escape a free; the one who asked for the errors (DeliverStreamErrors) hears it.
        if (rethrow) throw;
        return;
      }
    }
  }
  ledger.Retire(errors.back().seq);
}

void CachingAllocator::SetMemoryFraction(double fraction, int device) {
  At(device).SetMemoryFraction(fraction);
}

void CachingAllocator::SetMemoryLimit(size_t bytes, int device) {
  At(device).SetMemoryLimit(bytes);
}

size_t CachingAllocator::memory_limit(int device) const { return At(device).memory_limit(); }

size_t CachingAllocator::total_memory(int device) const { return At(device).total_memory(); }

std::optional<double> CachingAllocator::memory_fraction(int device) const {
  return At(device).memory_fraction();
}

DeviceStats CachingAllocator::stats(int device) const { return At(device).stats(); }

void CachingAllocator::ResetPeakStats(int device) { At(device).ResetPeakStats(); }

void CachingAllocator::ResetAccumulatedStats(int device) { At(device).ResetAccumulatedStats(); }

size_t CachingAllocator::LargestFreeBlock(int device) const {
  return At(device).LargestFreeBlock();
}

size_t CachingAllocator::MetadataBytes(int device) const { return At(device).MetadataBytes(); }

void CachingAllocator::ProcessEvents(int device) {
  DeviceAllocator& allocator = At(device);
  allocator.ProcessEvents();
  if (HasStreamErrors(allocator)) DispatchStreamErrors(allocator);
}

void CachingAllocator::RecordHistory(bool enabled, size_t max_entries, ContextGatherer gatherer,
                                     bool free_context) {
  free_context_.store(free_context, std::memory_order_relaxed);
  {
    std::lock_guard lock(gatherer_mutex_);
    gatherer_ = enabled ? std::move(gatherer) : ContextGatherer{};
  }
  const size_t entries = max_entries == 0 ? config_.history_entries : max_entries;
  for (const auto& device : devices_) device->RecordHistory(enabled, entries);
  {
    std::lock_guard lock(annotations_mutex_);
    annotation_capacity_ = std::max<size_t>(entries, 1);
    while (annotations_.size() > annotation_capacity_) annotations_.pop_front();
  }
  recording_.store(enabled, std::memory_order_relaxed);
  // Stopping also forgets what was recorded, as PyTorch's allocator does: a snapshot after the
  // stop shows no history, and the next recording starts from nothing.
  if (!enabled) ClearHistory();
}

void CachingAllocator::ClearHistory() {
  for (const auto& device : devices_) device->ClearHistory();
  std::lock_guard lock(annotations_mutex_);
  annotations_.clear();
}

void CachingAllocator::RecordAnnotation(int device,
                                        std::vector<std::pair<std::string, std::string>> metadata) {
  if (!recording_.load(std::memory_order_relaxed)) return;
  AnnotationEntry entry{device, NowMicros(), std::move(metadata)};
  std::lock_guard lock(annotations_mutex_);
  if (annotations_.size() >= annotation_capacity_ && !annotations_.empty()) {
    annotations_.pop_front();
  }
  annotations_.push_back(std::move(entry));
}

void CachingAllocator::PushCompileContext(std::string context) {
  if (!recording_.load(std::memory_order_relaxed)) return;
  trace_labels::PushCompileContext(std::move(context));
}

void CachingAllocator::PopCompileContext() {
  if (!recording_.load(std::memory_order_relaxed)) return;
  trace_labels::PopCompileContext();
}

void CachingAllocator::SetUserMetadata(std::string metadata) {
  trace_labels::SetUserMetadata(std::move(metadata));
}

std::string CachingAllocator::user_metadata() const { return trace_labels::UserMetadata(); }

std::optional<SegmentRange> CachingAllocator::SegmentOf(const void* ptr) const {
  std::optional<SegmentRange> range;
  FindOwner(
      [&](const DeviceAllocator& device) { return (range = device.SegmentOf(ptr)).has_value(); });
  return range;
}

Snapshot CachingAllocator::TakeSnapshot() const {
  Snapshot snapshot;
  for (const auto& device : devices_) {
    std::vector<SegmentSnapshot> segments = device->SnapshotSegments();
    for (SegmentSnapshot& s : segments) snapshot.segments.push_back(std::move(s));
    snapshot.device_traces.push_back(device->history());
    device->CollectStreamHandles(snapshot.stream_handles);
  }
  std::lock_guard lock(annotations_mutex_);
  snapshot.external_annotations.assign(annotations_.begin(), annotations_.end());
  return snapshot;
}

uint64_t CachingAllocator::AddFreeMemoryCallback(FreeMemoryCallback callback) {
  if (!callback) throw InvalidArgumentError("AddFreeMemoryCallback: the callback is empty");
  auto registered = Register(std::move(callback));
  std::lock_guard lock(callbacks_mutex_);
  const uint64_t id = next_callback_id_++;
  callbacks_.emplace(id, std::move(registered));
  return id;
}

void CachingAllocator::RemoveFreeMemoryCallback(uint64_t id) {
  std::shared_ptr<RegisteredCallback<FreeMemoryCallback>> removed;
  {
    std::lock_guard lock(callbacks_mutex_);
    const auto it = callbacks_.find(id);
    if (it == callbacks_.end()) return;
    removed = std::move(it->second);
    callbacks_.erase(it);
  }
  callback_guard_.Remove(removed.get());
}

std::vector<FreeMemoryCallback> CachingAllocator::Callbacks() const {
  std::lock_guard lock(callbacks_mutex_);
  std::vector<FreeMemoryCallback> out;
  out.reserve(callbacks_.size());
  for (const auto& entry : callbacks_) {
    // Checked when called, not now: the caller calls them later, outside every lock.
    out.emplace_back([this, registered = entry.second](int device, size_t bytes) -> size_t {
      const CallbackGuard::Call call(callback_guard_, registered.get());
      return call ? registered->fn(device, bytes) : 0;
    });
  }
  return out;
}

}  // namespace spillway
