#include "allocator/sim_backend.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "allocator/errors.h"

namespace spillway {
namespace {

// CUDA allocations are at least 256-byte aligned; 512 also matches the allocator's size rounding.
constexpr size_t kAlignment = 512;

size_t RoundUpToAlignment(size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

size_t CopyKindIndex(CopyKind kind) { return static_cast<size_t>(kind); }

// Set on streams' worker threads: a wait there is a stream's, not the host's.
thread_local bool on_stream_worker = false;

}  // namespace

// One simulated stream: a FIFO of ops run by a dedicated worker thread.
//
// Positions are 1-based: the op returned as position p has run once `completed >= p`. This is what
// makes events cheap: an event is just (stream, position).
//
// Lifetime: the backend holds every live stream and calls `Shutdown` (drain, then join) before it
// lets go, so a `Stream` is never destroyed with a running worker, and never on its own worker.
class SimBackend::Stream {
 public:
  // Returns an error message when the op failed (only injected copy failures do).
  using Op = std::function<std::optional<std::string>()>;

  Stream(int device, uint64_t id, std::chrono::microseconds max_jitter, uint64_t seed)
      : device_(device), id_(id), max_jitter_(max_jitter), rng_(seed), worker_([this] { Run(); }) {}

  ~Stream() { Shutdown(); }

  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  int device() const { return device_; }
  uint64_t id() const { return id_; }
  StreamHandle handle() { return this; }

  // Returns the op's position.
  uint64_t Enqueue(Op op) {
    uint64_t position;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) throw BackendError("enqueue", absl::StrFormat("stream %d is destroyed", id_));
      queue_.push_back(std::move(op));
      position = ++enqueued_;
    }
    work_cv_.notify_one();
    return position;
  }

  bool Reached(uint64_t position) {
    std::lock_guard<std::mutex> lock(mu_);
    return completed_ >= position;
  }

  void WaitFor(uint64_t position) {
    std::unique_lock<std::mutex> lock(mu_);
    BlockUntil(lock, position);
  }

  // Waits for everything enqueued before this call.
  void Drain() {
    std::unique_lock<std::mutex> lock(mu_);
    BlockUntil(lock, enqueued_);
  }

  // Threads blocked until this stream reaches `position` or later: the host's, and other
  // streams' workers running a wait on one of its events (`host_only`: not those). A thread
  // woken for an earlier position and not yet running again is not one.
  int Waiters(bool host_only, uint64_t position) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto from = [&](const std::multiset<uint64_t>& targets) {
      return static_cast<int>(std::distance(targets.lower_bound(position), targets.end()));
    };
    return host_only ? from(host_targets_) : from(host_targets_) + from(stream_targets_);
  }

  // Returns and clears the sticky error, if any.
  std::optional<std::string> TakeError() {
    std::lock_guard<std::mutex> lock(mu_);
    std::optional<std::string> error = std::move(sticky_error_);
    sticky_error_.reset();
    return error;
  }

  // Runs everything still queued, then joins the worker. Idempotent.
  void Shutdown() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    work_cv_.notify_one();
    if (worker_.joinable()) worker_.join();
  }

 private:
  void Run() {
    on_stream_worker = true;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // Stopping, and everything enqueued has run.
      Op op = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      SleepJitter();
      std::optional<std::string> error = op();
      // Drop what the op captured (buffers' owners, other streams) before reporting completion, so
      // a waiter that then tears things down never races with this thread.
      op = nullptr;
      lock.lock();
      if (error.has_value() && !sticky_error_.has_value()) sticky_error_ = std::move(error);
      ++completed_;
      done_cv_.notify_all();
    }
  }

  void BlockUntil(std::unique_lock<std::mutex>& lock, uint64_t position) {
    if (completed_ >= position) return;
    std::multiset<uint64_t>& targets = on_stream_worker ? stream_targets_ : host_targets_;
    const auto it = targets.insert(position);
    done_cv_.wait(lock, [&] { return completed_ >= position; });
    targets.erase(it);
  }

  // Only the worker touches `rng_`.
  void SleepJitter() {
    if (max_jitter_.count() <= 0) return;
    std::uniform_int_distribution<int64_t> dist(0, max_jitter_.count());
    std::this_thread::sleep_for(std::chrono::microseconds(dist(rng_)));
  }

  const int device_;
  const uint64_t id_;
  const std::chrono::microseconds max_jitter_;
  std::mt19937_64 rng_;

  std::mutex mu_;
  std::condition_variable work_cv_;  // Signalled when an op is queued or on shutdown.
  std::condition_variable done_cv_;  // Signalled when an op completes.
  std::deque<Op> queue_;
  uint64_t enqueued_ = 0;
  uint64_t completed_ = 0;
  // Positions blocked threads wait for (BlockUntil).
  std::multiset<uint64_t> host_targets_;
  std::multiset<uint64_t> stream_targets_;
  bool stopping_ = false;
  std::optional<std::string> sticky_error_;

  // Last: it starts running `Run` during construction, after everything above is initialized.
  std::thread worker_;
};

