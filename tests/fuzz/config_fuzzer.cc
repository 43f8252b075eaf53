// Fuzzes the configuration parser: arbitrary bytes go to ParseConfig and SplitPytorchConfig, which
// must never crash (the sanitizers catch memory errors and undefined behaviour) and, when they
// accept a string, must produce a configuration that respects every documented range. The
// string comes from an environment variable a user typed, so no input may be trusted.
//
// Beyond the ranges, two cross-checks tie the two entry points together:
//  - a string ParseConfig accepts is also accepted by SplitPytorchConfig (both tokenize the same
//    way and the split validates only Spillway's own keys);
//  - the split loses nothing: parsing its Spillway part, then its PyTorch part on top, gives the
//    same configuration as parsing the whole string (the parts hold disjoint keys, so the order
//    in which they are applied cannot matter).
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "allocator/config.h"

namespace spillway {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;

[[noreturn]] void Fail(const char* what, int line, std::string_view input) {
  std::fprintf(stderr, "config_fuzzer: invariant violated (line %d): %s\ninput: \"%.*s\"\n", line,
               what, static_cast<int>(input.size()), input.data());
  __builtin_trap();
}

#define FUZZ_CHECK(cond)                       \
  do {                                         \
    if (!(cond)) Fail(#cond, __LINE__, input); \
  } while (0)

// The ranges config.h documents for every field ParseConfig can set. Defaults satisfy them too
// (the parser starts from Config{}), so a violation is always the parser's doing.
void CheckRanges(const Config& c, std::string_view input) {
  const AllocatorConfig& a = c.allocator;
  FUZZ_CHECK(a.max_split_size >= 20 * kMiB);
  FUZZ_CHECK(a.max_split_size == Config{}.allocator.max_split_size || a.max_split_size % kMiB == 0);
  for (const size_t d : a.roundup_power2_divisions) FUZZ_CHECK(d == 0 || std::has_single_bit(d));
  FUZZ_CHECK(std::isfinite(a.garbage_collection_threshold));
  FUZZ_CHECK(a.garbage_collection_threshold >= 0.0 && a.garbage_collection_threshold < 1.0);
  FUZZ_CHECK(std::isfinite(a.per_process_memory_fraction));
  FUZZ_CHECK(a.per_process_memory_fraction >= 0.0 && a.per_process_memory_fraction <= 1.0);
  FUZZ_CHECK(a.memory_limit_bytes % kMiB == 0);
  FUZZ_CHECK(a.history_entries >= 1 && a.history_entries <= 10'000'000);

  const OffloadConfig& o = c.offload;
  FUZZ_CHECK(o.policy == OffloadPolicy::kOff || o.policy == OffloadPolicy::kEager ||
             o.policy == OffloadPolicy::kAuto);
  FUZZ_CHECK(o.budget_bytes % kMiB == 0);
  FUZZ_CHECK(std::isfinite(o.budget_fraction));
  FUZZ_CHECK(o.budget_fraction > 0.0 && o.budget_fraction <= 1.0);
  FUZZ_CHECK(o.min_bytes % kKiB == 0);
  FUZZ_CHECK(o.prefetch_bytes.value_or(0) % kMiB == 0);
  FUZZ_CHECK(o.host_limit_bytes % kMiB == 0);
  // What the parser yields, the checks of configurations built in code accept.
  FUZZ_CHECK(ValidateAllocatorConfig(a).ok());
  FUZZ_CHECK(ValidateOffloadConfig(o).ok());

  FUZZ_CHECK(c.device == DeviceKind::kCuda || c.device == DeviceKind::kSim);
  FUZZ_CHECK(c.sim_capacity_bytes >= kMiB && c.sim_capacity_bytes % kMiB == 0);
  FUZZ_CHECK(c.sim_devices >= 1 && c.sim_devices <= 16);
}

bool SameConfig(const Config& x, const Config& y) {
  const AllocatorConfig& a = x.allocator;
  const AllocatorConfig& b = y.allocator;
  const OffloadConfig& o = x.offload;
  const OffloadConfig& p = y.offload;
  return a.max_split_size == b.max_split_size &&
         a.roundup_power2_divisions == b.roundup_power2_divisions &&
         a.garbage_collection_threshold == b.garbage_collection_threshold &&
         a.per_process_memory_fraction == b.per_process_memory_fraction &&
         a.memory_limit_bytes == b.memory_limit_bytes && a.history_entries == b.history_entries &&
         o.policy == p.policy && o.budget_bytes == p.budget_bytes &&
         o.budget_fraction == p.budget_fraction && o.min_bytes == p.min_bytes &&
         o.prefetch_bytes == p.prefetch_bytes && o.host_limit_bytes == p.host_limit_bytes &&
         x.device == y.device && x.sim_capacity_bytes == y.sim_capacity_bytes &&
         x.sim_devices == y.sim_devices && x.backend_spillway == y.backend_spillway;
}

void FuzzOne(std::string_view input) {
  const absl::StatusOr<Config> parsed = ParseConfig(input);
  // Error messages quote the input: building them must be safe for any bytes, and a rejection
  // must say something.
  if (!parsed.ok()) FUZZ_CHECK(!parsed.status().message().empty());
  if (parsed.ok()) CheckRanges(*parsed, input);

  // Parsing on top of a non-default base keeps the base's values for keys not named, and must
  // still respect every range.
  Config base;
  base.offload.policy = OffloadPolicy::kEager;
  base.sim_devices = 16;
  base.allocator.per_process_memory_fraction = 1.0;
  const absl::StatusOr<Config> layered = ParseConfig(input, base);
  FUZZ_CHECK(layered.ok() == parsed.ok());
  if (layered.ok()) CheckRanges(*layered, input);

  const absl::StatusOr<SplitConfig> split = SplitPytorchConfig(input);
  if (!split.ok()) {
    FUZZ_CHECK(!split.status().message().empty());
    FUZZ_CHECK(!parsed.ok());
    return;
  }
  // Every Spillway item was validated by the split, so its part alone must parse.
  const absl::StatusOr<Config> own = ParseConfig(split->spillway_only);
  FUZZ_CHECK(own.ok());
  if (!parsed.ok()) return;
  const absl::StatusOr<Config> whole = ParseConfig(split->pytorch, *own);
  FUZZ_CHECK(whole.ok());
  FUZZ_CHECK(SameConfig(*whole, *parsed));
}

}  // namespace
}  // namespace spillway

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  spillway::FuzzOne(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
