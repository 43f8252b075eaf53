#include "allocator/sim_backend.h"

#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "allocator/errors.h"
#include "allocator/sim_stream.h"

namespace spillway {
namespace {

// CUDA allocations are at least 256-byte aligned; 512 also matches the allocator's size rounding.
constexpr size_t kAlignment = 512;

size_t RoundUpToAlignment(size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

size_t CopyKindIndex(CopyKind kind) { return static_cast<size_t>(kind); }

}  // namespace

// Guarded by the backend's `mu_`. A never-recorded event has no stream and is complete.
struct SimBackend::Event {
  int device;
  std::shared_ptr<Stream> stream;
  uint64_t target = 0;
};

SimBackend::SimBackend() : SimBackend(Options{}) {}

SimBackend::SimBackend(Options options)
    : options_(options), link_(options.devices, options.link_bytes_per_second) {
  if (options_.devices < 0) {
    throw InvalidArgumentError(
        absl::StrFormat("SimBackend: devices must be >= 0, got %d", options_.devices));
  }
  if (options_.max_jitter.count() < 0) {
    throw InvalidArgumentError("SimBackend: max_jitter must be >= 0");
  }
  device_used_.assign(options_.devices, 0);
  for (int device = 0; device < options_.devices; ++device) {
    const uint64_t id = next_stream_id_++;
    // Distinct, reproducible jitter sequence per stream.
    default_streams_.push_back(std::make_shared<Stream>(
        device, id, options_.max_jitter, options_.seed ^ (id * 0x9E3779B97F4A7C15ULL)));
  }
}

SimBackend::~SimBackend() {
  // Join every worker before any memory goes away: queued copies may still target it.
  for (const std::shared_ptr<Stream>& stream : StreamsOf(-1)) stream->Shutdown();
}

void SimBackend::CheckDeviceLocked(int device) const {
  if (device < 0 || device >= options_.devices) {
    throw InvalidArgumentError(
        absl::StrFormat("sim backend: device %d out of range [0, %d)", device, options_.devices));
  }
}

std::shared_ptr<SimBackend::Stream> SimBackend::FindStreamLocked(std::string_view op, int device,
                                                                 StreamHandle handle) const {
  CheckDeviceLocked(device);
  if (handle == nullptr) return default_streams_[device];
  const auto it = streams_.find(handle);
  if (it == streams_.end()) {
    throw BackendError(op, absl::StrFormat("unknown stream handle %p", handle));
  }
  if (it->second->device() != device) {
    throw BackendError(op, absl::StrFormat("stream %d belongs to device %d, not device %d",
                                           it->second->id(), it->second->device(), device));
  }
  return it->second;
}

std::shared_ptr<SimBackend::Stream> SimBackend::FindStream(std::string_view op, int device,
                                                           StreamHandle handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  return FindStreamLocked(op, device, handle);
}

SimBackend::Event& SimBackend::FindEventLocked(std::string_view op, int device,
                                               EventHandle handle) const {
  CheckDeviceLocked(device);
  const auto it = events_.find(handle);
  if (it == events_.end()) {
    throw BackendError(op, absl::StrFormat("unknown event handle %p", handle));
  }
  return *it->second;
}

void SimBackend::CheckDeviceRangeLocked(const void* ptr, size_t bytes,
                                        std::string_view what) const {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  auto it = device_allocations_.upper_bound(address);
  if (it != device_allocations_.begin()) {
    --it;
    const uintptr_t begin = it->first;
    const size_t size = it->second.bytes;
    if (address >= begin && address - begin <= size && bytes <= size - (address - begin)) return;
  }
  throw BackendError("memcpy_async",
                     absl::StrFormat("%s range [%p, +%d) is not inside a live device allocation",
                                     what, ptr, bytes));
}

std::vector<std::shared_ptr<SimBackend::Stream>> SimBackend::StreamsOf(int device) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Stream>> result;
  for (const std::shared_ptr<Stream>& stream : default_streams_) {
    if (device < 0 || stream->device() == device) result.push_back(stream);
  }
  for (const auto& [handle, stream] : streams_) {
    if (device < 0 || stream->device() == device) result.push_back(stream);
  }
  return result;
}

void SimBackend::Drain(int device) const {
  for (const std::shared_ptr<Stream>& stream : StreamsOf(device)) stream->Drain();
}

bool SimBackend::CountdownFires(int64_t& countdown) {
  if (countdown <= 0) return false;
  if (--countdown > 0) return false;
  countdown = -1;
  return true;
}

MemInfo SimBackend::mem_info(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckDeviceLocked(device);
  return MemInfo{options_.capacity_bytes - device_used_[device], options_.capacity_bytes};
}

absl::StatusOr<void*> SimBackend::device_malloc(int device, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (device < 0 || device >= options_.devices) {
    return absl::InvalidArgumentError(
        absl::StrFormat("device_malloc: device %d out of range [0, %d)", device, options_.devices));
  }
  size_t& used = device_used_[device];
  if (CountdownFires(device_malloc_countdown_)) {
    ++num_failed_device_mallocs_;
    return absl::ResourceExhaustedError(absl::StrFormat(
        "device_malloc: injected failure: requested %d bytes on device %d (%d of %d bytes in use)",
        bytes, device, used, options_.capacity_bytes));
  }
  // As cudaMalloc: a zero-byte request succeeds with a null pointer.
  if (bytes == 0) return nullptr;
  if (bytes > options_.capacity_bytes - used || bytes > SIZE_MAX - kAlignment) {
    ++num_failed_device_mallocs_;
    return absl::ResourceExhaustedError(absl::StrFormat(
        "device_malloc: out of memory: requested %d bytes on device %d (%d of %d bytes in use)",
        bytes, device, used, options_.capacity_bytes));
  }
  AlignedMemory memory(std::aligned_alloc(kAlignment, RoundUpToAlignment(bytes)));
  if (memory == nullptr) {
    ++num_failed_device_mallocs_;
    return absl::ResourceExhaustedError(absl::StrFormat(
        "device_malloc: host could not back %d bytes for device %d", bytes, device));
  }
  void* const ptr = memory.get();
  device_allocations_.emplace(reinterpret_cast<uintptr_t>(ptr),
                              DeviceAllocation{device, bytes, std::move(memory)});
  used += bytes;
  ++num_device_mallocs_;
  return ptr;
}

void SimBackend::device_free(int device, void* ptr) {
  auto check = [&] {
    CheckDeviceLocked(device);
    const auto it = device_allocations_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == device_allocations_.end() || it->second.device != device) {
      throw BackendError("device_free",
                         absl::StrFormat("%p is not a live allocation on device %d", ptr, device));
    }
    return it;
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    CheckDeviceLocked(device);
    if (ptr == nullptr) return;  // As cudaFree(nullptr).
    check();
  }
  // cudaFree synchronizes the device; doing the same keeps queued copies off freed memory.
  Drain(device);
  decltype(device_allocations_)::node_type node;  // Freed after the lock is released.
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = check();  // Again: another thread may have freed it while we drained.
  device_used_[device] -= it->second.bytes;
  ++num_device_frees_;
  node = device_allocations_.extract(it);
}

