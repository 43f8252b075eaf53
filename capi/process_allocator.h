// The process-wide allocator, owned by libspillway_alloc.so so that PyTorch (through the C ABI or
// an adapter) and the offload engine (through the Python extension) share one instance.
#pragma once

#include "allocator/caching_allocator.h"
#include "allocator/config.h"

namespace spillway {

// Creates the process allocator with `config` unless it exists. Returns false, changing
// nothing, when it already exists (with the configuration it was created with).
bool ConfigureProcessAllocator(const Config& config);
// The process allocator; created from SPILLWAY_ALLOC_CONF on first use when not configured.
// Throws InvalidArgumentError when that variable does not parse.
CachingAllocator& ProcessAllocator();
// Null until created.
CachingAllocator* ProcessAllocatorIfCreated();
// The configuration it was created with (defaults before creation).
Config ProcessConfig();

}  // namespace spillway
