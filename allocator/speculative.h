// Speculative allocations: guesses, such as the offload engine's prefetches, that take only the
// memory there is and give up quietly otherwise. A mode of the multi-device front
// (CachingAllocator), which asks the device core for a cached block or a new segment only
// (MallocOptions::reclaim); the core knows nothing of it. Thread-local: no lock, no sharing.
#pragma once

namespace spillway {

// While one is alive on a thread, allocations made on that thread are speculative. One that no
// cached block or new segment can serve at once fails right away with OutOfMemoryError. No
// cached segment is released for it (on CUDA each release is a device-synchronizing free), no
// holder is asked to make room, and nothing counts it as an out-of-memory error: not num_ooms,
// not the history, not PyTorch's out-of-memory observers. Scopes nest.
class SpeculativeAllocations {
 public:
  SpeculativeAllocations();
  ~SpeculativeAllocations();
  SpeculativeAllocations(const SpeculativeAllocations&) = delete;
  SpeculativeAllocations& operator=(const SpeculativeAllocations&) = delete;

  // Whether allocations on this thread are speculative now.
  static bool Active();

 private:
  bool enclosing_;
};

}  // namespace spillway