absl::StatusOr<void*> SimBackend::host_malloc(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (host_malloc_failures_ > 0) {
    --host_malloc_failures_;
    return absl::ResourceExhaustedError(absl::StrFormat(
        "host_malloc: injected failure: requested %d bytes (%d bytes in use)", bytes, host_used_));
  }
  if (bytes == 0) return nullptr;
  const size_t capacity = options_.host_capacity_bytes;
  if (capacity != 0 && bytes > capacity - host_used_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "host_malloc: out of pinned memory: requested %d bytes (%d of %d bytes in use)", bytes,
        host_used_, capacity));
  }
  // Overflow-safe: rounding an absurd size up must not wrap to a small one.
  if (bytes > SIZE_MAX - kAlignment) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("host_malloc: cannot allocate %d bytes", bytes));
  }
  AlignedMemory memory(std::aligned_alloc(kAlignment, RoundUpToAlignment(bytes)));
  if (memory == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("host_malloc: out of host memory: requested %d bytes", bytes));
  }
  void* const ptr = memory.get();
  host_allocations_.emplace(ptr, HostAllocation{bytes, std::move(memory)});
  host_used_ += bytes;
  return ptr;
}

void SimBackend::host_free(void* ptr) {
  if (ptr == nullptr) return;
  auto check = [&] {
    const auto it = host_allocations_.find(ptr);
    if (it == host_allocations_.end()) {
      throw BackendError("host_free", absl::StrFormat("%p is not a live host allocation", ptr));
    }
    return it;
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    check();
  }
  // cudaFreeHost synchronizes too; any device's stream may still be copying from or into `ptr`.
  Drain(-1);
  decltype(host_allocations_)::node_type node;  // Freed after the lock is released.
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = check();
  host_used_ -= it->second.bytes;
  node = host_allocations_.extract(it);
}

