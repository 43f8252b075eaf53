// The engine's statistics, reported next to the allocator's as `spillway.<name>`.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "allocator/stats.h"

namespace spillway {

// Why an entry was not spilled. Counted once per storage and reason.
inline constexpr std::string_view kSkipSmall = "small";           // below offload_min_kb
inline constexpr std::string_view kSkipNoPinned = "no_pinned";    // pinned memory unavailable
inline constexpr std::string_view kSkipHostLimit = "host_limit";  // host_limit_mb reached
inline constexpr std::string_view kSkipForeign = "not_spillway";  // not allocated by Spillway
inline constexpr std::string_view kSkipEmpty = "empty";           // zero-byte storage
inline constexpr std::string_view kSkipCopyError = "copy_error";  // a copy could not be enqueued
// Resized (resize_, an out= op) or given other memory after its first save: the entry is stale.
inline constexpr std::string_view kSkipResized = "resized";
// Kept by eager at the end of its forward: beyond what the link carried before backward in the run
// of that forward before (ForwardSpillQuota, offload/policy.h).
inline constexpr std::string_view kSkipLink = "link";
// Saved while a backward that reads it ran (SavePhase::kBackward, offload/engine.h): kept on the
// device.
inline constexpr std::string_view kSkipBackward = "backward";

struct OffloadStats {
  Stat spilled_bytes;  // entries spilling or spilled
  Stat host_bytes;     // pinned bytes holding spilled data
  int64_t host_reserved_bytes = 0;
  int64_t num_entries = 0;
  int64_t num_keepers = 0;  // saved views registered, ever (not reset)
  int64_t num_spills = 0;
  int64_t num_reloads = 0;
  int64_t num_prefetch_hits = 0;  // reload finished before the consumer asked
  int64_t num_stalls = 0;         // the consumer had to wait for its reload
  int64_t stall_us = 0;           // upper bound of that wait (host time until seen complete)
  int64_t bytes_to_host = 0;
  int64_t bytes_to_device = 0;
  // Spills still copying to the host when backward wanted them: their device blocks were taken
  // back (no copy to the device), and their bytes.
  int64_t num_taken_back = 0;
  int64_t bytes_taken_back = 0;
  std::map<std::string, int64_t, std::less<>> skipped;

  // Keys without the `spillway.` prefix: "spilled_bytes.current", "num_spills", "skipped.small".
  std::map<std::string, int64_t> Flatten() const;
};

}  // namespace spillway
