// The offload engine's view of a c10::StorageImpl.
#pragma once

#include <c10/core/Storage.h>

#include "offload/storage.h"

namespace spillway::torch_layer {

// Whether `storage` is one that Spillway's allocator made, and so can free and make again. A
// second storage over the same memory (torch.from_numpy(t.numpy()), DLPack, at::from_blob) has
// no allocator, and dropping its memory frees nothing but its hold on the first.
bool MadeBySpillway(const c10::Storage& storage);

class TorchStorage final : public Storage {
 public:
  TorchStorage(c10::Storage storage, int device) : storage_(std::move(storage)), device_(device) {}

  void* data() const override { return storage_.data_ptr().get(); }
  size_t nbytes() const override { return storage_.nbytes(); }
  int device() const override { return device_; }
  // Every TensorImpl on this storage holds one reference; this binding holds one more.
  int64_t external_holders() const override {
    return static_cast<int64_t>(storage_.use_count()) - 1;
  }
  void drop_device_memory() override;
  void* allocate_device_memory(StreamRef stream) override;

  const c10::Storage& storage() const { return storage_; }

 private:
  c10::Storage storage_;
  int device_;
};

}  // namespace spillway::torch_layer
