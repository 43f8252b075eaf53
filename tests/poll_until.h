// Waiting in tests for something another thread or a simulated stream is to do, without timing
// it: the one poll loop every test shares.
#pragma once

#include <chrono>
#include <thread>

namespace spillway::testing {

// How long a poll waits for what a test expects before giving up on it: long enough for the
// slowest sanitizer build under load, short enough that a test gone wrong fails instead of
// hanging CI.
inline constexpr std::chrono::milliseconds kPollLimit = std::chrono::seconds(20);

// Calls `done` every millisecond until it returns true (then true) or `limit` has passed (then
// false). `done` may act as well as look, as a test that polls like the allocator does.
template <typename Done>
bool PollUntil(Done done, std::chrono::milliseconds limit = kPollLimit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace spillway::testing
