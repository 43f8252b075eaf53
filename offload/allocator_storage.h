// A Storage over raw memory from Spillway's allocator, with a settable count of other holders:
// what the engine's tests, fuzzer and benchmarks offload (the torch layer's binding is
// hooks/torch_storage.h). Not thread-safe beyond `holders`, which tests flip from other threads.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "allocator/caching_allocator.h"
#include "offload/storage.h"

namespace spillway {

class AllocatorStorage : public Storage {
 public:
  AllocatorStorage(CachingAllocator& allocator, size_t nbytes, StreamRef stream,
                   int64_t holders = 1, int device = 0)
      : holders(holders), allocator_(allocator), nbytes_(nbytes), device_(device) {
    ptr_ = allocator_.Malloc(nbytes, device_, stream);
  }
  ~AllocatorStorage() override {
    if (ptr_ != nullptr) allocator_.Free(ptr_);
  }
  AllocatorStorage(const AllocatorStorage&) = delete;
  AllocatorStorage& operator=(const AllocatorStorage&) = delete;

  void* data() const override { return ptr_; }
  size_t nbytes() const override { return nbytes_; }
  int device() const override { return device_; }
  int64_t external_holders() const override { return holders.load(); }
  void drop_device_memory() override {
    allocator_.Free(ptr_);
    ptr_ = nullptr;
  }
  void* allocate_device_memory(StreamRef stream) override {
    ptr_ = allocator_.Malloc(nbytes_, device_, stream);
    return ptr_;
  }
  bool adopt_device_memory(void* ptr) override {
    ptr_ = ptr;
    return true;
  }

  // Holders besides the engine: the "program" still using the storage.
  std::atomic<int64_t> holders;

 private:
  CachingAllocator& allocator_;
  size_t nbytes_;
  int device_;
  void* ptr_ = nullptr;
};

}  // namespace spillway
