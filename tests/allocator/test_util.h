// Helpers shared by the allocator test files: sizes, a jittered simulated device, unwrapping a
// StatusOr, and byte patterns to fill and check buffers with.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <utility>

#include "absl/status/statusor.h"
#include "allocator/sim_backend.h"

namespace spillway::testing {

inline constexpr size_t kKiB = size_t{1} << 10;
inline constexpr size_t kMiB = size_t{1} << 20;

// One 64 MiB simulated device whose stream operations run after up to `jitter`, so that a read
// that skips a wait can really see stale data.
inline SimBackend::Options JitterOptions(std::chrono::microseconds jitter) {
  SimBackend::Options options;
  options.capacity_bytes = 64 * kMiB;
  options.max_jitter = jitter;
  options.seed = 1234;
  return options;
}

// Fails the current test (gtest reports the exception) instead of returning an unusable value.
template <typename T>
T Unwrap(absl::StatusOr<T> result) {
  if (!result.ok()) throw std::runtime_error("unexpected status: " + result.status().ToString());
  return std::move(*result);
}

inline uint8_t PatternByte(size_t i, uint8_t seed) { return static_cast<uint8_t>(i * 31 + seed); }

inline void FillPattern(void* data, size_t bytes, uint8_t seed) {
  auto* p = static_cast<uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) p[i] = PatternByte(i, seed);
}

// Index of the first byte that differs from the pattern, or -1.
inline int64_t FirstPatternMismatch(const void* data, size_t bytes, uint8_t seed) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    if (p[i] != PatternByte(i, seed)) return static_cast<int64_t>(i);
  }
  return -1;
}

inline bool AllBytesEqual(const void* data, size_t bytes, uint8_t value) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    if (p[i] != value) return false;
  }
  return true;
}

}  // namespace spillway::testing
