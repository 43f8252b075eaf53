// Spillway's configuration and its one parser.
//
// The grammar is PyTorch's `PYTORCH_CUDA_ALLOC_CONF`: `key:value,key:value`, lists in brackets
// (`roundup_power2_divisions:[256:1,512:2,>:8]`). The same string can travel in
// `SPILLWAY_ALLOC_CONF` or inside PyTorch's own variable next to `backend:spillway`. Unknown keys
// and bad values are errors that name the key and list what is accepted.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace spillway {

// Number of power-of-two intervals `roundup_power2_divisions` distinguishes (1 MiB ... 32 GiB+),
// as in PyTorch.
inline constexpr size_t kRoundupPower2Intervals = 16;

struct AllocatorConfig {
  // Blocks at least this large are never split (PyTorch `max_split_size_mb`). Unlimited by default.
  size_t max_split_size = std::numeric_limits<size_t>::max();
  // Per power-of-two interval (index 0: sizes < 2 MiB, ..., 15: >= 32 GiB): round requests up to
  // one of this many divisions of the interval. 0 or 1 = plain 512-byte rounding.
  //
  // `roundup_power2_divisions:N` (N = 0 or a power of two) sets every interval to N. The list form
  // `[256:1,512:2,1024:4,>:8]` maps sizes in MiB to divisions: a size S (a power of two, in
  // increasing order) names interval log2(S), clamped to 15 (1 -> 0, 256 -> 8); the first entry
  // also covers every interval below it, and each entry applies to the intervals after it up to
  // the next listed one; `>` (last entry only) sets every interval after the last listed one, or
  // all of them when it is alone. The example gives 0..8 -> 1, 9 -> 2, 10 -> 4, 11..15 -> 8.
  // Differences from PyTorch's parser, which accepts the same strings: PyTorch leaves intervals
  // between two listed ones at 0 instead of filling forward, its `>` also overwrites the last
  // listed interval (so the example's `1024:4` is lost there), it accepts entries in any order,
  // and it rejects a single 0.
  std::array<size_t, kRoundupPower2Intervals> roundup_power2_divisions{};
  // In (0, 1): when a memory limit is set and reserved bytes exceed this fraction of it, cached
  // free segments are released oldest first before asking the backend for more. 0 = off.
  double garbage_collection_threshold = 0.0;
  // In (0, 1]: per-device limit as a fraction of total device memory. 0 = not set.
  double per_process_memory_fraction = 0.0;
  // Per-device limit in bytes. 0 = not set. When both limits are set the smaller wins.
  size_t memory_limit_bytes = 0;
  // Capacity of the trace ring buffer when history recording is enabled.
  size_t history_entries = 100000;

  bool operator==(const AllocatorConfig&) const = default;
};

enum class OffloadPolicy { kOff, kEager, kAuto };

struct OffloadConfig {
  OffloadPolicy policy = OffloadPolicy::kAuto;
  // Budget for allocated device bytes under `auto`: bytes if non-zero, else `budget_fraction` of
  // the device limit (the allocator's memory limit, or total device memory when none is set).
  size_t budget_bytes = 0;
  double budget_fraction = 0.8;
  // Entries smaller than this are never spilled.
  size_t min_bytes = size_t{1} << 20;
  // How many bytes backward reloads ahead of use, per device, and (`auto`) how many of the newest
  // saves it keeps resident. Unset (the default): adaptive. Backward then reloads one save ahead,
  // goes deeper each time a save it reloaded ahead is still copying when read (its latency was not
  // hidden) and shallower as reads find theirs ready, and never takes allocated bytes past the
  // highest they reached while saving (forward's peak), except for the one save ahead; `auto`
  // keeps no save resident for it. Set, a fixed window (0: no prefetch).
  std::optional<size_t> prefetch_bytes;
  // Upper bound on pinned host bytes the engine may hold. 0 = no limit.
  size_t host_limit_bytes = 0;

  bool operator==(const OffloadConfig&) const = default;
};

enum class DeviceKind { kCuda, kSim };

struct Config {
  AllocatorConfig allocator;
  OffloadConfig offload;
  DeviceKind device = DeviceKind::kCuda;
  // Simulated device only: capacity of each simulated device, and how many there are.
  size_t sim_capacity_bytes = size_t{1} << 30;
  int sim_devices = 1;
  // Simulated device only: each operation enqueued on a simulated stream first sleeps a random
  // 0..sim_max_jitter, so that copies finish late and in other orders than the host expects (a
  // loaded machine's timing, on demand). 0: none.
  std::chrono::microseconds sim_max_jitter{0};
  // Simulated device only: the bandwidth of each device's link to the host, per direction, in
  // bytes per second (allocator/sim_link.h), so that copies take the time their bytes would. 0:
  // unlimited, copies take what a memcpy takes.
  size_t sim_link_bytes_per_second = 0;
  // True when the string contained `backend:spillway`.
  bool backend_spillway = false;

  bool operator==(const Config&) const = default;
};

// Parses `text` on top of `base`: keys not named keep `base`'s values. An empty string is valid.
absl::StatusOr<Config> ParseConfig(std::string_view text, const Config& base = Config{});

// Checks a configuration built in code rather than parsed: the ranges the fields' comments give,
// unset values (0, unlimited) included. Code may go where the parser, which keeps to PyTorch's
// ranges, does not: a max_split_size under 20 MiB (above 2 MiB), any history size. Errors name
// the field, the value and what is accepted. `CachingAllocator` and `OffloadEngine` refuse what
// fails these.
absl::Status ValidateAllocatorConfig(const AllocatorConfig& config);
absl::Status ValidateOffloadConfig(const OffloadConfig& config);

// Reads `SPILLWAY_ALLOC_CONF` from the environment (unset = defaults).
absl::StatusOr<Config> ConfigFromEnvironment();

// The keys Spillway accepts, for error messages and for splitting a shared string.
const std::vector<std::string_view>& PytorchKeys();   // PyTorch keys Spillway also honours
const std::vector<std::string_view>& SpillwayKeys();  // Spillway's own keys (incl. `backend`)

// Splits a `PYTORCH_CUDA_ALLOC_CONF`-style string into the items Spillway must take out before
// PyTorch reads the variable (`spillway_only`) and those PyTorch may keep (`pytorch`). PyTorch keys
// Spillway honours stay in `pytorch`. Items keep their original text.
struct SplitConfig {
  std::string spillway_only;
  std::string pytorch;
};
absl::StatusOr<SplitConfig> SplitPytorchConfig(std::string_view text);

std::string_view OffloadPolicyName(OffloadPolicy policy);

}  // namespace spillway
