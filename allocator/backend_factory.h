// Builds the backend a configuration asks for: the CUDA runtime, or the simulated device.
#pragma once

#include <memory>

#include "allocator/backend.h"
#include "allocator/config.h"

namespace spillway {

// Throws InvalidArgumentError when `device:cuda` is asked for in a build without CUDA.
std::shared_ptr<Backend> MakeBackend(const Config& config);

// Whether this build includes the CUDA backend.
bool BuiltWithCuda();

}  // namespace spillway
