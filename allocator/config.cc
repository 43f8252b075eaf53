#include "allocator/config.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "allocator/config_tokens.h"
#include "allocator/key_spelling.h"

namespace spillway {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kSizeMax = std::numeric_limits<size_t>::max();

using Divisions = std::array<size_t, kRoundupPower2Intervals>;
using config_tokens::Item;
using config_tokens::Join;
using config_tokens::SplitOutsideBrackets;
using config_tokens::Strip;
using config_tokens::Tokenize;

// ---------------------------------------------------------------------------------------------
// Values.
// ---------------------------------------------------------------------------------------------

absl::Status BadValue(std::string_view key, std::string_view value, std::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrFormat("bad value '%s' for key '%s': expected %s", value, key, expected));
}

absl::Status TooLarge(std::string_view key, std::string_view value, std::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrFormat("bad value '%s' for key '%s': too large; expected %s", value, key, expected));
}

enum class Decimal { kOk, kNotDecimal, kTooLarge };

// Plain decimal digits only: a sign, a hex prefix or inner spaces would all be accepted by the
// usual library parsers in some form, and silently reading "-1" as a huge size is worse than an
// error.
Decimal ParseDecimal(std::string_view text, size_t& out) {
  if (text.empty() || !std::all_of(text.begin(), text.end(), absl::ascii_isdigit)) {
    return Decimal::kNotDecimal;
  }
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, out);
  if (ec == std::errc::result_out_of_range) return Decimal::kTooLarge;
  if (ec != std::errc() || ptr != end) return Decimal::kNotDecimal;
  return Decimal::kOk;
}

// An integer key: accepted range in the key's own unit, and how many bytes one unit is.
struct IntegerRule {
  size_t min;
  size_t max;
  size_t unit;
  std::string_view expected;
};

absl::StatusOr<size_t> ParseInteger(std::string_view key, std::string_view value,
                                    const IntegerRule& rule) {
  size_t n = 0;
  switch (ParseDecimal(value, n)) {
    case Decimal::kNotDecimal:
      return BadValue(key, value, rule.expected);
    case Decimal::kTooLarge:
      return TooLarge(key, value, rule.expected);
    case Decimal::kOk:
      break;
  }
  // Converting to bytes must not wrap: a wrapped limit would silently mean something tiny.
  if (n > kSizeMax / rule.unit) return TooLarge(key, value, rule.expected);
  if (n < rule.min || n > rule.max) return BadValue(key, value, rule.expected);
  return n * rule.unit;
}

// A fraction in (0, 1), or (0, 1] when `allow_one`.
absl::StatusOr<double> ParseFraction(std::string_view key, std::string_view value, bool allow_one) {
  const std::string_view expected =
      allow_one ? "a number in (0, 1]" : "a number strictly between 0 and 1";
  if (value.empty()) return BadValue(key, value, expected);
  double d = 0;
  const char* end = value.data() + value.size();
  const auto [ptr, ec] = std::from_chars(value.data(), end, d);
  // from_chars also reads "nan" and "inf"; neither is a fraction.
  if (ec != std::errc() || ptr != end || !std::isfinite(d)) {
    return BadValue(key, value, expected);
  }
  if (d <= 0 || d > 1 || (d == 1 && !allow_one)) return BadValue(key, value, expected);
  return d;
}

template <typename T>
struct Choice {
  std::string_view name;
  T value;
};

template <typename T>
absl::StatusOr<T> ParseChoice(std::string_view key, std::string_view value,
                              std::initializer_list<Choice<T>> choices) {
  for (const Choice<T>& choice : choices) {
    if (value == choice.name) return choice.value;
  }
  std::vector<std::string_view> names;
  for (const Choice<T>& choice : choices) names.push_back(choice.name);
  return BadValue(key, value, "one of " + Join(names, ", "));
}

// ---------------------------------------------------------------------------------------------
// roundup_power2_divisions.
// ---------------------------------------------------------------------------------------------

