#include "hooks/runtime.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"
#include "capi/process_allocator.h"
#include "hooks/cuda_allocator.h"
#include "hooks/sim_cpu_allocator.h"

namespace spillway::torch_layer {
namespace {

constexpr const char* kNotInstalled =
    "spillway is not installed: call spillway.install(device=\"cuda\" or \"sim\") first";

}  // namespace

Runtime& Runtime::Get() {
  // Leaked on purpose: saved tensors may be released during interpreter shutdown.
  static Runtime* runtime = new Runtime();  // NOLINT(cppcoreguidelines-owning-memory)
  return *runtime;
}

void Runtime::Install(const std::string& device, const std::string& conf, size_t capacity_bytes) {
  Config base;
  if (device == "sim") {
    base.device = DeviceKind::kSim;
  } else if (device == "cuda") {
    base.device = DeviceKind::kCuda;
  } else {
    throw InvalidArgumentError(absl::StrFormat(
        "unknown device '%s' for spillway.install: expected \"cuda\" or \"sim\"", device));
  }
  constexpr size_t kMiB = size_t{1} << 20;
  if (capacity_bytes != 0) {
    if (base.device != DeviceKind::kSim) {
      throw InvalidArgumentError("capacity_bytes applies to device='sim' only");
    }
    if (capacity_bytes % kMiB != 0) {
      throw InvalidArgumentError(absl::StrFormat(
          "capacity_bytes must be a multiple of 1 MiB (%d), got %d", kMiB, capacity_bytes));
    }
    base.sim_capacity_bytes = capacity_bytes;
  }
  // The call as messages show it, the capacity as its key.
  std::string text = conf;
  if (capacity_bytes != 0) {
    const std::string key = absl::StrFormat("capacity_mb:%d", capacity_bytes / kMiB);
    text = text.empty() ? key : text + "," + key;
  }
  const std::string call = absl::StrFormat("device=%s, conf=\"%s\"", device, text);
  // What the call names, on top of `defaults`: checked before anything is installed or compared.
  const auto named = [&](const Config& defaults) {
    absl::StatusOr<Config> parsed = ParseConfig(conf, defaults);
    if (!parsed.ok()) throw InvalidArgumentError(std::string(parsed.status().message()));
    if (parsed->device != base.device) {
      throw InvalidArgumentError(absl::StrFormat(
          "spillway.install(device=\"%s\") conflicts with the configuration's device key in "
          "\"%s\"",
          device, conf));
    }
    // Only a configuration that names the key can have changed the capacity the call gave.
    if (capacity_bytes != 0 && parsed->sim_capacity_bytes != capacity_bytes) {
      throw InvalidArgumentError(absl::StrFormat(
          "spillway.install(capacity_bytes=%d) conflicts with the configuration's capacity_mb "
          "key in \"%s\" (%d MiB)",
          capacity_bytes, conf, parsed->sim_capacity_bytes / kMiB));
    }
    return *std::move(parsed);
  };
  std::lock_guard lock(mutex_);
  if (mode_ != Mode::kNone) {
    // A repeat is a no-op when everything it names is what the install in force has. Keys it
    // leaves out are no request for their defaults: a script's install("sim") under
    // SPILLWAY_ALLOC_CONF=device:sim,offload:eager asks for nothing new.
    Config again = config_;
    again.device = base.device;
    if (capacity_bytes != 0) again.sim_capacity_bytes = capacity_bytes;
    Config repeat = named(again);
    repeat.backend_spillway = config_.backend_spillway;
    if (repeat == config_) return;
    throw InvalidArgumentError(absl::StrFormat(
        "spillway is already installed (%s); one install per process, and this call asks for "
        "something else: %s",
        install_call_, call));
  }
  const Config parsed = named(base);
  if (!ConfigureProcessAllocator(parsed)) {
    const Config made = ProcessConfig();
    if (made.device != parsed.device) {
      throw InvalidArgumentError(
          "Spillway's process allocator was already created for another device (by the C ABI, "
          "from SPILLWAY_ALLOC_CONF, or by an earlier install that failed); install before any "
          "allocation");
    }
    // A retry after a failed install: the allocator that attempt made keeps its settings.
    if (abandoned_ && made.allocator != parsed.allocator) {
      throw InvalidArgumentError(absl::StrFormat(
          "spillway.install: an earlier install in this process failed after it had created "
          "Spillway's allocator (%s), and this call asks for other allocator settings (%s); "
          "retry with the same ones, or in a new process",
          abandoned_call_, call));
    }
  }
  allocator_ = &ProcessAllocator();
  config_ = parsed;
  if (parsed.device == DeviceKind::kSim) SimCpuAllocator::Install(*allocator_);
  mode_ = parsed.device == DeviceKind::kSim ? Mode::kSim : Mode::kCuda;
  install_call_ = call;
}

void Runtime::AbandonCudaInstall() {
  std::lock_guard lock(mutex_);
  if (mode_ != Mode::kCuda || engine_ != nullptr) {
    throw InvalidArgumentError(
        "AbandonCudaInstall: only a CUDA install that nothing used yet can be undone");
  }
  mode_ = Mode::kNone;
  abandoned_ = true;
  abandoned_call_ = std::exchange(install_call_, {});
  config_ = Config{};
  allocator_ = nullptr;
}

Mode Runtime::mode() const {
  std::lock_guard lock(mutex_);
  return mode_;
}

CachingAllocator& Runtime::allocator() const {
  std::lock_guard lock(mutex_);
  if (allocator_ == nullptr) {
    throw InvalidArgumentError(kNotInstalled);
  }
  return *allocator_;
}

OffloadEngine& Runtime::engine() {
  std::lock_guard lock(mutex_);
  // The allocator and the configuration in one hold: an install undone in between
  // (AbandonCudaInstall) must not leave an engine made with another install's settings.
  if (allocator_ == nullptr) {
    throw InvalidArgumentError(kNotInstalled);
  }
  if (engine_ == nullptr) {
    engine_ = std::make_unique<OffloadEngine>(*allocator_, config_.offload);
    for (const char* reason : kTorchSkipReasons) engine_->DeclareSkipReason(reason);
    if (host_history_entries_) engine_->RecordHostHistory(true, *host_history_entries_);
  }
  return *engine_;
}

OffloadEngine* Runtime::engine_if_created() {
  std::lock_guard lock(mutex_);
  return engine_.get();
}

void Runtime::RecordHostHistory(bool enabled, size_t max_entries) {
  std::lock_guard lock(mutex_);
  host_history_entries_.reset();
  if (enabled) host_history_entries_ = max_entries;
  if (engine_ != nullptr) engine_->RecordHostHistory(enabled, max_entries);
}

void Runtime::EmptyCache(CachingAllocator& allocator) {
  allocator.EmptyCache();
  if (OffloadEngine* engine = engine_if_created()) engine->TrimHostMemory();
}

void Runtime::CheckServes(c10::Device device, const std::string& what) const {
  if (Serves(device)) return;
  throw InvalidArgumentError(what + ": a tensor on " + device.str() +
                             " is not on the device Spillway serves (" +
                             (mode() == Mode::kSim ? "cpu, the simulated device" : "cuda") + ")");
}

StreamRef Runtime::CurrentStream(int device) const {
  CachingAllocator& alloc = allocator();
  if (mode() == Mode::kSim) return alloc.backend().default_stream(device);
  // Each save and each unpack asks: resolved as the allocator's own allocations are, without a
  // device guard and two runtime calls each time on PyTorch's streams.
  return CurrentCudaStream(alloc, device);
}

}  // namespace spillway::torch_layer