// Guarded by the backend's `mu_`. A never-recorded event has no stream and is complete.
struct SimBackend::Event {
  int device;
  std::shared_ptr<Stream> stream;
  uint64_t target = 0;
};

SimBackend::SimBackend() : SimBackend(Options{}) {}

SimBackend::SimBackend(Options options) : options_(options) {
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
  std::shared_ptr<Stream> stream;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stream = FindStreamLocked("synchronize_stream", device, handle);
  }
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
  if (std::optional<std::string> error = event.stream->TakeError()) {
    throw BackendError("memcpy_async", *error, /*earlier_work=*/true);
  }
  return event.stream->Reached(event.target);
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

void SimBackend::StreamGate::Open() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
  }
  cv_.notify_all();
}

void SimBackend::StreamGate::Wait(const std::function<bool()>& waited) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!waited) {
    cv_.wait(lock, [this] { return open_; });
    return;
  }
  while (!open_) {
    if (cv_.wait_for(lock, std::chrono::milliseconds(1), [this] { return open_; })) return;
    lock.unlock();
    const bool now = waited();  // without the gate's lock: it takes the stream's
    lock.lock();
    if (now && !open_) open_ = opened_by_wait_ = true;
  }
}

bool SimBackend::StreamGate::opened_by_wait() const {
  std::lock_guard<std::mutex> lock(mu_);
  return opened_by_wait_;
}

std::unique_ptr<SimBackend::StreamHold> SimBackend::hold_stream(int device,
                                                                StreamHandle stream_handle,
                                                                HoldRelease release) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Stream> stream = FindStreamLocked("hold_stream", device, stream_handle);
  auto gate = std::make_shared<StreamGate>();
  // Set before the gate's op can run: the op is its position (Enqueue's result).
  auto position = std::make_shared<std::atomic<uint64_t>>(0);
  std::function<bool()> waited;
  if (release != HoldRelease::kByOwner) {
    // Raw: the op runs on the stream's own worker, which the stream outlives.
    waited = [held = stream.get(), host_only = release == HoldRelease::kWhenHostWaits, position] {
      const uint64_t at = position->load();
      return at != 0 && held->Waiters(host_only, at) > 0;  // 0: not known yet
    };
  }
  // Under the backend's lock, as every enqueue: nothing lands between the gate and its position.
  position->store(stream->Enqueue([gate, waited = std::move(waited)] {
    gate->Wait(waited);
    return std::optional<std::string>();
  }));
  return std::make_unique<StreamHold>(gate);
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
  stream->Enqueue([this, dst, src, bytes, kind] {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    num_copies_.fetch_add(1, std::memory_order_relaxed);
    bytes_copied_[CopyKindIndex(kind)].fetch_add(bytes, std::memory_order_relaxed);
    return std::optional<std::string>();
  });
}

}  // namespace spillway