constexpr std::string_view kDivisionsExpected =
    "0 or a power of two, or a list like [256:1,512:2,>:8] of increasing power-of-two sizes in "
    "MiB (or '>' last, for every larger interval) each mapped to 0 or a power of two";

absl::Status BadDivisionsEntry(std::string_view key, std::string_view value, size_t position,
                               std::string_view entry, std::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrFormat("bad value '%s' for key '%s': entry %d '%s': %s; expected %s", value, key,
                      position, entry, problem, kDivisionsExpected));
}

// A division count: 0 (or 1) disables power-of-two rounding for the interval.
std::optional<std::string_view> ParseDivisionCount(std::string_view text, size_t& out) {
  switch (ParseDecimal(text, out)) {
    case Decimal::kNotDecimal:
      return "divisions must be a non-negative integer";
    case Decimal::kTooLarge:
      return "divisions value is too large";
    case Decimal::kOk:
      break;
  }
  if (out != 0 && !std::has_single_bit(out)) return "divisions must be 0 or a power of two";
  return std::nullopt;
}

// A list key: a power-of-two size in MiB.
std::optional<std::string_view> ParseIntervalSize(std::string_view text, size_t& mb) {
  switch (ParseDecimal(text, mb)) {
    case Decimal::kNotDecimal:
      return "size must be a power of two in MiB, or '>'";
    case Decimal::kTooLarge:
      return "size is too large";
    case Decimal::kOk:
      break;
  }
  if (!std::has_single_bit(mb)) return "size must be a power of two in MiB, or '>'";
  return std::nullopt;
}

// The interval a list key names, the way PyTorch maps it: log2(MiB) clamped to the last interval
// (1 -> 0, 2 -> 1, 256 -> 8, >= 32768 -> 15).
size_t IntervalIndex(size_t mb) {
  return std::min<size_t>(std::countr_zero(mb), kRoundupPower2Intervals - 1);
}

// Fills the table from `value` = `[size:divisions,...,>:divisions]`; semantics are documented on
// AllocatorConfig::roundup_power2_divisions. Each entry fills from its interval to the end, and
// later (larger) entries overwrite from theirs, which gives fill-forward with a single pass.
absl::StatusOr<Divisions> ParseDivisionsList(std::string_view key, std::string_view value) {
  const std::string_view inner = value.substr(1, value.size() - 2);
  if (Strip(inner).empty()) return BadValue(key, value, kDivisionsExpected);
  Divisions table{};
  std::optional<size_t> last_index;
  size_t last_mb = 0;
  bool saw_rest = false;
  const std::vector<std::string_view> entries = SplitOutsideBrackets(inner);
  for (size_t i = 0; i < entries.size(); ++i) {
    const size_t position = i + 1;
    const std::string_view entry = Strip(entries[i]);
    const auto bad = [&](std::string_view problem) {
      return BadDivisionsEntry(key, value, position, entry, problem);
    };
    if (saw_rest) return bad("'>' must be the last entry");
    const size_t colon = entry.find(':');
    if (colon == std::string_view::npos) return bad("expected size:divisions");
    const std::string_view size_text = Strip(entry.substr(0, colon));
    size_t divisions = 0;
    if (auto problem = ParseDivisionCount(Strip(entry.substr(colon + 1)), divisions)) {
      return bad(*problem);
    }
    size_t start = 0;
    if (size_text == ">") {
      saw_rest = true;
      start = last_index ? *last_index + 1 : 0;
    } else {
      size_t mb = 0;
      if (auto problem = ParseIntervalSize(size_text, mb)) return bad(*problem);
      // Fill-forward only has a meaning when entries are in order.
      if (last_index && mb <= last_mb) return bad("sizes must increase from one entry to the next");
      const size_t index = IntervalIndex(mb);
      // The first entry also covers every smaller interval, as in PyTorch.
      start = last_index ? index : 0;
      last_index = index;
      last_mb = mb;
    }
    std::fill(table.begin() + static_cast<std::ptrdiff_t>(std::min(start, table.size())),
              table.end(), divisions);
  }
  return table;
}