StreamRef SimBackend::create_stream(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckDeviceLocked(device);
  const uint64_t id = next_stream_id_++;
  auto stream = std::make_shared<Stream>(device, id, options_.max_jitter,
                                         options_.seed ^ (id * 0x9E3779B97F4A7C15ULL));
  const StreamHandle handle = stream->handle();
  streams_.emplace(handle, std::move(stream));
  return StreamRef{handle, id};
}

void SimBackend::destroy_stream(int device, StreamHandle handle) {
  std::shared_ptr<Stream> stream;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (handle == nullptr) {
      CheckDeviceLocked(device);
      throw BackendError("destroy_stream", "the default stream cannot be destroyed");
    }
    stream = FindStreamLocked("destroy_stream", device, handle);
    streams_.erase(handle);
  }
  // Outside the lock: draining may take a while and other streams must keep working meanwhile.
  // Events recorded on the stream keep it alive and stay queryable (they are complete now).
  stream->Shutdown();
}

StreamRef SimBackend::default_stream(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckDeviceLocked(device);
  // Null handle, as PyTorch's default stream is the CUDA null stream.
  return StreamRef{nullptr, default_streams_[device]->id()};
}

StreamRef SimBackend::resolve_stream(int device, StreamHandle handle) {
  std::lock_guard<std::mutex> lock(mu_);
  return StreamRef{handle, FindStreamLocked("resolve_stream", device, handle)->id()};
}

void SimBackend::synchronize_stream(int device, StreamHandle handle) {
  const std::shared_ptr<Stream> stream = FindStream("synchronize_stream", device, handle);
  stream->Drain();
  if (std::optional<std::string> error = stream->TakeError()) {
    throw BackendError("memcpy_async", *error, /*earlier_work=*/true);
  }
}

EventHandle SimBackend::create_event(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckDeviceLocked(device);
  if (CountdownFires(event_countdown_)) {
    throw BackendError("create_event", "injected event failure");
  }
  auto event = std::make_unique<Event>(Event{device, nullptr, 0});
  const EventHandle handle = event.get();
  events_.emplace(handle, std::move(event));
  return handle;
}

void SimBackend::destroy_event(int device, EventHandle handle) {
  std::unique_ptr<Event> event;  // Destroyed after the lock is released.
  std::lock_guard<std::mutex> lock(mu_);
  const Event& found = FindEventLocked("destroy_event", device, handle);
  if (found.device != device) {
    throw BackendError("destroy_event", absl::StrFormat("event %p belongs to device %d, not %d",
                                                        handle, found.device, device));
  }
  const auto it = events_.find(handle);
  event = std::move(it->second);
  events_.erase(it);
}

void SimBackend::record_event(int device, EventHandle handle, StreamHandle stream_handle) {
  std::lock_guard<std::mutex> lock(mu_);
  Event& event = FindEventLocked("record_event", device, handle);
  std::shared_ptr<Stream> stream = FindStreamLocked("record_event", device, stream_handle);
  if (event.device != device) {
    throw BackendError("record_event", absl::StrFormat("event %p belongs to device %d, not %d",
                                                       handle, event.device, device));
  }
  if (CountdownFires(event_countdown_)) {
    throw BackendError("record_event", "injected event failure");
  }
  if (std::optional<std::string> error = stream->TakeError()) {
    throw BackendError("memcpy_async", *error, /*earlier_work=*/true);
  }
  // The record is itself an op, so even on an idle stream completion is asynchronous (and
  // jittered), as it is on a GPU.
  event.target = stream->Enqueue([] { return std::optional<std::string>(); });
  event.stream = std::move(stream);
}

