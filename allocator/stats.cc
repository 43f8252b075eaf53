#include "allocator/stats.h"

#include <string_view>
#include <utility>

namespace spillway {
namespace {

template <typename Fn>
void ForEachStat(DeviceStats& s, Fn fn) {
  for (StatArray* a :
       {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
        &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes}) {
    for (Stat& stat : a->by_pool) fn(stat);
  }
  fn(s.oversize_allocations);
  fn(s.oversize_segments);
}

}  // namespace

void DeviceStats::ResetAccumulated() {
  ForEachStat(*this, [](Stat& s) { s.ResetAccumulated(); });
  num_alloc_retries = num_ooms = num_sync_all_streams = num_device_alloc = num_device_free = 0;
}

void DeviceStats::ResetPeak() {
  ForEachStat(*this, [](Stat& s) { s.ResetPeak(); });
}

std::map<std::string, int64_t> FlattenStats(const DeviceStats& s, size_t max_split_size) {
  std::map<std::string, int64_t> out;
  const auto add = [&out](const std::string& prefix, const Stat& stat) {
    out[prefix + "current"] = stat.current;
    out[prefix + "peak"] = stat.peak;
    out[prefix + "allocated"] = stat.allocated;
    out[prefix + "freed"] = stat.freed;
  };
  static constexpr std::array<std::string_view, 3> kPools = {"all", "small_pool", "large_pool"};
  const std::pair<std::string_view, const StatArray*> arrays[] = {
      {"allocation", &s.allocation},
      {"segment", &s.segment},
      {"active", &s.active},
      {"inactive_split", &s.inactive_split},
      {"allocated_bytes", &s.allocated_bytes},
      {"reserved_bytes", &s.reserved_bytes},
      {"active_bytes", &s.active_bytes},
      {"inactive_split_bytes", &s.inactive_split_bytes},
      {"requested_bytes", &s.requested_bytes},
  };
  for (const auto& [name, array] : arrays) {
    for (size_t i = 0; i < kPools.size(); ++i) {
      add(std::string(name) + "." + std::string(kPools[i]) + ".", array->by_pool[i]);
    }
  }
  add("oversize_allocations.", s.oversize_allocations);
  add("oversize_segments.", s.oversize_segments);
  // SIZE_MAX wraps to -1, which is what PyTorch reports for "no limit".
  out["max_split_size"] = static_cast<int64_t>(max_split_size);
  out["num_alloc_retries"] = s.num_alloc_retries;
  out["num_ooms"] = s.num_ooms;
  out["num_sync_all_streams"] = s.num_sync_all_streams;
  out["num_device_alloc"] = s.num_device_alloc;
  out["num_device_free"] = s.num_device_free;
  out["spillway.quarantined_blocks"] = s.quarantined_blocks;
  out["spillway.quarantined_bytes"] = s.quarantined_bytes;
  return out;
}

}  // namespace spillway
