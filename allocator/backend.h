// The one interface through which Spillway touches a device.
//
// Everything the caching allocator and the offload engine need from hardware goes through
// `Backend`: device and pinned-host memory, streams, events and asynchronous copies. Two
// implementations exist: `CudaBackend` (CUDA runtime API) and `SimBackend` (host memory with a
// capacity and asynchronous streams run by worker threads), which is how the whole stack is
// tested on machines without a GPU.
//
// Error model:
//  - `device_malloc` and `host_malloc` return `absl::StatusOr`: running out of memory is an
//    expected outcome that callers handle (the allocator's out-of-memory ladder).
//  - Every other operation throws `BackendError` on failure, carrying the operation name and the
//    backend's error string. Such failures are not expected in a healthy process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "allocator/errors.h"

namespace spillway {

// Opaque handles. For CUDA they are `cudaStream_t` / `cudaEvent_t`; for the simulated device they
// point at the backend's own objects. A null stream handle means the device's default stream.
using StreamHandle = void*;
using EventHandle = void*;

// A stream as the allocator sees it: the handle used to enqueue work, plus an identity that is
// never reused within the process. State is keyed by `id`, never by `handle`: handles of
// destroyed streams are recycled by the runtime (rmm#2252).
struct StreamRef {
  StreamHandle handle = nullptr;
  uint64_t id = 0;

  friend bool operator==(const StreamRef& a, const StreamRef& b) { return a.id == b.id; }
};

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice };

std::string_view CopyKindName(CopyKind kind);

struct MemInfo {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cuda" or "sim".
  virtual std::string_view name() const = 0;
  // Whether all access to device memory is work enqueued on streams, as kernels and copies are on
  // CUDA. Only then may a block still in use on one stream be handed to another by making the new
  // owner's stream wait: host code that touches device memory directly would not wait.
  virtual bool accesses_follow_streams() const = 0;
  virtual int device_count() const = 0;
  virtual MemInfo mem_info(int device) = 0;

  // Device memory. Out of memory is `absl::ResourceExhaustedError`; a bad device index is
  // `absl::InvalidArgumentError`.
  virtual absl::StatusOr<void*> device_malloc(int device, size_t bytes) = 0;
  virtual void device_free(int device, void* ptr) = 0;

  // Page-locked host memory, usable as the host side of asynchronous copies.
  virtual absl::StatusOr<void*> host_malloc(size_t bytes) = 0;
  virtual void host_free(void* ptr) = 0;

  // Streams. `default_stream` is the stream work goes to when the caller names none.
  virtual StreamRef create_stream(int device) = 0;
  virtual void destroy_stream(int device, StreamHandle stream) = 0;
  virtual StreamRef default_stream(int device) = 0;
  // Resolves a handle received from outside (PyTorch, the C ABI) to its stable identity.
  virtual StreamRef resolve_stream(int device, StreamHandle stream) = 0;
  // Blocks the host until all work enqueued on `stream` so far has completed.
  virtual void synchronize_stream(int device, StreamHandle stream) = 0;

  // Events. A new or never-recorded event counts as complete, as in CUDA.
  virtual EventHandle create_event(int device) = 0;
  virtual void destroy_event(int device, EventHandle event) = 0;
  virtual void record_event(int device, EventHandle event, StreamHandle stream) = 0;
  // True when all work captured by the last record has completed. Never blocks.
  virtual bool query_event(int device, EventHandle event) = 0;
  virtual void synchronize_event(int device, EventHandle event) = 0;
  // Work enqueued on `stream` after this call starts only once `event` completes. Does not block
  // the host.
  virtual void stream_wait_event(int device, StreamHandle stream, EventHandle event) = 0;

  // Copies `bytes` from `src` to `dst` in stream order on `stream`. Does not block the host.
  virtual void memcpy_async(int device, void* dst, const void* src, size_t bytes, CopyKind kind,
                            StreamHandle stream) = 0;
};

}  // namespace spillway
