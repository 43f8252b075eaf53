// Simulated devices whose mem_info answers differently, for the allocator and engine tests: one
// counts the calls per device, one fails them on demand.
#pragma once

#include <atomic>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>

#include "allocator/errors.h"
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

// A simulated device whose mem_info fails while `fail_mem_info` is set (on CUDA that query creates
// the device's context, and may fail).
class FailingMemInfoBackend : public SimBackend {
 public:
  using SimBackend::SimBackend;
  MemInfo mem_info(int device) override {
    if (fail_mem_info) throw BackendError("mem_info", "injected failure");
    return SimBackend::mem_info(device);
  }
  std::atomic<bool> fail_mem_info{false};
};

}  // namespace spillway::testing
