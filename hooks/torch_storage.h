// The offload engine's view of a c10::StorageImpl.
#pragma once

#include <c10/core/Storage.h>

#include "offload/storage.h"

namespace spillway::torch_layer {

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
