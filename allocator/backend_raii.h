// Small owners of backend resources, so that no stream, event or buffer leaks when a test or an
// engine path exits early (an exception, a failed ASSERT).
//
// Each owner keeps a pointer to its `Backend`, which must outlive it. Owners are move-only; a
// moved-from owner owns nothing. Destructors cannot throw: a release that fails there is reported
// on stderr, because the backend is then broken and its next checked call will say so anyway.
#pragma once

#include <cstddef>
#include <cstdio>
#include <exception>
#include <utility>

#include "absl/status/statusor.h"
#include "allocator/backend.h"

namespace spillway {
namespace backend_raii_internal {

// Runs `release` in a destructor, reporting instead of propagating what it throws.
template <typename Release>
void ReleaseNoThrow(const char* what, Release&& release) noexcept {
  try {
    release();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spillway: releasing %s failed: %s\n", what, e.what());
  }
}

}  // namespace backend_raii_internal

class UniqueStream {
 public:
  UniqueStream(Backend& backend, int device)
      : backend_(&backend), device_(device), ref_(backend.create_stream(device)) {}
  ~UniqueStream() { Reset(); }

  UniqueStream(UniqueStream&& other) noexcept
      : backend_(std::exchange(other.backend_, nullptr)),
        device_(other.device_),
        ref_(std::exchange(other.ref_, StreamRef{})) {}
  UniqueStream& operator=(UniqueStream&& other) noexcept {
    if (this != &other) {
      Reset();
      backend_ = std::exchange(other.backend_, nullptr);
      device_ = other.device_;
      ref_ = std::exchange(other.ref_, StreamRef{});
    }
    return *this;
  }
  UniqueStream(const UniqueStream&) = delete;
  UniqueStream& operator=(const UniqueStream&) = delete;

  const StreamRef& ref() const { return ref_; }
  StreamHandle handle() const { return ref_.handle; }
  int device() const { return device_; }

 private:
  void Reset() noexcept {
    if (backend_ == nullptr) return;
    backend_raii_internal::ReleaseNoThrow("stream",
                                          [&] { backend_->destroy_stream(device_, ref_.handle); });
    backend_ = nullptr;
  }

  Backend* backend_;
  int device_;
  StreamRef ref_;
};

class UniqueEvent {
 public:
  UniqueEvent(Backend& backend, int device)
      : backend_(&backend), device_(device), event_(backend.create_event(device)) {}
  ~UniqueEvent() { Reset(); }

  UniqueEvent(UniqueEvent&& other) noexcept
      : backend_(std::exchange(other.backend_, nullptr)),
        device_(other.device_),
        event_(std::exchange(other.event_, nullptr)) {}
  UniqueEvent& operator=(UniqueEvent&& other) noexcept {
    if (this != &other) {
      Reset();
      backend_ = std::exchange(other.backend_, nullptr);
      device_ = other.device_;
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  UniqueEvent(const UniqueEvent&) = delete;
  UniqueEvent& operator=(const UniqueEvent&) = delete;

  EventHandle handle() const { return event_; }
  int device() const { return device_; }

  void record(StreamHandle stream) { backend_->record_event(device_, event_, stream); }
  bool query() { return backend_->query_event(device_, event_); }
  void synchronize() { backend_->synchronize_event(device_, event_); }

 private:
  void Reset() noexcept {
    if (backend_ == nullptr) return;
    backend_raii_internal::ReleaseNoThrow("event",
                                          [&] { backend_->destroy_event(device_, event_); });
    backend_ = nullptr;
  }

  Backend* backend_;
  int device_;
  EventHandle event_;
};

// Pinned host memory from `Backend::host_malloc`.
class UniqueHostBuffer {
 public:
  static absl::StatusOr<UniqueHostBuffer> Allocate(Backend& backend, size_t bytes) {
    absl::StatusOr<void*> ptr = backend.host_malloc(bytes);
    if (!ptr.ok()) return ptr.status();
    return UniqueHostBuffer(backend, *ptr, bytes);
  }
  ~UniqueHostBuffer() { Reset(); }

  UniqueHostBuffer(UniqueHostBuffer&& other) noexcept
      : backend_(std::exchange(other.backend_, nullptr)),
        data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)) {}
  UniqueHostBuffer& operator=(UniqueHostBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      backend_ = std::exchange(other.backend_, nullptr);
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  UniqueHostBuffer(const UniqueHostBuffer&) = delete;
  UniqueHostBuffer& operator=(const UniqueHostBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  UniqueHostBuffer(Backend& backend, void* data, size_t size)
      : backend_(&backend), data_(data), size_(size) {}

  void Reset() noexcept {
    if (backend_ == nullptr) return;
    backend_raii_internal::ReleaseNoThrow("host buffer", [&] { backend_->host_free(data_); });
    backend_ = nullptr;
  }

  Backend* backend_;
  void* data_;
  size_t size_;
};

// Device memory from `Backend::device_malloc`.
class UniqueDeviceBuffer {
 public:
  static absl::StatusOr<UniqueDeviceBuffer> Allocate(Backend& backend, int device, size_t bytes) {
    absl::StatusOr<void*> ptr = backend.device_malloc(device, bytes);
    if (!ptr.ok()) return ptr.status();
    return UniqueDeviceBuffer(backend, device, *ptr, bytes);
  }
  ~UniqueDeviceBuffer() { Reset(); }

  UniqueDeviceBuffer(UniqueDeviceBuffer&& other) noexcept
      : backend_(std::exchange(other.backend_, nullptr)),
        device_(other.device_),
        data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)) {}
  UniqueDeviceBuffer& operator=(UniqueDeviceBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      backend_ = std::exchange(other.backend_, nullptr);
      device_ = other.device_;
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  UniqueDeviceBuffer(const UniqueDeviceBuffer&) = delete;
  UniqueDeviceBuffer& operator=(const UniqueDeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  int device() const { return device_; }

 private:
  UniqueDeviceBuffer(Backend& backend, int device, void* data, size_t size)
      : backend_(&backend), device_(device), data_(data), size_(size) {}

  void Reset() noexcept {
    if (backend_ == nullptr) return;
    backend_raii_internal::ReleaseNoThrow("device buffer",
                                          [&] { backend_->device_free(device_, data_); });
    backend_ = nullptr;
  }

  Backend* backend_;
  int device_;
  void* data_;
  size_t size_;
};

}  // namespace spillway