absl::StatusOr<Divisions> ParseDivisions(std::string_view key, std::string_view value) {
  if (value.size() >= 2 && value.front() == '[' && value.back() == ']') {
    // One list only: "[1:2]x[3:4]" has balanced brackets but is not a list.
    if (value.substr(1, value.size() - 2).find_first_of("[]") == std::string_view::npos) {
      return ParseDivisionsList(key, value);
    }
    return BadValue(key, value, kDivisionsExpected);
  }
  size_t divisions = 0;
  switch (ParseDecimal(value, divisions)) {
    case Decimal::kNotDecimal:
      return BadValue(key, value, kDivisionsExpected);
    case Decimal::kTooLarge:
      return TooLarge(key, value, kDivisionsExpected);
    case Decimal::kOk:
      break;
  }
  if (divisions != 0 && !std::has_single_bit(divisions)) {
    return BadValue(key, value, kDivisionsExpected);
  }
  Divisions table;
  table.fill(divisions);
  return table;
}

// ---------------------------------------------------------------------------------------------
// Keys.
// ---------------------------------------------------------------------------------------------

template <typename T, typename Field>
absl::Status Assign(absl::StatusOr<T> parsed, Field& field) {
  if (!parsed.ok()) return parsed.status();
  field = static_cast<Field>(*std::move(parsed));
  return absl::OkStatus();
}

// PyTorch refuses smaller values (its kLargeBuffer, 20 MiB): blocks below it are never split
// differently, so a smaller limit would mean something PyTorch users do not expect.
constexpr IntegerRule kMaxSplitSizeRule{20, kSizeMax, kMiB, "an integer >= 20 (MiB)"};
constexpr IntegerRule kCapacityRule{1, kSizeMax, kMiB, "a positive integer (MiB)"};
constexpr IntegerRule kSimDevicesRule{1, 16, 1, "an integer from 1 to 16"};
constexpr IntegerRule kSimJitterRule{0, 1'000'000, 1,
                                     "an integer from 0 to 1000000 (microseconds)"};
constexpr IntegerRule kSimLinkRule{0, 10'000'000, kMiB,
                                   "an integer from 0 to 10000000 (MiB/s; 0 = unlimited)"};
constexpr IntegerRule kMemoryLimitRule{0, kSizeMax, kMiB,
                                       "a non-negative integer (MiB; 0 = no limit)"};
constexpr IntegerRule kHistoryRule{1, 10'000'000, 1, "an integer from 1 to 10000000"};
// The offload settings go back and forth to Python as signed 64-bit byte counts.
constexpr size_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr IntegerRule kBudgetRule{1, kInt64Max / kMiB, kMiB, "a positive integer (MiB)"};
constexpr IntegerRule kMinKbRule{0, kInt64Max / kKiB, kKiB, "a non-negative integer (KiB)"};
constexpr IntegerRule kPrefetchRule{0, kInt64Max / kMiB, kMiB, "a non-negative integer (MiB)"};
constexpr IntegerRule kHostLimitRule{0, kInt64Max / kMiB, kMiB,
                                     "a non-negative integer (MiB; 0 = no limit)"};

absl::Status SetMaxSplitSize(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseInteger(key, value, kMaxSplitSizeRule), config.allocator.max_split_size);
}

absl::Status SetRoundupDivisions(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseDivisions(key, value), config.allocator.roundup_power2_divisions);
}

absl::Status SetGcThreshold(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseFraction(key, value, /*allow_one=*/false),
                config.allocator.garbage_collection_threshold);
}

absl::Status SetMemoryFraction(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseFraction(key, value, /*allow_one=*/true),
                config.allocator.per_process_memory_fraction);
}

// PyTorch picks between its own backends before any allocator is loaded, so `native` or
// `cudaMallocAsync` reaching this parser means the string was meant for PyTorch, not Spillway.
absl::Status SetBackend(std::string_view key, std::string_view value, Config& config) {
  if (value != "spillway") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bad value '%s' for key '%s': Spillway's parser only takes backend:spillway (PyTorch's "
        "own backends, native and cudaMallocAsync, are chosen by PyTorch)",
        value, key));
  }
  config.backend_spillway = true;
  return absl::OkStatus();
}

