// Every difference between the torch versions Spillway builds against (1.13 here, 2.4–2.11 for
// users) lives in this one header, as small macros.
#pragma once

#include <torch/version.h>

#define SPILLWAY_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||           \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// torch 2.3 made c10::Allocator::allocate non-const and added the pure virtual copy_data.
#if SPILLWAY_TORCH_AT_LEAST(2, 3)
#define SPILLWAY_ALLOCATE_CONST
#define SPILLWAY_HAS_COPY_DATA 1
#else
#define SPILLWAY_ALLOCATE_CONST const
#define SPILLWAY_HAS_COPY_DATA 0
#endif
