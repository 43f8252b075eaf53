// What the pinned pool tests share (pinned_pool_blocks_test.cc, pinned_pool_stream_order_test.cc):
// a pool's options, and an Allocate that fails the test instead of returning an error (sizes:
// tests/allocator/test_util.h).
#pragma once

#include <gtest/gtest.h>

#include <cstddef>

#include "absl/status/statusor.h"
#include "offload/pinned_pool.h"
#include "tests/allocator/test_util.h"

namespace spillway::testing {

inline PinnedPool::Options Grow(size_t grow_bytes, size_t limit_bytes = 0) {
  PinnedPool::Options options;
  options.grow_bytes = grow_bytes;
  options.limit_bytes = limit_bytes;
  return options;
}

// Allocates or records a failure; a null result then makes the test's next use of it fail too.
inline void* Take(PinnedPool& pool, size_t bytes) {
  absl::StatusOr<void*> ptr = pool.Allocate(bytes);
  if (!ptr.ok()) {
    ADD_FAILURE() << "Allocate(" << bytes << "): " << ptr.status();
    return nullptr;
  }
  return *ptr;
}

inline void* Offset(void* ptr, size_t bytes) { return static_cast<char*>(ptr) + bytes; }

}  // namespace spillway::testing
