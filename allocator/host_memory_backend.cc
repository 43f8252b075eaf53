#include "allocator/host_memory_backend.h"

#include <limits>
#include <utility>

#include "absl/status/status.h"

namespace spillway {

std::string HostMemoryBackend::last_failure() const {
  const std::lock_guard lock(failure_mutex_);
  return last_failure_;
}

MemInfo HostMemoryBackend::mem_info(int /*device*/) {
  constexpr size_t kUnknown = std::numeric_limits<size_t>::max();
  return MemInfo{kUnknown, kUnknown};
}

absl::StatusOr<void*> HostMemoryBackend::device_malloc(int /*device*/, size_t bytes) {
  absl::StatusOr<void*> memory = backend_.host_malloc(bytes);
  if (memory.ok()) return memory;
  {
    const std::lock_guard lock(failure_mutex_);
    last_failure_ = std::string(memory.status().message());
  }
  // Whatever the backend's reason, for the core it is no memory now: try less, or report.
  return absl::ResourceExhaustedError(memory.status().message());
}

void HostMemoryBackend::device_free(int /*device*/, void* ptr) { backend_.host_free(ptr); }

}  // namespace spillway
