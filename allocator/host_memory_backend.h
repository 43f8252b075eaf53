// A backend adaptor whose "device memory" is the pinned host memory of the backend it wraps.
//
// The stream-ordered caching core (DeviceAllocator) takes its segments with device_malloc and
// gives them back with device_free. Over this adaptor those calls become host_malloc and
// host_free of the wrapped backend, and everything else (streams, events, copies) passes
// through, so that the one core serves pinned host memory too: the offload engine's PinnedPool
// is that core over this adaptor (RMM's way: small pieces composed, rather than a second pool).
//
// Differences from a device, and why:
//  - Any host_malloc failure is reported as out of memory (ResourceExhausted): the core then
//    tries a smaller segment or gives up with a status, where it would throw for any other
//    status; what the backend said is kept (last_failure) for the caller's message.
//  - mem_info knows no capacity (pinnable memory is the host's, which the Backend interface does
//    not report): it says SIZE_MAX for both. The core's memory limit is the bound.
//  - accesses_follow_streams is false: the host may read pinned memory directly.
//
// Threads: every method may be called from any thread; the wrapped backend is thread-safe, and
// last_failure has a mutex of its own, taken by nothing else.
#pragma once

#include <cstddef>
#include <mutex>
#include <string>
#include <string_view>

#include "allocator/backend.h"

namespace spillway {

class HostMemoryBackend final : public Backend {
 public:
  // `backend` must outlive the adaptor.
  explicit HostMemoryBackend(Backend& backend) : backend_(backend) {}

  // What the wrapped backend said at the last host_malloc that failed; empty if none did.
  std::string last_failure() const;

  std::string_view name() const override { return backend_.name(); }
  bool accesses_follow_streams() const override { return false; }
  int device_count() const override { return backend_.device_count(); }
  MemInfo mem_info(int device) override;

  absl::StatusOr<void*> device_malloc(int device, size_t bytes) override;
  void device_free(int device, void* ptr) override;
  absl::StatusOr<void*> host_malloc(size_t bytes) override { return backend_.host_malloc(bytes); }
  void host_free(void* ptr) override { backend_.host_free(ptr); }

  StreamRef create_stream(int device) override { return backend_.create_stream(device); }
  void destroy_stream(int device, StreamHandle stream) override {
    backend_.destroy_stream(device, stream);
  }
  StreamRef default_stream(int device) override { return backend_.default_stream(device); }
  StreamRef resolve_stream(int device, StreamHandle stream) override {
    return backend_.resolve_stream(device, stream);
  }
  void synchronize_stream(int device, StreamHandle stream) override {
    backend_.synchronize_stream(device, stream);
  }
  EventHandle create_event(int device) override { return backend_.create_event(device); }
  void destroy_event(int device, EventHandle event) override {
    backend_.destroy_event(device, event);
  }
  void record_event(int device, EventHandle event, StreamHandle stream) override {
    backend_.record_event(device, event, stream);
  }
  bool query_event(int device, EventHandle event) override {
    return backend_.query_event(device, event);
  }
  void synchronize_event(int device, EventHandle event) override {
    backend_.synchronize_event(device, event);
  }
  void stream_wait_event(int device, StreamHandle stream, EventHandle event) override {
    backend_.stream_wait_event(device, stream, event);
  }
  void memcpy_async(int device, void* dst, const void* src, size_t bytes, CopyKind kind,
                    StreamHandle stream) override {
    backend_.memcpy_async(device, dst, src, bytes, kind, stream);
  }

 private:
  Backend& backend_;
  mutable std::mutex failure_mutex_;
  std::string last_failure_;
};

}  // namespace spillway
