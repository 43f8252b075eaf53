// Shared fixture: a CachingAllocator over a fresh simulated device.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <memory>

#include "allocator/caching_allocator.h"
#include "allocator/sim_backend.h"
#include "tests/allocator/test_util.h"

namespace spillway::testing {

class SimAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override { Reset(AllocatorConfig{}); }

  void Reset(const AllocatorConfig& config, size_t capacity = size_t{512} << 20, int devices = 1) {
    allocator_.reset();
    SimBackend::Options options;
    options.devices = devices;
    options.capacity_bytes = capacity;
    backend_ = std::make_shared<SimBackend>(options);
    allocator_ = std::make_unique<CachingAllocator>(backend_, config);
    stream_ = backend_->default_stream(0);
  }

  void* Alloc(size_t size, StreamRef stream) { return allocator_->Malloc(size, 0, stream); }
  void* Alloc(size_t size) { return Alloc(size, stream_); }
  int64_t Stat(const std::string& name) const { return allocator_->FlatStats(0).at(name); }

  std::shared_ptr<SimBackend> backend_;
  std::unique_ptr<CachingAllocator> allocator_;
  StreamRef stream_;
};

}  // namespace spillway::testing
