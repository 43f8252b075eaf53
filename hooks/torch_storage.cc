#include "hooks/torch_storage.h"

#include <Python.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <cassert>
#include <utility>

#include "allocator/errors.h"
#include "allocator/history.h"
#include "hooks/runtime.h"
#include "hooks/sim_cpu_allocator.h"
#include "hooks/torch_compat.h"

namespace spillway::torch_layer {

bool MadeBySpillway(const c10::Storage& storage) {
  const c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  if (impl->allocator() == nullptr) return false;
  // On the simulated device the deleter says it for sure (CPU storages made before install, by
  // PyTorch's own allocator, have one too).
  if (Runtime::Get().mode() == Mode::kSim) return SimCpuAllocator::Owns(impl->data_ptr());
  return Runtime::Get().allocator().Lookup(impl->data_ptr().get()).has_value();
}

int64_t Holders(const c10::StorageImpl* impl) {
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): a read-only count
  auto* target = const_cast<c10::StorageImpl*>(impl);
  const auto count = static_cast<int64_t>(c10::raw::intrusive_ptr::use_count(target));
#if SPILLWAY_TORCH_STORAGE_PYOBJECT_HOLDS
  // The object holds its reference only while another one exists (count >= 2); at a refcount of
  // 1 the storage's own reference to the object is the only one.
  PyObject* object = impl->pyobj_slot()->load_pyobj();
  if (object != nullptr && count >= 2 && Py_REFCNT(object) == 1) return count - 1;
#endif
  return count;
}

TorchStorage::TorchStorage(c10::Storage storage, int device)
    : storage_(std::move(storage)), device_(device) {
  // The snapshot's trace entries say which allocations were saved for backward (their category,
  // what PyTorch's memory viewer colours them by). Only here does the torch layer learn it: the
  // allocation was recorded before the save. (A no-op unless history is recorded; memory of
  // another allocator is no live allocation of Spillway's, and is left alone.)
  Runtime::Get().allocator().SetTraceCategory(data(), TraceCategory::kSavedForBackward);
}

TorchStorage::~TorchStorage() { assert(!OffloadEngine::InsideEngineOnThisThread()); }

void TorchStorage::drop_device_memory() {
  // Its free ends the allocation while the bytes live on on the host. (Memory a reload made and
  // the engine gives back stays a reload's: categories only rise.)
  Runtime::Get().allocator().SetTraceCategory(data(), TraceCategory::kSpilled);
  // The old DataPtr's deleter hands the block back to Spillway's allocator; its reuse is held
  // back by the stream use the engine recorded for the copy.
  storage_.unsafeGetStorageImpl()->set_data_ptr_noswap(c10::DataPtr(nullptr, storage_.device()));
}

void* TorchStorage::allocate_device_memory(StreamRef /*stream*/) {
  // The storage's own allocator allocates on the current stream, which is the consumer stream
  // the engine passes; going through it gives the memory the deleter PyTorch expects.
  c10::Allocator* allocator = storage_.unsafeGetStorageImpl()->allocator();
  TORCH_CHECK(allocator != nullptr, "spillway: a spilled storage has no allocator to reload with");
  // CUDA allocators allocate on the current device: make it the storage's own, whichever device
  // the unpacking thread has current.
  const c10::DeviceGuard device_guard(storage_.device());
  c10::DataPtr memory;
  try {
    memory = allocator->allocate(storage_.nbytes());
  } catch (const c10::OutOfMemoryError& e) {
    throw OutOfMemoryError(e.what_without_backtrace(), storage_.nbytes(), device_);
  }
  void* ptr = memory.get();
  Runtime::Get().allocator().SetTraceCategory(ptr, TraceCategory::kReloaded);
  storage_.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(memory));
  return ptr;
}

bool TorchStorage::adopt_device_memory(void* ptr) {
  // The DataPtr the storage's allocator would have made for this block: its deleter hands it
  // back to Spillway's allocator (both of Spillway's c10 allocators make them so).
  const c10::Allocator* allocator = storage_.unsafeGetStorageImpl()->allocator();
  if (allocator == nullptr || allocator->raw_deleter() == nullptr) return false;
  // Saved for backward again: its bytes never left (categories are set on the new allocation).
  Runtime::Get().allocator().SetTraceCategory(ptr, TraceCategory::kSavedForBackward);
  storage_.unsafeGetStorageImpl()->set_data_ptr_noswap(
      c10::DataPtr(ptr, ptr, allocator->raw_deleter(), storage_.device()));
  return true;
}

}  // namespace spillway::torch_layer
