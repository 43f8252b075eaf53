// The simulated device's test controls: fault injection, held streams and the counters tests read.
// The device itself (memory, streams, events, copies) is in sim_backend.cc and sim_stream.cc.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"
#include "allocator/sim_stream.h"

namespace spillway {
namespace {

// The fail_*_after controls count down to the Nth call; -1 switches them off.
void CheckCountdown(const char* control, int64_t n) {
  if (n < 1 && n != -1) {
    throw InvalidArgumentError(absl::StrFormat("%s: n must be >= 1 or -1, got %d", control, n));
  }
}

}  // namespace

void SimBackend::fail_device_malloc_after(int64_t n) {
  CheckCountdown("fail_device_malloc_after", n);
  std::lock_guard<std::mutex> lock(mu_);
  device_malloc_countdown_ = n;
}

void SimBackend::fail_host_malloc(int64_t n) {
  if (n < 0) {
    throw InvalidArgumentError(absl::StrFormat("fail_host_malloc: n must be >= 0, got %d", n));
  }
  std::lock_guard<std::mutex> lock(mu_);
  host_malloc_failures_ = n;
}

void SimBackend::fail_copy_after(int64_t n) {
  CheckCountdown("fail_copy_after", n);
  std::lock_guard<std::mutex> lock(mu_);
  copy_countdown_ = n;
}

void SimBackend::fail_event_after(int64_t n) {
  CheckCountdown("fail_event_after", n);
  std::lock_guard<std::mutex> lock(mu_);
  event_countdown_ = n;
}

int64_t SimBackend::num_device_mallocs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_device_mallocs_;
}

int64_t SimBackend::num_device_frees() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_device_frees_;
}

int64_t SimBackend::num_failed_device_mallocs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_failed_device_mallocs_;
}

size_t SimBackend::bytes_in_use(int device) const {
  std::lock_guard<std::mutex> lock(mu_);
  CheckDeviceLocked(device);
  return device_used_[device];
}

size_t SimBackend::host_bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return host_used_;
}

int SimBackend::host_waiters(int device, StreamHandle stream) const {
  return FindStream("host_waiters", device, stream)->Waiters(Stream::Waiting::kHost, 0);
}

int SimBackend::stream_waiters(int device, StreamHandle stream) const {
  return FindStream("stream_waiters", device, stream)->Waiters(Stream::Waiting::kStreams, 0);
}

size_t SimBackend::num_live_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

int64_t SimBackend::num_copies() const { return num_copies_.load(std::memory_order_relaxed); }

size_t SimBackend::bytes_copied(CopyKind kind) const {
  return bytes_copied_.at(static_cast<size_t>(kind)).load(std::memory_order_relaxed);
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
      using Waiting = Stream::Waiting;
      // 0: not known yet
      return at != 0 && held->Waiters(host_only ? Waiting::kHost : Waiting::kAny, at) > 0;
    };
  }
  // Under the backend's lock, as every enqueue: nothing lands between the gate and its position.
  position->store(stream->Enqueue([gate, waited = std::move(waited)] {
    gate->Wait(waited);
    return std::optional<std::string>();
  }));
  return std::make_unique<StreamHold>(gate);
}

}  // namespace spillway
