#include "allocator/backend_factory.h"

#include "allocator/errors.h"
#include "allocator/sim_backend.h"
#if defined(SPILLWAY_HAVE_CUDA)
#include "allocator/cuda_backend.h"
#endif

namespace spillway {

bool BuiltWithCuda() {
#if defined(SPILLWAY_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

std::shared_ptr<Backend> MakeBackend(const Config& config) {
  if (config.device == DeviceKind::kSim) {
    SimBackend::Options options;
    options.devices = config.sim_devices;
    options.capacity_bytes = config.sim_capacity_bytes;
    options.max_jitter = config.sim_max_jitter;
    options.link_bytes_per_second = config.sim_link_bytes_per_second;
    return std::make_shared<SimBackend>(options);
  }
#if defined(SPILLWAY_HAVE_CUDA)
  return std::make_shared<CudaBackend>();
#else
  throw InvalidArgumentError(
      "device:cuda was requested but this Spillway build has no CUDA backend (built without a "
      "CUDA toolkit); use device:sim, or rebuild where CUDA is installed");
#endif
}

}  // namespace spillway
