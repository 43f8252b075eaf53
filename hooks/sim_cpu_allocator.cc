#include "hooks/sim_cpu_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <memory>

#include "allocator/errors.h"
#include "capi/process_allocator.h"

namespace spillway::torch_layer {

c10::DataPtr SimCpuAllocator::allocate(size_t nbytes) {
  void* ptr = nullptr;
  try {
    ptr = allocator_.Malloc(nbytes, 0, allocator_.backend().default_stream(0));
  } catch (const OutOfMemoryError& e) {
    // PyTorch turns c10::OutOfMemoryError into torch.cuda.OutOfMemoryError (a RuntimeError).
    C10_THROW_ERROR(OutOfMemoryError, e.what());
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());
  }
  return {ptr, ptr, &Delete, c10::Device(c10::DeviceType::CPU)};
}

void SimCpuAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  std::memcpy(dest, src, count);  // simulated device memory is host memory
}

void SimCpuAllocator::Delete(void* ptr) {
  if (ptr == nullptr) return;
  ProcessAllocator().Free(ptr, 0);
}

void SimCpuAllocator::Install(CachingAllocator& allocator) {
  // Leaked on purpose: tensors may be freed during interpreter shutdown.
  static SimCpuAllocator* instance = std::make_unique<SimCpuAllocator>(allocator).release();
  // The highest priority, so no later registration replaces it.
  c10::SetCPUAllocator(instance, /*priority=*/255);
}

}  // namespace spillway::torch_layer
