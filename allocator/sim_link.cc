#include "allocator/sim_link.h"

#include <algorithm>
#include <cmath>

namespace spillway {

SimLink::SimLink(int devices, uint64_t bytes_per_second)
    : bytes_per_second_(bytes_per_second),
      busy_until_(static_cast<size_t>(std::max(devices, 0)) * 2, Clock::time_point::min()) {}

SimLink::Clock::time_point SimLink::Reserve(int device, Lane lane, size_t bytes,
                                            Clock::time_point now) {
  if (bytes_per_second_ == 0) return now;
  // In double: bytes * 1e9 overflows 64 bits past 18 GB, and a nanosecond is far below what a
  // sleeping worker can resolve anyway.
  const auto duration = std::chrono::nanoseconds(static_cast<int64_t>(
      std::ceil(static_cast<double>(bytes) * 1e9 / static_cast<double>(bytes_per_second_))));
  std::lock_guard<std::mutex> lock(mu_);
  Clock::time_point& busy =
      busy_until_.at(static_cast<size_t>(device) * 2 + static_cast<size_t>(lane));
  busy = std::max(busy, now) + duration;
  return busy;
}

}  // namespace spillway