absl::Status SetDevice(std::string_view key, std::string_view value, Config& config) {
  return Assign(
      ParseChoice<DeviceKind>(key, value, {{"cuda", DeviceKind::kCuda}, {"sim", DeviceKind::kSim}}),
      config.device);
}

absl::Status SetCapacity(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseInteger(key, value, kCapacityRule), config.sim_capacity_bytes);
}

absl::Status SetSimDevices(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseInteger(key, value, kSimDevicesRule), config.sim_devices);
}

absl::Status SetSimJitter(std::string_view key, std::string_view value, Config& config) {
  const absl::StatusOr<size_t> us = ParseInteger(key, value, kSimJitterRule);
  if (!us.ok()) return us.status();
  config.sim_max_jitter = std::chrono::microseconds(*us);
  return absl::OkStatus();
}

absl::Status SetSimLink(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseInteger(key, value, kSimLinkRule), config.sim_link_bytes_per_second);
}

absl::Status SetMemoryLimit(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseInteger(key, value, kMemoryLimitRule), config.allocator.memory_limit_bytes);
}

absl::Status SetHistoryEntries(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseInteger(key, value, kHistoryRule), config.allocator.history_entries);
}

absl::Status SetOffload(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseChoice<OffloadPolicy>(key, value,
                                           {{"off", OffloadPolicy::kOff},
                                            {"eager", OffloadPolicy::kEager},
                                            {"auto", OffloadPolicy::kAuto}}),
                config.offload.policy);
}

absl::Status SetBudget(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseInteger(key, value, kBudgetRule), config.offload.budget_bytes);
}

absl::Status SetBudgetFraction(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseFraction(key, value, /*allow_one=*/true), config.offload.budget_fraction);
}

absl::Status SetMinBytes(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseInteger(key, value, kMinKbRule), config.offload.min_bytes);
}

absl::Status SetPrefetch(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseInteger(key, value, kPrefetchRule), config.offload.prefetch_bytes);
}

absl::Status SetHostLimit(std::string_view key, std::string_view value, Config& config) {
  return Assign(ParseInteger(key, value, kHostLimitRule), config.offload.host_limit_bytes);
}

using Setter = absl::Status (*)(std::string_view key, std::string_view value, Config& config);

struct KeySpec {
  std::string_view key;
  Setter set;
};

constexpr KeySpec kPytorchSpecs[] = {
    {"max_split_size_mb", SetMaxSplitSize},
    {"roundup_power2_divisions", SetRoundupDivisions},
    {"garbage_collection_threshold", SetGcThreshold},
    {"per_process_memory_fraction", SetMemoryFraction},
};

constexpr KeySpec kSpillwaySpecs[] = {
    {"backend", SetBackend},
    {"device", SetDevice},
    {"capacity_mb", SetCapacity},
    {"sim_devices", SetSimDevices},
    {"sim_jitter_us", SetSimJitter},
    {"sim_link_mb_per_s", SetSimLink},
    {"memory_limit_mb", SetMemoryLimit},
    {"history_entries", SetHistoryEntries},
    {"offload", SetOffload},
    {"offload_budget_mb", SetBudget},
    {"offload_budget_fraction", SetBudgetFraction},
    {"offload_min_kb", SetMinBytes},
    {"prefetch_mb", SetPrefetch},
    {"host_limit_mb", SetHostLimit},
};

template <size_t N>
const KeySpec* FindIn(const KeySpec (&specs)[N], std::string_view key) {
  for (const KeySpec& spec : specs) {
    if (spec.key == key) return &spec;
  }
  return nullptr;
}

const KeySpec* FindSpec(std::string_view key) {
  if (const KeySpec* spec = FindIn(kPytorchSpecs, key)) return spec;
  return FindIn(kSpillwaySpecs, key);
}

