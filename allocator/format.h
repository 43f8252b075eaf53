// Human-readable byte counts for messages ("20.00 MiB").
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/str_format.h"

namespace spillway {

inline std::string FormatBytes(size_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(kUnits)) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return absl::StrFormat("%d B", bytes);
  return absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

}  // namespace spillway
