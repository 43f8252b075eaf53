// A simulated device that counts mem_info calls per device, for the allocator and engine tests.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>

#include "allocator/sim_backend.h"

namespace spillway::testing {

// Counts mem_info calls per device: on CUDA each one creates the device's context, so code
// serving one GPU of many must not ask about the others.
class CountingSimBackend : public SimBackend {
 public:
  using SimBackend::SimBackend;
  // `devices` devices of `capacity_bytes` each.
  static std::shared_ptr<CountingSimBackend> Make(int devices, size_t capacity_bytes) {
    SimBackend::Options options;
    options.devices = devices;
    options.capacity_bytes = capacity_bytes;
    return std::make_shared<CountingSimBackend>(options);
  }
  MemInfo mem_info(int device) override {
    std::lock_guard lock(mutex_);
    ++mem_info_calls[device];
    return SimBackend::mem_info(device);
  }
  std::map<int, int> mem_info_calls;

 private:
  std::mutex mutex_;
};

}  // namespace spillway::testing
