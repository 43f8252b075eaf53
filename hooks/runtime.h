// The process-wide state of the torch layer: which device Spillway serves, the allocator, and the
// offload engine. One per process, created by `spillway.install()` (or the environment hook).
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "allocator/caching_allocator.h"
#include "allocator/config.h"
#include "offload/engine.h"

namespace spillway::torch_layer {

enum class Mode { kNone, kSim, kCuda };

// Why the saved-tensor hooks keep a tensor as it is (besides the engine's own reasons).
inline constexpr const char* kTorchSkipReasons[] = {
    "undefined", "nested", "layout", "subclass", "quantized", "no_storage", "other_device"};

class Runtime {
 public:
  static Runtime& Get();

  // Installs Spillway for `device` ("sim" or "cuda") with configuration text `conf`. The same call
  // again is a no-op; a different one throws InvalidArgumentError naming both. `capacity_bytes`
  // (0: not given; a multiple of 1 MiB, device "sim" only) sizes the simulated device; like
  // `device`, it must agree with the configuration's own key when both name it.
  void Install(const std::string& device, const std::string& conf, size_t capacity_bytes = 0);
  // Undoes a CUDA install whose route into torch then failed, before anything was served through
  // it: as if Install had not run, so that installed() is false and a retry checks everything
  // again. Throws InvalidArgumentError when the install is no CUDA one or offload was used.
  void AbandonCudaInstall();
  Mode mode() const;
  bool installed() const { return mode() != Mode::kNone; }
  // Throws when nothing is installed.
  CachingAllocator& allocator() const;
  // Created on first use with the installed configuration's offload settings.
  OffloadEngine& engine();
  OffloadEngine* engine_if_created();
  // Turns the pinned host pools' history on (`max_entries` as PinnedPool::RecordHistory) or off,
  // for the engine made later too: recording it is no reason to make the engine now.
  void RecordHostHistory(bool enabled, size_t max_entries);
  // Empties `allocator`'s cache and gives back the pinned host chunks no spilled data uses, if
  // the engine exists: spillway.empty_cache() and torch.cuda.empty_cache() through the c10
  // adapter (whose allocator is the installed one; a benchmark's adapter has no engine).
  void EmptyCache(CachingAllocator& allocator);
  const Config& config() const { return config_; }
  // The stream torch work on `device` goes to now: the default stream on the simulated device
  // (CPU kernels run on the host), the current CUDA stream otherwise.
  StreamRef CurrentStream(int device) const;
  // Whether Spillway serves `device`: the CPU on the simulated device, CUDA otherwise.
  bool Serves(c10::Device device) const {
    return mode() == Mode::kSim ? device.is_cpu() : device.is_cuda();
  }
  // Throws InvalidArgumentError, naming the call `what` (e.g. "spillway.release") and the device
  // Spillway serves, when it does not serve `device`.
  void CheckServes(c10::Device device, const std::string& what) const;
  // True when consumers are host code (the simulated device): unpack waits on the host.
  bool host_consumers() const { return mode() == Mode::kSim; }

 private:
  Runtime() = default;
  mutable std::mutex mutex_;
  Mode mode_ = Mode::kNone;
  // The install's device, capacity and conf, as an error for a different call shows them.
  std::string install_call_;
  // A CUDA install undone (AbandonCudaInstall): the process allocator it made stays, with its
  // settings, and a retry must ask for the same ones.
  bool abandoned_ = false;
  std::string abandoned_call_;
  Config config_;
  CachingAllocator* allocator_ = nullptr;
  std::unique_ptr<OffloadEngine> engine_;
  std::optional<size_t> host_history_entries_;  // while the pinned pools record their history
};

}  // namespace spillway::torch_layer
