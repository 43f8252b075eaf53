// The offload engine's view of a c10::StorageImpl.
#pragma once

#include <c10/core/Storage.h>

#include "offload/storage.h"

namespace spillway::torch_layer {

// Whether `storage` is one that Spillway's allocator made, and so can free and make again. A
// second storage over the same memory (torch.from_numpy(t.numpy()), DLPack, at::from_blob) has
// no allocator, and dropping its memory frees nothing but its hold on the first.
bool MadeBySpillway(const c10::Storage& storage);

// The strong references to `impl` that are holders: its use count, less the reference of its
// Python storage object while nothing in Python refers to that object. From torch 2.10 on
// (PR #167564) a storage's Python object, once made (`t.untyped_storage()`, FSDP2, torchtune's
// probes, safetensors), holds a strong reference for as long as any other reference exists, and
// the storage keeps the object alive in turn: that reference keeps nothing alive that the others
// do not, and counted, it would make every such storage look held forever (never spilled). While
// Python code holds the object (`s = t.untyped_storage()`), the object is a holder and counts.
// Before 2.10 an object nothing in Python refers to holds no reference (ownership flips to the
// storage), so the use count is the holders. Reads the object's refcount without the GIL: the
// object is alive while the storage's count is 2 or more (the storage holds it), and the count
// is read as a hint, as use_count() is.
int64_t Holders(const c10::StorageImpl* impl);

// The engine makes one per storage, at the save that gives the storage an entry
// (OffloadEngine::AddKeeper's factory): making one notes the storage's memory as saved for
// backward in the allocator's history, and dropping or reallocating it notes a spill or a reload.
class TorchStorage final : public Storage {
 public:
  TorchStorage(c10::Storage storage, int device);
  // Asserts (debug builds) that the engine's lock is not held: from torch 2.10 on the storage's
  // last release can take the GIL and run Python (the engine defers it, DeferRelease).
  ~TorchStorage() override;
  TorchStorage(const TorchStorage&) = delete;
  TorchStorage& operator=(const TorchStorage&) = delete;

  void* data() const override { return storage_.data_ptr().get(); }
  size_t nbytes() const override { return storage_.nbytes(); }
  int device() const override { return device_; }
  // Every TensorImpl on this storage holds one reference; this binding holds one more.
  int64_t external_holders() const override { return Holders(storage_.unsafeGetStorageImpl()) - 1; }
  void drop_device_memory() override;
  void* allocate_device_memory(StreamRef stream) override;
  bool adopt_device_memory(void* ptr) override;

  const c10::Storage& storage() const { return storage_; }

 private:
  c10::Storage storage_;
  int device_;
};

}  // namespace spillway::torch_layer
