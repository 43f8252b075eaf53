#include "offload/offload_stats.h"

namespace spillway {

std::map<std::string, int64_t> OffloadStats::Flatten() const {
  std::map<std::string, int64_t> out = {
      {"spilled_bytes.current", spilled_bytes.current},
      {"spilled_bytes.peak", spilled_bytes.peak},
      {"host_bytes.current", host_bytes.current},
      {"host_bytes.peak", host_bytes.peak},
      {"host_reserved_bytes", host_reserved_bytes},
      {"num_entries", num_entries},
      {"num_keepers", num_keepers},
      {"num_spills", num_spills},
      {"num_reloads", num_reloads},
      {"num_prefetch_hits", num_prefetch_hits},
      {"num_stalls", num_stalls},
      {"stall_us", stall_us},
      {"bytes_to_host", bytes_to_host},
      {"bytes_to_device", bytes_to_device},
      {"num_taken_back", num_taken_back},
      {"bytes_taken_back", bytes_taken_back},
  };
  for (std::string_view reason :
       {kSkipSmall, kSkipNoPinned, kSkipHostLimit, kSkipForeign, kSkipEmpty, kSkipCopyError,
        kSkipResized, kSkipLink, kSkipBackward}) {
    out["skipped." + std::string(reason)] = 0;
  }
  for (const auto& [reason, count] : skipped) out["skipped." + reason] = count;
  return out;
}

}  // namespace spillway
