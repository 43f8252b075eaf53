#include "allocator/backend.h"

#include <string_view>

namespace spillway {

std::string_view CopyKindName(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return "HostToDevice";
    case CopyKind::kDeviceToHost:
      return "DeviceToHost";
    case CopyKind::kDeviceToDevice:
      return "DeviceToDevice";
  }
  // Only reachable through a value cast from an out-of-range integer.
  return "UnknownCopyKind";
}

}  // namespace spillway