bool SimBackend::query_event(int device, EventHandle handle) {
  std::lock_guard<std::mutex> lock(mu_);
  const Event& event = FindEventLocked("query_event", device, handle);
  if (event.stream == nullptr) return true;
  // Reached first, then the error: an event found complete must have reported the failure of any
  // work before it. In the other order the worker could run a failing copy and the event's op
  // between the two looks, and the event would be complete with the failure left on the stream,
  // where a caller that saw the event complete never looks again.
  const bool reached = event.stream->Reached(event.target);
  if (std::optional<std::string> error = event.stream->TakeError()) {
    throw BackendError("memcpy_async", *error, /*earlier_work=*/true);
  }
  return reached;
}

void SimBackend::synchronize_event(int device, EventHandle handle) {
  std::shared_ptr<Stream> stream;
  uint64_t target = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Event& event = FindEventLocked("synchronize_event", device, handle);
    stream = event.stream;
    target = event.target;
  }
  if (stream == nullptr) return;
  stream->WaitFor(target);
  if (std::optional<std::string> error = stream->TakeError()) {
    throw BackendError("memcpy_async", *error, /*earlier_work=*/true);
  }
}

void SimBackend::stream_wait_event(int device, StreamHandle stream_handle, EventHandle handle) {
  std::lock_guard<std::mutex> lock(mu_);
  // As in CUDA, the event may belong to another device than the waiting stream.
  const Event& event = FindEventLocked("stream_wait_event", device, handle);
  std::shared_ptr<Stream> stream = FindStreamLocked("stream_wait_event", device, stream_handle);
  if (event.stream == nullptr) return;  // Never recorded: complete, nothing to wait for.
  // Captured now: a later re-record of the event must not affect this wait. Waits cannot form a
  // cycle because a record only captures work enqueued before it.
  stream->Enqueue([producer = event.stream, target = event.target] {
    producer->WaitFor(target);
    return std::optional<std::string>();
  });
}

void SimBackend::memcpy_async(int device, void* dst, const void* src, size_t bytes, CopyKind kind,
                              StreamHandle stream_handle) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Stream> stream = FindStreamLocked("memcpy_async", device, stream_handle);
  if (kind != CopyKind::kHostToDevice && kind != CopyKind::kDeviceToHost &&
      kind != CopyKind::kDeviceToDevice) {
    throw BackendError("memcpy_async", "invalid copy kind");
  }
  if (bytes > 0) {
    if (dst == nullptr || src == nullptr) {
      throw BackendError("memcpy_async", "null pointer");
    }
    if (kind != CopyKind::kHostToDevice) CheckDeviceRangeLocked(src, bytes, "source");
    if (kind != CopyKind::kDeviceToHost) CheckDeviceRangeLocked(dst, bytes, "destination");
    const auto d = reinterpret_cast<uintptr_t>(dst);
    const auto s = reinterpret_cast<uintptr_t>(src);
    if (d < s + bytes && s < d + bytes) {
      throw BackendError("memcpy_async", "source and destination overlap");
    }
  }
  if (std::optional<std::string> error = stream->TakeError()) {
    throw BackendError("memcpy_async", *error, /*earlier_work=*/true);
  }
  if (CountdownFires(copy_countdown_)) {
    stream->Enqueue(
        [detail = absl::StrFormat("injected copy failure: %s copy of %d bytes on stream %d",
                                  CopyKindName(kind), bytes, stream->id())] {
          return std::optional<std::string>(detail);
        });
    return;
  }
  stream->Enqueue([this, device, dst, src, bytes, kind] {
    // A copy between host and device holds its lane of the link from when it starts and is done
    // when its bytes have crossed. The bytes move at the end of that window, not its start: a
    // reader of the destination that did not wait for the copy sees the old bytes, and a writer
    // of the source that did not wait changes what lands, so the suites catch both missing waits.
    if (kind != CopyKind::kDeviceToDevice) {
      std::this_thread::sleep_until(link_.Reserve(device,
                                                  kind == CopyKind::kHostToDevice
                                                      ? SimLink::Lane::kHostToDevice
                                                      : SimLink::Lane::kDeviceToHost,
                                                  bytes, SimLink::Clock::now()));
    }
    if (bytes > 0) std::memcpy(dst, src, bytes);
    num_copies_.fetch_add(1, std::memory_order_relaxed);
    bytes_copied_[CopyKindIndex(kind)].fetch_add(bytes, std::memory_order_relaxed);
    return std::optional<std::string>();
  });
}

}  // namespace spillway