template <size_t N>
std::vector<std::string_view> KeysOf(const KeySpec (&specs)[N]) {
  std::vector<std::string_view> keys;
  for (const KeySpec& spec : specs) keys.push_back(spec.key);
  return keys;
}

absl::Status UnknownKey(std::string_view config, std::string_view key) {
  std::vector<std::string_view> all = PytorchKeys();
  all.insert(all.end(), SpillwayKeys().begin(), SpillwayKeys().end());
  const std::optional<std::string_view> near = Misspelled(key, all);
  return absl::InvalidArgumentError(absl::StrFormat(
      "unknown key '%s' in allocator config \"%s\"%s; accepted keys: %s, %s", key, config,
      near ? absl::StrFormat(" (did you mean '%s'?)", *near) : std::string(),
      Join(PytorchKeys(), ", "), Join(SpillwayKeys(), ", ")));
}

// `backend:native` and `backend:cudaMallocAsync` are PyTorch's to act on, so a split leaves them
// for PyTorch; only `backend:spillway` is Spillway's (PyTorch would reject it).
bool BelongsToSpillway(const Item& item) {
  if (FindIn(kSpillwaySpecs, item.key) == nullptr) return false;
  return item.key != "backend" || item.value == "spillway";
}

}  // namespace

absl::StatusOr<Config> ParseConfig(std::string_view text, const Config& base) {
  absl::StatusOr<std::vector<Item>> items = Tokenize(text);
  if (!items.ok()) return items.status();
  Config config = base;
  for (const Item& item : *items) {
    const KeySpec* spec = FindSpec(item.key);
    if (spec == nullptr) return UnknownKey(text, item.key);
    if (absl::Status status = spec->set(item.key, item.value, config); !status.ok()) {
      return status;
    }
  }
  return config;
}

absl::StatusOr<Config> ConfigFromEnvironment() {
  constexpr char kVariable[] = "SPILLWAY_ALLOC_CONF";
  const char* text = std::getenv(kVariable);
  if (text == nullptr) return Config{};
  absl::StatusOr<Config> config = ParseConfig(text);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrFormat("%s: %s", kVariable, config.status().message()));
  }
  return config;
}

const std::vector<std::string_view>& PytorchKeys() {
  static const auto* const keys = new std::vector<std::string_view>(KeysOf(kPytorchSpecs));
  return *keys;
}

const std::vector<std::string_view>& SpillwayKeys() {
  static const auto* const keys = new std::vector<std::string_view>(KeysOf(kSpillwaySpecs));
  return *keys;
}

absl::StatusOr<SplitConfig> SplitPytorchConfig(std::string_view text) {
  absl::StatusOr<std::vector<Item>> items = Tokenize(text);
  if (!items.ok()) return items.status();
  std::vector<std::string_view> spillway_only;
  std::vector<std::string_view> pytorch;
  Config scratch;  // Only to validate Spillway's values now rather than when they are used.
  for (const Item& item : *items) {
    if (!BelongsToSpillway(item)) {
      // PyTorch's keys, known or not, are PyTorch's to judge; one a letter or two away from a
      // Spillway key is a misspelling that nobody would ever report (on the simulated device
      // PyTorch never reads the variable).
      if (FindSpec(item.key) == nullptr && Misspelled(item.key, SpillwayKeys()).has_value()) {
        return UnknownKey(text, item.key);
      }
      pytorch.push_back(item.text);
      continue;
    }
    const KeySpec* spec = FindIn(kSpillwaySpecs, item.key);
    if (absl::Status status = spec->set(item.key, item.value, scratch); !status.ok()) {
      return status;
    }
    spillway_only.push_back(item.text);
  }
  return SplitConfig{Join(spillway_only, ","), Join(pytorch, ",")};
}

std::string_view OffloadPolicyName(OffloadPolicy policy) {
  switch (policy) {
    case OffloadPolicy::kOff:
      return "off";
    case OffloadPolicy::kEager:
      return "eager";
    case OffloadPolicy::kAuto:
      return "auto";
  }
  return "unknown";  // Only reachable through a cast from an out-of-range integer.
}

}  // namespace spillway
