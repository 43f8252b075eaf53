#include "allocator/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "allocator/errors.h"

namespace spillway {
namespace {

// Throws BackendError for anything but success. Non-sticky errors stay in the runtime's "last
// error" slot; clearing it keeps a later, unrelated check from reporting them again.
void Check(std::string_view operation, std::string_view function, cudaError_t error) {
  if (error == cudaSuccess) return;
  cudaGetLastError();
  throw BackendError(operation, absl::StrFormat("%s: %s (%s)", function, cudaGetErrorString(error),
                                                cudaGetErrorName(error)));
}

// Makes `device` current for one scope and restores the caller's device, so Spillway never leaves
// PyTorch's notion of the current device changed.
class DeviceGuard {
 public:
  DeviceGuard(std::string_view operation, int device) {
    Check(operation, "cudaGetDevice", cudaGetDevice(&previous_));
    if (previous_ != device) {
      Check(operation, "cudaSetDevice", cudaSetDevice(device));
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    // A destructor cannot throw; if restoring fails the context is broken and the caller's next
    // checked call reports it.
    if (changed_ && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

int CountDevices() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error == cudaErrorNoDevice || error == cudaErrorInsufficientDriver) {
    cudaGetLastError();
    return 0;
  }
  Check("device_count", "cudaGetDeviceCount", error);
  return count;
}

uint64_t StreamId(std::string_view operation, cudaStream_t stream) {
  unsigned long long id = 0;
  Check(operation, "cudaStreamGetId", cudaStreamGetId(stream, &id));
  return id;
}

cudaMemcpyKind ToCuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return cudaMemcpyHostToDevice;
    case CopyKind::kDeviceToHost:
      return cudaMemcpyDeviceToHost;
    case CopyKind::kDeviceToDevice:
      return cudaMemcpyDeviceToDevice;
  }
  throw BackendError("memcpy_async", "invalid copy kind");
}

cudaStream_t AsStream(StreamHandle handle) { return static_cast<cudaStream_t>(handle); }
cudaEvent_t AsEvent(EventHandle handle) { return static_cast<cudaEvent_t>(handle); }

}  // namespace

bool CudaDeviceAvailable() { return CountDevices() > 0; }

CudaBackend::CudaBackend() : device_count_(CountDevices()) {}

void CudaBackend::CheckDevice(int device) const {
  if (device < 0 || device >= device_count_) {
    throw InvalidArgumentError(
        absl::StrFormat("cuda backend: device %d out of range [0, %d)", device, device_count_));
  }
}

MemInfo CudaBackend::mem_info(int device) {
  CheckDevice(device);
  DeviceGuard guard("mem_info", device);
  MemInfo info;
  Check("mem_info", "cudaMemGetInfo", cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
  return info;
}

absl::StatusOr<void*> CudaBackend::device_malloc(int device, size_t bytes) {
  if (device < 0 || device >= device_count_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("device_malloc: device %d out of range [0, %d)", device, device_count_));
  }
  if (bytes == 0) return nullptr;  // What cudaMalloc returns too, without touching the device.
  DeviceGuard guard("device_malloc", device);
  void* ptr = nullptr;
  const cudaError_t error = cudaMalloc(&ptr, bytes);
  if (error == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // Out of memory is recoverable: leave no error behind.
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrFormat(
        "device_malloc: out of memory: requested %d bytes on device %d (%d of %d bytes free)",
        bytes, device, free_bytes, total_bytes));
  }
  Check("device_malloc", "cudaMalloc", error);
  return ptr;
}

void CudaBackend::device_free(int device, void* ptr) {
  CheckDevice(device);
  DeviceGuard guard("device_free", device);
  Check("device_free", "cudaFree", cudaFree(ptr));
}

absl::StatusOr<void*> CudaBackend::host_malloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* ptr = nullptr;
  // Portable: the buffer serves copies on every device, not only the current one.
  const cudaError_t error = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
  if (error == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrFormat("host_malloc: out of pinned memory: requested %d bytes", bytes));
  }
  Check("host_malloc", "cudaHostAlloc", error);
  return ptr;
}

