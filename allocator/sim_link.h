// The simulated device's link to the host: the time a copy's bytes take to cross it.
//
// Without it the simulated device's copies are host `memcpy`s, so fast next to CPU kernels that
// every spill looks free and no policy can be judged against a link's limit. With a bandwidth, a
// copy between host and device ends when its bytes have crossed a link of that speed, as the copy
// engines of a GPU move them over PCIe or NVLink-C2C, so the offload engine's overlap of copies
// with compute, and its stalls where the link cannot keep up, are real on the CPU too.
//
// Model: one link per device, full duplex: a host-to-device lane and a device-to-host lane, each
// moving one copy at a time at `bytes_per_second`, in the order the copies reach it. Two streams
// copying in one direction share its lane (the second waits for the first: their sum takes the
// time of their bytes, as on a bus). Device-to-device copies never cross the link. A copy whose
// lane is idle starts when it reaches the lane; an idle lane lends no credit to later copies.
//
// Invariants: a lane's schedule never goes back in time; a copy of n bytes occupies its lane for
// n / bytes_per_second; `Reserve` with bandwidth 0 (unlimited) returns `now`.
//
// Threads: `Reserve` may be called from any thread (the streams' workers). One mutex guards the
// lanes and is held only while the schedule is computed, never while a copy waits out its time.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace spillway {

class SimLink {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Lane { kHostToDevice = 0, kDeviceToHost = 1 };

  // `bytes_per_second` 0: unlimited (every copy ends when it starts).
  SimLink(int devices, uint64_t bytes_per_second);

  SimLink(const SimLink&) = delete;
  SimLink& operator=(const SimLink&) = delete;

  uint64_t bytes_per_second() const { return bytes_per_second_; }

  // Books `bytes` on `device`'s `lane` for a copy ready at `now`; returns when its last byte has
  // crossed: max(now, the lane's end of booked work) + bytes / bandwidth. `device` must be in
  // [0, devices).
  Clock::time_point Reserve(int device, Lane lane, size_t bytes, Clock::time_point now);

 private:
  const uint64_t bytes_per_second_;
  std::mutex mu_;
  // Per device, per lane: when the work booked so far ends. Guarded by `mu_`.
  std::vector<Clock::time_point> busy_until_;
};

}  // namespace spillway
