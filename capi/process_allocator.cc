#include "capi/process_allocator.h"

#include <memory>
#include <mutex>
#include <string>

#include "allocator/backend_factory.h"
#include "allocator/errors.h"

namespace spillway {
namespace {

struct ProcessState {
  std::mutex mutex;
  Config config;
  // Never destroyed: PyTorch may free tensors during interpreter shutdown, after static
  // destructors ran.
  CachingAllocator* allocator = nullptr;
};

ProcessState& State() {
  static ProcessState* state = std::make_unique<ProcessState>().release();
  return *state;
}

}  // namespace

bool ConfigureProcessAllocator(const Config& config) {
  ProcessState& state = State();
  std::lock_guard lock(state.mutex);
  if (state.allocator != nullptr) return false;
  state.allocator =
      std::make_unique<CachingAllocator>(MakeBackend(config), config.allocator).release();
  state.config = config;
  return true;
}

CachingAllocator& ProcessAllocator() {
  if (CachingAllocator* existing = ProcessAllocatorIfCreated()) return *existing;
  absl::StatusOr<Config> config = ConfigFromEnvironment();
  if (!config.ok()) throw InvalidArgumentError(std::string(config.status().message()));
  ConfigureProcessAllocator(*config);  // loses harmlessly to a concurrent configure
  return *ProcessAllocatorIfCreated();
}

CachingAllocator* ProcessAllocatorIfCreated() {
  ProcessState& state = State();
  std::lock_guard lock(state.mutex);
  return state.allocator;
}

Config ProcessConfig() {
  ProcessState& state = State();
  std::lock_guard lock(state.mutex);
  return state.config;
}

}  // namespace spillway