void CudaBackend::host_free(void* ptr) { Check("host_free", "cudaFreeHost", cudaFreeHost(ptr)); }

StreamRef CudaBackend::create_stream(int device) {
  CheckDevice(device);
  DeviceGuard guard("create_stream", device);
  cudaStream_t stream = nullptr;
  Check("create_stream", "cudaStreamCreateWithFlags",
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  unsigned long long id = 0;
  const cudaError_t error = cudaStreamGetId(stream, &id);
  if (error != cudaSuccess) {
    cudaStreamDestroy(stream);  // Do not leak the stream we could not identify.
    Check("create_stream", "cudaStreamGetId", error);
  }
  return StreamRef{stream, id};
}

void CudaBackend::destroy_stream(int device, StreamHandle stream) {
  CheckDevice(device);
  if (stream == nullptr)
    throw BackendError("destroy_stream", "the default stream cannot be destroyed");
  DeviceGuard guard("destroy_stream", device);
  Check("destroy_stream", "cudaStreamDestroy", cudaStreamDestroy(AsStream(stream)));
}

StreamRef CudaBackend::default_stream(int device) {
  CheckDevice(device);
  DeviceGuard guard("default_stream", device);
  return StreamRef{nullptr, StreamId("default_stream", nullptr)};
}

StreamRef CudaBackend::resolve_stream(int device, StreamHandle stream) {
  CheckDevice(device);
  DeviceGuard guard("resolve_stream", device);
  return StreamRef{stream, StreamId("resolve_stream", AsStream(stream))};
}

void CudaBackend::synchronize_stream(int device, StreamHandle stream) {
  CheckDevice(device);
  DeviceGuard guard("synchronize_stream", device);
  Check("synchronize_stream", "cudaStreamSynchronize", cudaStreamSynchronize(AsStream(stream)));
}

EventHandle CudaBackend::create_event(int device) {
  CheckDevice(device);
  DeviceGuard guard("create_event", device);
  cudaEvent_t event = nullptr;
  Check("create_event", "cudaEventCreateWithFlags",
        cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}

void CudaBackend::destroy_event(int device, EventHandle event) {
  CheckDevice(device);
  DeviceGuard guard("destroy_event", device);
  Check("destroy_event", "cudaEventDestroy", cudaEventDestroy(AsEvent(event)));
}

void CudaBackend::record_event(int device, EventHandle event, StreamHandle stream) {
  CheckDevice(device);
  DeviceGuard guard("record_event", device);
  Check("record_event", "cudaEventRecord", cudaEventRecord(AsEvent(event), AsStream(stream)));
}

bool CudaBackend::query_event(int device, EventHandle event) {
  CheckDevice(device);
  DeviceGuard guard("query_event", device);
  const cudaError_t error = cudaEventQuery(AsEvent(event));
  if (error == cudaErrorNotReady) {
    cudaGetLastError();  // "Not ready" is an answer, not an error; do not leave it behind.
    return false;
  }
  Check("query_event", "cudaEventQuery", error);
  return true;
}

void CudaBackend::synchronize_event(int device, EventHandle event) {
  CheckDevice(device);
  DeviceGuard guard("synchronize_event", device);
  Check("synchronize_event", "cudaEventSynchronize", cudaEventSynchronize(AsEvent(event)));
}

void CudaBackend::stream_wait_event(int device, StreamHandle stream, EventHandle event) {
  CheckDevice(device);
  DeviceGuard guard("stream_wait_event", device);
  Check("stream_wait_event", "cudaStreamWaitEvent",
        cudaStreamWaitEvent(AsStream(stream), AsEvent(event), 0));
}

void CudaBackend::memcpy_async(int device, void* dst, const void* src, size_t bytes, CopyKind kind,
                               StreamHandle stream) {
  CheckDevice(device);
  const cudaMemcpyKind cuda_kind = ToCuda(kind);
  DeviceGuard guard("memcpy_async", device);
  Check("memcpy_async", "cudaMemcpyAsync",
        cudaMemcpyAsync(dst, src, bytes, cuda_kind, AsStream(stream)));
}

}  // namespace spillway
