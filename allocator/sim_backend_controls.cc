// The simulated device's test controls: fault injection and the counters tests read. The device
// itself (memory, streams, events, copies) is in sim_backend.cc.
#include <cstdint>
#include <mutex>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"

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

size_t SimBackend::num_live_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

int64_t SimBackend::num_copies() const { return num_copies_.load(std::memory_order_relaxed); }

size_t SimBackend::bytes_copied(CopyKind kind) const {
  return bytes_copied_.at(static_cast<size_t>(kind)).load(std::memory_order_relaxed);
}

}  // namespace spillway
