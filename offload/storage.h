// What the offload engine needs to know about, and do to, a storage. The torch layer implements
// this over a c10::StorageImpl; tests implement it over a raw allocation. The engine never sees a
// tensor: one entry per storage, however many views keep it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "allocator/backend.h"

namespace spillway {

// Geometry of one saved view of a storage (for diagnostics and `spillway.keepers()`).
struct ViewInfo {
  int64_t offset = 0;  // in elements
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  size_t element_size = 1;
};

class Storage {
 public:
  virtual ~Storage() = default;
  // Current device pointer; null while the storage is spilled.
  virtual void* data() const = 0;
  virtual size_t nbytes() const = 0;
  virtual int device() const = 0;
  // How many holders other than the engine's own saved-view handles keep this storage alive
  // (tensors the program still uses, parameters, outputs, ...). Only storages at 0 are spilled.
  virtual int64_t external_holders() const = 0;
  // Gives up the device memory: the storage keeps its size but no longer points at memory, and
  // the memory goes back to Spillway's allocator (whose stream-use mechanism delays its reuse
  // until the engine's copy is done).
  virtual void drop_device_memory() = 0;
  // Allocates nbytes() of device memory from Spillway's allocator for use on `stream`, installs
  // it as this storage's memory and returns it. The storage allocates (rather than adopting a
  // pointer the engine allocated) so that the memory carries whatever deleter the storage's
  // framework expects. Throws OutOfMemoryError when the allocator cannot serve it.
  virtual void* allocate_device_memory(StreamRef stream) = 0;
  // Installs `ptr` as this storage's memory again: the block it gave up (drop_device_memory),
  // which Spillway's allocator took back as a live allocation of its size before reusing it
  // (CachingAllocator::Revive). The storage owns it from here, with the deleter its framework
  // expects. False, changing nothing, when the storage cannot own memory it did not allocate
  // itself: the caller frees `ptr` then.
  virtual bool adopt_device_memory(void* ptr) = 0;
};

}  // namespace spillway
