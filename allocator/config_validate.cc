// Checks of configurations built in code (the parser checks the text it reads, in config.cc):
// the same ranges, except where code may go below PyTorch's floors and still work.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "allocator/config.h"
#include "allocator/size_policy.h"

namespace spillway {
namespace {

// The offload settings go back and forth to Python as signed 64-bit byte counts.
constexpr size_t kInt64Max = std::numeric_limits<int64_t>::max();

// A field of a configuration built in code, with a value the parser would have refused.
absl::Status BadField(std::string_view config, std::string_view field, std::string_view value,
                      std::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrFormat("bad %s.%s = %s: expected %s", config, field, value, expected));
}

// Fractions built in code may be 0 for "not set"; the parser never yields 0 (the key's absence
// means it). NaN fails both comparisons.
bool InRange(double value, double low, double high, bool include_high) {
  return value >= low && (include_high ? value <= high : value < high);
}

}  // namespace

absl::Status ValidateAllocatorConfig(const AllocatorConfig& config) {
  constexpr std::string_view kName = "AllocatorConfig";
  // Blocks of max_split_size or more are never split nor handed to smaller requests, so at 2 MiB
  // or less a small-pool segment could serve nothing but its first request. (The parser's floor is
  // PyTorch's, 20 MiB; code, tests among it, may go lower, down to what still works.)
  if (config.max_split_size <= kSmallBuffer) {
    return BadField(kName, "max_split_size", absl::StrFormat("%d bytes", config.max_split_size),
                    absl::StrFormat("more than %d bytes (2 MiB, a small-pool segment), or SIZE_MAX "
                                    "for no limit",
                                    kSmallBuffer));
  }
  for (size_t i = 0; i < config.roundup_power2_divisions.size(); ++i) {
    const size_t divisions = config.roundup_power2_divisions[i];
    if (divisions != 0 && !std::has_single_bit(divisions)) {
      return BadField(kName, absl::StrFormat("roundup_power2_divisions[%d]", i),
                      absl::StrFormat("%d", divisions), "0 or a power of two");
    }
  }
  if (!InRange(config.garbage_collection_threshold, 0.0, 1.0, /*include_high=*/false)) {
    return BadField(kName, "garbage_collection_threshold",
                    absl::StrFormat("%g", config.garbage_collection_threshold),
                    "a number in [0, 1) (0 = off)");
  }
  if (!InRange(config.per_process_memory_fraction, 0.0, 1.0, /*include_high=*/true)) {
    return BadField(kName, "per_process_memory_fraction",
                    absl::StrFormat("%g", config.per_process_memory_fraction),
                    "a number in [0, 1] (0 = not set)");
  }
  // No upper bound: the history ring grows as entries come (torch asks for sys.maxsize).
  if (config.history_entries == 0) {
    return BadField(kName, "history_entries", "0", "a positive number of entries");
  }
  return absl::OkStatus();
}

absl::Status ValidateOffloadConfig(const OffloadConfig& config) {
  constexpr std::string_view kName = "OffloadConfig";
  switch (config.policy) {
    case OffloadPolicy::kOff:
    case OffloadPolicy::kEager:
    case OffloadPolicy::kAuto:
      break;
    default:
      return BadField(kName, "policy", absl::StrFormat("%d", static_cast<int>(config.policy)),
                      "kOff, kEager or kAuto");
  }
  if (!InRange(config.budget_fraction, 0.0, 1.0, /*include_high=*/true) ||
      config.budget_fraction == 0.0) {
    return BadField(kName, "budget_fraction", absl::StrFormat("%g", config.budget_fraction),
                    "a number in (0, 1]");
  }
  // They travel to Python as signed 64-bit byte counts.
  const std::pair<std::string_view, size_t> byte_counts[] = {
      {"budget_bytes", config.budget_bytes},
      {"min_bytes", config.min_bytes},
      {"prefetch_bytes", config.prefetch_bytes.value_or(0)},
      {"host_limit_bytes", config.host_limit_bytes},
  };
  for (const auto& [field, bytes] : byte_counts) {
    if (bytes > kInt64Max) {
      return BadField(kName, field, absl::StrFormat("%d bytes", bytes),
                      absl::StrFormat("at most %d bytes (INT64_MAX)", kInt64Max));
    }
  }
  return absl::OkStatus();
}

}  // namespace spillway
