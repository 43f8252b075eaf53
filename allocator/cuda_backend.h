// `Backend` on the CUDA runtime API. Compiled only when CMake defines SPILLWAY_HAVE_CUDA.
//
// Every runtime call is checked. Out of memory in `device_malloc` / `host_malloc` is an
// `absl::ResourceExhaustedError` status (the runtime's error state is cleared); any other failure
// throws `BackendError(operation, detail)` where `operation` is the Backend method
// ("memcpy_async") and `detail` names the runtime function and its error. Per-device calls make
// `device` current for their duration and restore the caller's device afterwards.
//
// Streams are created non-blocking, so they never synchronize with the legacy default stream;
// `StreamRef::id` is `cudaStreamGetId`, which the runtime never reuses, while stream handles are
// recycled. Events are created with timing disabled. Pinned host memory is portable (usable from
// every device's context).
//
// This header deliberately does not include the CUDA headers: handles are `void*` (backend.h).
#pragma once

#include <cstddef>
#include <string_view>

#include "absl/status/statusor.h"
#include "allocator/backend.h"

namespace spillway {

// True when the CUDA runtime finds a driver and at least one device. Tests skip CUDA cases
// otherwise.
bool CudaDeviceAvailable();

class CudaBackend : public Backend {
 public:
  // Counts devices once; a machine without a driver or device yields a backend with 0 devices
  // (every per-device call then throws `InvalidArgumentError`), not an exception.
  CudaBackend();

  std::string_view name() const override { return "cuda"; }
  bool accesses_follow_streams() const override { return true; }
  int device_count() const override { return device_count_; }
  MemInfo mem_info(int device) override;

  absl::StatusOr<void*> device_malloc(int device, size_t bytes) override;
  void device_free(int device, void* ptr) override;

  absl::StatusOr<void*> host_malloc(size_t bytes) override;
  void host_free(void* ptr) override;

  StreamRef create_stream(int device) override;
  void destroy_stream(int device, StreamHandle stream) override;
  StreamRef default_stream(int device) override;
  StreamRef resolve_stream(int device, StreamHandle stream) override;
  void synchronize_stream(int device, StreamHandle stream) override;

  EventHandle create_event(int device) override;
  void destroy_event(int device, EventHandle event) override;
  void record_event(int device, EventHandle event, StreamHandle stream) override;
  bool query_event(int device, EventHandle event) override;
  void synchronize_event(int device, EventHandle event) override;
  void stream_wait_event(int device, StreamHandle stream, EventHandle event) override;

  void memcpy_async(int device, void* dst, const void* src, size_t bytes, CopyKind kind,
                    StreamHandle stream) override;

 private:
  void CheckDevice(int device) const;

  const int device_count_;
};

}  // namespace spillway
