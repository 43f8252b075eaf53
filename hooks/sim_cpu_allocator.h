// A c10 CPU allocator backed by Spillway on the simulated device. Installed as PyTorch's CPU
// allocator, it puts every CPU tensor created afterwards into simulated device memory with a
// capacity, so the whole path — hooks, spills, reloads, out-of-memory — runs without a GPU.
#pragma once

#include <c10/core/Allocator.h>

#include "allocator/caching_allocator.h"

namespace spillway::torch_layer {

class SimCpuAllocator final : public c10::Allocator {
 public:
  explicit SimCpuAllocator(CachingAllocator& allocator) : allocator_(allocator) {}

  c10::DataPtr allocate(size_t nbytes) override;
  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // Installs `allocator` as PyTorch's CPU allocator (process lifetime).
  static void Install(CachingAllocator& allocator);
  // True when `ptr` was handed out by this allocator (so its deleter frees it here).
  static bool Owns(const c10::DataPtr& ptr) { return ptr.get_deleter() == &Delete; }

 private:
  static void Delete(void* ptr);
  CachingAllocator& allocator_;
};

}  // namespace spillway::torch_layer
