#include "allocator/config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "allocator/backend_factory.h"
#include "allocator/sim_backend.h"

namespace spillway {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

using Divisions = std::array<size_t, kRoundupPower2Intervals>;

// The error's message, for substring checks; empty when the parse unexpectedly succeeded.
template <typename T>
std::string ErrorOf(const absl::StatusOr<T>& result) {
  return result.ok() ? std::string() : std::string(result.status().message());
}

::testing::AssertionResult Contains(const std::string& text, std::string_view part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

// Expects `text` to be rejected with InvalidArgument and a message containing every part.
void ExpectRejected(std::string_view text, const std::vector<std::string_view>& parts) {
  SCOPED_TRACE(std::string(text));
  const absl::StatusOr<Config> result = ParseConfig(text);
  ASSERT_FALSE(result.ok()) << "accepted";
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  for (std::string_view part : parts) EXPECT_TRUE(Contains(ErrorOf(result), part));
}

Config ParseOk(std::string_view text) {
  absl::StatusOr<Config> result = ParseConfig(text);
  EXPECT_TRUE(result.ok()) << text << ": " << result.status();
  return result.ok() ? *result : Config{};
}

Divisions ParseDivisionsOk(std::string_view value) {
  return ParseOk("roundup_power2_divisions:" + std::string(value))
      .allocator.roundup_power2_divisions;
}

void ExpectDefaults(const Config& config) {
  const Config defaults;
  EXPECT_EQ(config.allocator.max_split_size, defaults.allocator.max_split_size);
  EXPECT_EQ(config.allocator.roundup_power2_divisions, Divisions{});
  EXPECT_EQ(config.allocator.garbage_collection_threshold, 0.0);
  EXPECT_EQ(config.allocator.per_process_memory_fraction, 0.0);
  EXPECT_EQ(config.allocator.memory_limit_bytes, 0u);
  EXPECT_EQ(config.allocator.history_entries, 100000u);
  EXPECT_EQ(config.offload.policy, OffloadPolicy::kAuto);
  EXPECT_EQ(config.offload.budget_bytes, 0u);
  EXPECT_EQ(config.offload.budget_fraction, 0.8);
  EXPECT_EQ(config.offload.min_bytes, kMiB);
  EXPECT_EQ(config.offload.prefetch_bytes, std::nullopt);  // adaptive
  EXPECT_EQ(config.offload.host_limit_bytes, 0u);
  EXPECT_EQ(config.device, DeviceKind::kCuda);
  EXPECT_EQ(config.sim_capacity_bytes, size_t{1} << 30);
  EXPECT_EQ(config.sim_devices, 1);
  EXPECT_FALSE(config.backend_spillway);
}

TEST(ConfigTest, EmptyAndBlankStringsGiveDefaults) {
  ExpectDefaults(ParseOk(""));
  ExpectDefaults(ParseOk("   \t "));
}

TEST(ConfigTest, MaxSplitSize) {
  EXPECT_EQ(ParseOk("max_split_size_mb:20").allocator.max_split_size, 20 * kMiB);
  EXPECT_EQ(ParseOk("max_split_size_mb:1024").allocator.max_split_size, size_t{1} << 30);
  ExpectRejected("max_split_size_mb:19", {"'19'", "'max_split_size_mb'", ">= 20"});
  ExpectRejected("max_split_size_mb:0", {"'max_split_size_mb'", ">= 20"});
}

TEST(ConfigTest, IntegerOverflowIsTooLarge) {
  // Does not fit in 64 bits at all.
  ExpectRejected("max_split_size_mb:99999999999999999999", {"'max_split_size_mb'", "too large"});
  // Fits in 64 bits as MiB but not as bytes (2^44 MiB = 2^64 bytes).
  ExpectRejected("max_split_size_mb:17592186044416", {"too large"});
  ExpectRejected("offload_min_kb:18014398509481984", {"'offload_min_kb'", "too large"});
  ExpectRejected("history_entries:99999999999999999999", {"too large"});
  // The largest MiB count that still fits is accepted.
  EXPECT_EQ(ParseOk("memory_limit_mb:17592186044415").allocator.memory_limit_bytes,
            size_t{17592186044415} << 20);
}

TEST(ConfigTest, IntegersAreDecimalDigitsOnly) {
  for (std::string_view value : {"-5", "+5", "0x10", "1 0", "1.5", "1e3", "", "abc", "12abc"}) {
    ExpectRejected("memory_limit_mb:" + std::string(value),
                   {"bad value '" + std::string(value) + "'", "'memory_limit_mb'",
                    "non-negative integer (MiB"});
  }
}

TEST(ConfigTest, BadIntegerMessageIsExact) {
  const absl::StatusOr<Config> result = ParseConfig("offload_min_kb:abc");
  EXPECT_EQ(ErrorOf(result),
            "bad value 'abc' for key 'offload_min_kb': expected a non-negative integer (KiB)");
}

TEST(ConfigTest, RoundupDivisionsSingleValue) {
  Divisions fours;
  fours.fill(4);
  EXPECT_EQ(ParseDivisionsOk("4"), fours);
  Divisions ones;
  ones.fill(1);
  EXPECT_EQ(ParseDivisionsOk("1"), ones);
  EXPECT_EQ(ParseDivisionsOk("0"), Divisions{});
  for (std::string_view value : {"3", "6", "-4", "0x4", "4.0", "99999999999999999999"}) {
    ExpectRejected("roundup_power2_divisions:" + std::string(value),
                   {"'roundup_power2_divisions'", "power of two"});
  }
}

TEST(ConfigTest, RoundupDivisionsPytorchExampleList) {
  // 256 MiB is interval 8; the first entry also covers intervals 0..7; `>` starts after 1024's.
  const Divisions expected = {1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8};
  EXPECT_EQ(ParseDivisionsOk("[256:1,512:2,1024:4,>:8]"), expected);
}

TEST(ConfigTest, RoundupDivisionsFillForwardBetweenEntries) {
  // 1 MiB -> interval 0, 64 MiB -> interval 6; without `>` the last entry runs to the end.
  const Divisions expected = {2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4};
  EXPECT_EQ(ParseDivisionsOk("[1:2,64:4]"), expected);
}

TEST(ConfigTest, RoundupDivisionsRestOnlyAndClamping) {
  Divisions sixteens;
  sixteens.fill(16);
  EXPECT_EQ(ParseDivisionsOk("[>:16]"), sixteens);
  // Sizes past 32 GiB clamp to the last interval, as in PyTorch.
  Divisions clamped;
  clamped.fill(1);
  clamped[15] = 8;
  EXPECT_EQ(ParseDivisionsOk("[1:1,65536:8]"), clamped);
  // `>` after the last interval changes nothing.
  Divisions twos;
  twos.fill(2);
  EXPECT_EQ(ParseDivisionsOk("[32768:2,>:8]"), twos);
}

TEST(ConfigTest, RoundupDivisionsListErrors) {
  const std::string key = "roundup_power2_divisions:";
  ExpectRejected(key + "[256:3]", {"entry 1 '256:3'", "divisions must be 0 or a power of two"});
  ExpectRejected(key + "[300:2]", {"entry 1 '300:2'", "size must be a power of two"});
  ExpectRejected(key + "[0:2]", {"size must be a power of two"});
  ExpectRejected(key + "[512:2,256:1]", {"entry 2 '256:1'", "sizes must increase"});
  ExpectRejected(key + "[256:2,256:4]", {"sizes must increase"});
  ExpectRejected(key + "[>:8,256:1]", {"entry 2", "'>' must be the last entry"});
  ExpectRejected(key + "[256]", {"expected size:divisions"});
  ExpectRejected(key + "[256:1,]", {"entry 2"});
  ExpectRejected(key + "[]", {"'roundup_power2_divisions'"});
  ExpectRejected(key + "[256:x]", {"divisions must be a non-negative integer"});
  ExpectRejected(key + "[1:2]x[3:4]", {"'roundup_power2_divisions'"});
}

TEST(ConfigTest, RepeatedDivisionsReplaceTheWholeTable) {
  const Divisions expected = {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2};
  EXPECT_EQ(ParseOk("roundup_power2_divisions:[1:1,1024:8],roundup_power2_divisions:2")
                .allocator.roundup_power2_divisions,
            expected);
}

TEST(ConfigTest, Fractions) {
  const Config config = ParseOk(
      "garbage_collection_threshold:0.6,per_process_memory_fraction:1,"
      "offload_budget_fraction:.25");
  EXPECT_DOUBLE_EQ(config.allocator.garbage_collection_threshold, 0.6);
  EXPECT_DOUBLE_EQ(config.allocator.per_process_memory_fraction, 1.0);
  EXPECT_DOUBLE_EQ(config.offload.budget_fraction, 0.25);
  EXPECT_DOUBLE_EQ(
      ParseOk("per_process_memory_fraction:5e-1").allocator.per_process_memory_fraction, 0.5);
}

TEST(ConfigTest, GarbageCollectionThresholdIsOpenInterval) {
  for (std::string_view value :
       {"0", "1", "1.0", "1.5", "-0.5", "nan", "inf", "-inf", "0.5x", "", "0x0.8", "1e400", " "}) {
    ExpectRejected("garbage_collection_threshold:" + std::string(value),
                   {"'garbage_collection_threshold'", "strictly between 0 and 1"});
  }
}

TEST(ConfigTest, FractionsUpToOneRejectOutOfRange) {
  for (std::string_view key : {"per_process_memory_fraction", "offload_budget_fraction"}) {
    for (std::string_view value : {"0", "1.01", "nan", "0.5.5", "50%"}) {
      // Appended, not "'" + std::string(key): GCC 12 warns (-Wrestrict) on that, wrongly.
      std::string quoted = "'";
      quoted.append(key).append("'");
      ExpectRejected(std::string(key) + ":" + std::string(value), {quoted, "in (0, 1]"});
    }
  }
}

TEST(ConfigTest, EverySpillwayKeyHappyPath) {
  const Config config = ParseOk(
      "backend:spillway,device:sim,capacity_mb:2048,sim_devices:16,sim_jitter_us:250,"
      "sim_link_mb_per_s:10000000,memory_limit_mb:512,history_entries:10000000,offload:eager,"
      "offload_budget_mb:300,offload_budget_fraction:0.5,offload_min_kb:64,prefetch_mb:0,"
      "host_limit_mb:4096");
  EXPECT_TRUE(config.backend_spillway);
  EXPECT_EQ(config.device, DeviceKind::kSim);
  EXPECT_EQ(config.sim_capacity_bytes, 2048 * kMiB);
  EXPECT_EQ(config.sim_devices, 16);
  EXPECT_EQ(config.sim_max_jitter, std::chrono::microseconds(250));
  EXPECT_EQ(config.sim_link_bytes_per_second, 10'000'000 * kMiB);
  EXPECT_EQ(config.allocator.memory_limit_bytes, 512 * kMiB);
  EXPECT_EQ(config.allocator.history_entries, 10000000u);
  EXPECT_EQ(config.offload.policy, OffloadPolicy::kEager);
  EXPECT_EQ(config.offload.budget_bytes, 300 * kMiB);
  EXPECT_DOUBLE_EQ(config.offload.budget_fraction, 0.5);
  EXPECT_EQ(config.offload.min_bytes, 64u * 1024);
  EXPECT_EQ(config.offload.prefetch_bytes, 0u);
  EXPECT_EQ(config.offload.host_limit_bytes, 4096 * kMiB);

  EXPECT_EQ(ParseOk("device:cuda,offload:off").offload.policy, OffloadPolicy::kOff);
  EXPECT_EQ(ParseOk("offload:auto").offload.policy, OffloadPolicy::kAuto);
  EXPECT_EQ(ParseOk("memory_limit_mb:0,offload_min_kb:0").offload.min_bytes, 0u);
}

TEST(ConfigTest, IntegerRanges) {
  ExpectRejected("sim_devices:0", {"'sim_devices'", "from 1 to 16"});
  ExpectRejected("sim_devices:17", {"'sim_devices'", "from 1 to 16"});
  ExpectRejected("sim_jitter_us:-1", {"'sim_jitter_us'", "from 0 to 1000000"});
  ExpectRejected("sim_jitter_us:1000001", {"'sim_jitter_us'", "from 0 to 1000000"});
  ExpectRejected("sim_link_mb_per_s:-1", {"'sim_link_mb_per_s'", "from 0 to 10000000 (MiB/s"});
  ExpectRejected("sim_link_mb_per_s:10000001", {"'sim_link_mb_per_s'", "0 = unlimited"});
  ExpectRejected("sim_link_mb_per_s:1.5", {"'sim_link_mb_per_s'", "from 0 to 10000000"});
  ExpectRejected("history_entries:0", {"'history_entries'", "from 1 to 10000000"});
  ExpectRejected("history_entries:10000001", {"from 1 to 10000000"});
  ExpectRejected("capacity_mb:0", {"'capacity_mb'", "positive integer (MiB)"});
  ExpectRejected("offload_budget_mb:0", {"'offload_budget_mb'", "positive integer (MiB)"});
  ExpectRejected("prefetch_mb:-1", {"'prefetch_mb'", "non-negative integer (MiB)"});
  ExpectRejected("host_limit_mb:1k", {"'host_limit_mb'"});
}

TEST(ConfigTest, ChoiceErrorsListTheChoices) {
  EXPECT_EQ(ErrorOf(ParseConfig("offload:fast")),
            "bad value 'fast' for key 'offload': expected one of off, eager, auto");
  ExpectRejected("offload:Eager", {"one of off, eager, auto"});
  ExpectRejected("device:gpu", {"'gpu'", "'device'", "one of cuda, sim"});
}

TEST(ConfigTest, BackendOnlyTakesSpillway) {
  for (std::string_view value : {"native", "cudaMallocAsync", "Spillway", ""}) {
    ExpectRejected("backend:" + std::string(value),
                   {"'backend'", "only takes backend:spillway", "chosen by PyTorch"});
  }
}

TEST(ConfigTest, UnknownKeyNamesKeyAndListsAcceptedKeys) {
  const std::string error = ErrorOf(ParseConfig("max_split_size:5"));
  EXPECT_TRUE(Contains(error,
                       "unknown key 'max_split_size' in allocator config "
                       "\"max_split_size:5\"; accepted keys: max_split_size_mb, "
                       "roundup_power2_divisions, "));
  for (const auto* keys : {&PytorchKeys(), &SpillwayKeys()}) {
    for (std::string_view key : *keys) EXPECT_TRUE(Contains(error, key));
  }
  // Keys are case-sensitive, and PyTorch-only keys are not Spillway's.
  ExpectRejected("Max_Split_Size_MB:64", {"unknown key 'Max_Split_Size_MB'"});
  ExpectRejected("max_split_size_md:64",
                 {"unknown key 'max_split_size_md'", "(did you mean 'max_split_size_mb'?)"});
  ExpectRejected("expandable_segments:True", {"unknown key 'expandable_segments'"});
}

TEST(ConfigTest, KeyListsAreDisjointAndComplete) {
  EXPECT_EQ(PytorchKeys(), (std::vector<std::string_view>{
                               "max_split_size_mb", "roundup_power2_divisions",
                               "garbage_collection_threshold", "per_process_memory_fraction"}));
  EXPECT_EQ(SpillwayKeys().size(), 14u);
  EXPECT_EQ(SpillwayKeys().front(), "backend");
  for (std::string_view key : SpillwayKeys()) {
    EXPECT_EQ(std::find(PytorchKeys().begin(), PytorchKeys().end(), key), PytorchKeys().end())
        << key;
  }
}

TEST(ConfigTest, WhitespaceAroundTokensIsTolerated) {
  const Config config = ParseOk(
      "  max_split_size_mb : 64 ,\toffload:  eager\t, roundup_power2_divisions : [ 256 : 1 , > : 8 "
      "] ");
  EXPECT_EQ(config.allocator.max_split_size, 64 * kMiB);
  EXPECT_EQ(config.offload.policy, OffloadPolicy::kEager);
  EXPECT_EQ(config.allocator.roundup_power2_divisions[8], 1u);
  EXPECT_EQ(config.allocator.roundup_power2_divisions[9], 8u);
  // Whitespace inside a number is not "around" a token.
  ExpectRejected("max_split_size_mb:6 4", {"'6 4'"});
}

TEST(ConfigTest, RepeatedKeyLastWins) {
  const Config config = ParseOk("offload:off,max_split_size_mb:64,offload:eager");
  EXPECT_EQ(config.offload.policy, OffloadPolicy::kEager);
  EXPECT_EQ(ParseOk("max_split_size_mb:64,max_split_size_mb:32").allocator.max_split_size,
            32 * kMiB);
}

TEST(ConfigTest, BaseConfigIsCarriedThrough) {
  Config base;
  base.device = DeviceKind::kSim;
  base.sim_devices = 4;
  base.offload.policy = OffloadPolicy::kOff;
  base.allocator.max_split_size = 100 * kMiB;
  base.allocator.roundup_power2_divisions.fill(2);

  const absl::StatusOr<Config> result = ParseConfig("max_split_size_mb:32", base);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->allocator.max_split_size, 32 * kMiB);
  EXPECT_EQ(result->device, DeviceKind::kSim);
  EXPECT_EQ(result->sim_devices, 4);
  EXPECT_EQ(result->offload.policy, OffloadPolicy::kOff);
  EXPECT_EQ(result->allocator.roundup_power2_divisions[15], 2u);

  const absl::StatusOr<Config> unchanged = ParseConfig("", base);
  ASSERT_TRUE(unchanged.ok());
  EXPECT_EQ(unchanged->allocator.max_split_size, 100 * kMiB);
}

TEST(ConfigTest, MalformedItemsNameItemAndPosition) {
  ExpectRejected("offload:eager,max_split_size_mb",
                 {"malformed item 2 'max_split_size_mb'", "expected key:value"});
  ExpectRejected(":5", {"malformed item 1 ':5'", "empty key"});
  ExpectRejected("offload:eager,,prefetch_mb:1", {"malformed item 2", "empty item"});
  ExpectRejected(",offload:eager", {"malformed item 1", "empty item"});
  ExpectRejected("roundup_power2_divisions:[256:1,>:8",
                 {"malformed item 1 'roundup_power2_divisions:[256:1,>:8'", "never closed"});
  ExpectRejected("offload:eager,roundup_power2_divisions:256:1]",
                 {"malformed item 2", "unbalanced ']'"});
  ExpectRejected("roundup_power2_divisions:[[256:1]]", {"malformed item 1", "nested '['"});
  ExpectRejected("prefetch_mb:1,x]:[", {"malformed item 2", "unbalanced ']'"});
}

TEST(ConfigTest, TrailingCommaAcceptedLikePytorch) {
  EXPECT_EQ(ParseOk("offload:eager,").offload.policy, OffloadPolicy::kEager);
  ExpectRejected(",", {"empty item"});
}

TEST(ConfigTest, CommasInsideBracketsDoNotSplitItems) {
  const Config config = ParseOk("roundup_power2_divisions:[1:1,2:2,4:4],prefetch_mb:8");
  EXPECT_EQ(config.allocator.roundup_power2_divisions[0], 1u);
  EXPECT_EQ(config.allocator.roundup_power2_divisions[1], 2u);
  EXPECT_EQ(config.allocator.roundup_power2_divisions[15], 4u);
  EXPECT_EQ(config.offload.prefetch_bytes, 8 * kMiB);
}

class ConfigEnvironmentTest : public ::testing::Test {
 protected:
  static constexpr char kVariable[] = "SPILLWAY_ALLOC_CONF";

  void SetUp() override {
    if (const char* value = std::getenv(kVariable)) saved_ = value;
  }
  void TearDown() override {
    if (saved_) {
      setenv(kVariable, saved_->c_str(), 1);
    } else {
      unsetenv(kVariable);
    }
  }

 private:
  std::optional<std::string> saved_;
};

TEST_F(ConfigEnvironmentTest, UnsetOrEmptyGivesDefaults) {
  unsetenv(kVariable);
  absl::StatusOr<Config> config = ConfigFromEnvironment();
  ASSERT_TRUE(config.ok()) << config.status();
  ExpectDefaults(*config);

  setenv(kVariable, "", 1);
  config = ConfigFromEnvironment();
  ASSERT_TRUE(config.ok()) << config.status();
  ExpectDefaults(*config);
}

TEST_F(ConfigEnvironmentTest, ReadsTheVariable) {
  setenv(kVariable, "device:sim,sim_devices:2,offload:off", 1);
  const absl::StatusOr<Config> config = ConfigFromEnvironment();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->device, DeviceKind::kSim);
  EXPECT_EQ(config->sim_devices, 2);
  EXPECT_EQ(config->offload.policy, OffloadPolicy::kOff);
}

TEST_F(ConfigEnvironmentTest, ErrorsArePrefixedWithTheVariableName) {
  setenv(kVariable, "offload:fast", 1);
  const absl::StatusOr<Config> config = ConfigFromEnvironment();
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrorOf(config),
            "SPILLWAY_ALLOC_CONF: bad value 'fast' for key 'offload': expected one of off, eager, "
            "auto");
}

SplitConfig SplitOk(std::string_view text) {
  absl::StatusOr<SplitConfig> split = SplitPytorchConfig(text);
  EXPECT_TRUE(split.ok()) << text << ": " << split.status();
  return split.ok() ? *split : SplitConfig{};
}

TEST(SplitPytorchConfigTest, MixedStringKeepsItemTextAndOrder) {
  const SplitConfig split = SplitOk(
      "expandable_segments:True, backend:spillway ,max_split_size_mb:128,offload : eager,"
      "roundup_power2_divisions:[256:1, >:4],pinned_num_register_threads:8");
  EXPECT_EQ(split.spillway_only, "backend:spillway,offload : eager");
  EXPECT_EQ(split.pytorch,
            "expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:[256:1, >:4],"
            "pinned_num_register_threads:8");
}

// A key a letter or two away from a Spillway key, in a string PyTorch may never read (on the
// simulated device), is an error with a hint; PyTorch's own keys, known to Spillway or not, stay.
TEST(SplitPytorchConfigTest, MisspelledSpillwayKeyIsRejectedWithAHint) {
  const absl::StatusOr<SplitConfig> split =
      SplitPytorchConfig("backend:spillway,device:sim,ofload:eager");
  ASSERT_FALSE(split.ok());
  EXPECT_NE(split.status().message().find("unknown key 'ofload'"), std::string::npos)
      << split.status().message();
  EXPECT_NE(split.status().message().find("(did you mean 'offload'?)"), std::string::npos)
      << split.status().message();
  const SplitConfig kept = SplitOk(
      "backend:spillway,expandable_segments:True,pinned_use_cuda_host_register:True,"
      "max_non_split_rounding_mb:4,release_lock_on_cudamalloc:True,backend:native");
  EXPECT_EQ(kept.pytorch,
            "expandable_segments:True,pinned_use_cuda_host_register:True,"
            "max_non_split_rounding_mb:4,release_lock_on_cudamalloc:True,backend:native");
}

TEST(SplitPytorchConfigTest, OnlyPytorchItems) {
  const SplitConfig split = SplitOk("backend:cudaMallocAsync,expandable_segments:True");
  EXPECT_EQ(split.spillway_only, "");
  EXPECT_EQ(split.pytorch, "backend:cudaMallocAsync,expandable_segments:True");
  // PyTorch keys Spillway does not know, with values Spillway could not parse, pass untouched.
  EXPECT_EQ(SplitOk("some_future_key:[a:b,c:d]").pytorch, "some_future_key:[a:b,c:d]");
}

TEST(SplitPytorchConfigTest, OnlySpillwayItems) {
  const SplitConfig split = SplitOk("backend:spillway,device:sim,capacity_mb:64,");
  EXPECT_EQ(split.spillway_only, "backend:spillway,device:sim,capacity_mb:64");
  EXPECT_EQ(split.pytorch, "");
  // What Split hands Spillway parses back to the same settings.
  const Config config = ParseOk(split.spillway_only);
  EXPECT_TRUE(config.backend_spillway);
  EXPECT_EQ(config.sim_capacity_bytes, 64 * kMiB);
}

TEST(SplitPytorchConfigTest, EmptyString) {
  const SplitConfig split = SplitOk("");
  EXPECT_EQ(split.spillway_only, "");
  EXPECT_EQ(split.pytorch, "");
}

TEST(SplitPytorchConfigTest, BadSpillwayValueIsAnError) {
  const absl::StatusOr<SplitConfig> split =
      SplitPytorchConfig("expandable_segments:True,offload:fast");
  ASSERT_FALSE(split.ok());
  EXPECT_EQ(split.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrorOf(split), "bad value 'fast' for key 'offload': expected one of off, eager, auto");
  EXPECT_FALSE(SplitPytorchConfig("sim_devices:99").ok());
}

TEST(SplitPytorchConfigTest, MalformedStringIsAnError) {
  EXPECT_TRUE(Contains(ErrorOf(SplitPytorchConfig("expandable_segments:True,roundup:[1:2")),
                       "malformed item 2"));
}

// What `validate` says of a default configuration after `change`: a refusal, whose message it is.
template <typename SomeConfig>
std::string RefusalOf(absl::Status (*validate)(const SomeConfig&),
                      const std::function<void(SomeConfig&)>& change) {
  SomeConfig config;
  change(config);
  const absl::Status status = validate(config);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  return std::string(status.message());
}

// Configurations built in code go through the checks the parser makes on strings.
TEST(ValidateConfigTest, DefaultsAndEveryParsedConfigAreValid) {
  EXPECT_TRUE(ValidateAllocatorConfig(AllocatorConfig{}).ok());
  EXPECT_TRUE(ValidateOffloadConfig(OffloadConfig{}).ok());
  const Config parsed = ParseOk(
      "max_split_size_mb:20,roundup_power2_divisions:[256:1,>:8],garbage_collection_threshold:0.9,"
      "per_process_memory_fraction:1,history_entries:1,offload_budget_fraction:1,"
      "offload_min_kb:0,prefetch_mb:0,host_limit_mb:0,offload:off");
  EXPECT_TRUE(ValidateAllocatorConfig(parsed.allocator).ok());
  EXPECT_TRUE(ValidateOffloadConfig(parsed.offload).ok());
}

TEST(ValidateConfigTest, AllocatorFieldsOutOfRangeAreNamed) {
  const auto error_of = [](const std::function<void(AllocatorConfig&)>& change) {
    return RefusalOf(ValidateAllocatorConfig, change);
  };
  EXPECT_EQ(error_of([](AllocatorConfig& c) { c.max_split_size = 2 * kMiB; }),
            "bad AllocatorConfig.max_split_size = 2097152 bytes: expected more than 2097152 bytes "
            "(2 MiB, a small-pool segment), or SIZE_MAX for no limit");
  EXPECT_TRUE(Contains(error_of([](AllocatorConfig& c) { c.roundup_power2_divisions[3] = 3; }),
                       "roundup_power2_divisions[3] = 3: expected 0 or a power of two"));
  EXPECT_TRUE(Contains(error_of([](AllocatorConfig& c) { c.garbage_collection_threshold = 1; }),
                       "garbage_collection_threshold = 1: expected a number in [0, 1)"));
  EXPECT_TRUE(Contains(error_of([](AllocatorConfig& c) {
                         c.per_process_memory_fraction = std::numeric_limits<double>::quiet_NaN();
                       }),
                       "per_process_memory_fraction = nan: expected a number in [0, 1]"));
  EXPECT_TRUE(
      Contains(error_of([](AllocatorConfig& c) { c.history_entries = 0; }), "history_entries = 0"));
  // Below the parser's 20 MiB floor but above a small segment: code may ask for it.
  AllocatorConfig small_split;
  small_split.max_split_size = 2 * kMiB + 512;
  EXPECT_TRUE(ValidateAllocatorConfig(small_split).ok());
}

TEST(ValidateConfigTest, OffloadFieldsOutOfRangeAreNamed) {
  const auto error_of = [](const std::function<void(OffloadConfig&)>& change) {
    return RefusalOf(ValidateOffloadConfig, change);
  };
  EXPECT_EQ(error_of([](OffloadConfig& c) { c.budget_fraction = 0; }),
            "bad OffloadConfig.budget_fraction = 0: expected a number in (0, 1]");
  EXPECT_TRUE(Contains(error_of([](OffloadConfig& c) { c.budget_fraction = 1.5; }),
                       "budget_fraction = 1.5"));
  EXPECT_TRUE(Contains(error_of([](OffloadConfig& c) { c.policy = static_cast<OffloadPolicy>(7); }),
                       "policy = 7: expected kOff, kEager or kAuto"));
  EXPECT_TRUE(
      Contains(error_of([](OffloadConfig& c) { c.prefetch_bytes = SIZE_MAX; }), "prefetch_bytes"));
  EXPECT_TRUE(Contains(error_of([](OffloadConfig& c) { c.host_limit_bytes = SIZE_MAX; }),
                       "host_limit_bytes"));
}

TEST(OffloadPolicyNameTest, NamesMatchConfigValues) {
  for (OffloadPolicy policy : {OffloadPolicy::kOff, OffloadPolicy::kEager, OffloadPolicy::kAuto}) {
    const std::string name(OffloadPolicyName(policy));
    EXPECT_EQ(ParseOk("offload:" + name).offload.policy, policy) << name;
  }
  EXPECT_EQ(OffloadPolicyName(OffloadPolicy::kEager), "eager");
}

TEST(ConfigTest, TheSimulatedDeviceTakesItsSettings) {
  const std::shared_ptr<Backend> backend =
      MakeBackend(ParseOk("device:sim,capacity_mb:64,sim_devices:2,sim_jitter_us:250,"
                          "sim_link_mb_per_s:3000"));
  const auto* sim = dynamic_cast<const SimBackend*>(backend.get());
  ASSERT_NE(sim, nullptr);
  EXPECT_EQ(sim->options().capacity_bytes, 64 * kMiB);
  EXPECT_EQ(sim->options().devices, 2);
  EXPECT_EQ(sim->options().max_jitter, std::chrono::microseconds(250));
  EXPECT_EQ(sim->options().link_bytes_per_second, 3000 * kMiB);
  // Unlimited unless asked for: copies take what a memcpy takes.
  EXPECT_EQ(dynamic_cast<const SimBackend&>(*MakeBackend(ParseOk("device:sim")))
                .options()
                .link_bytes_per_second,
            0u);
}

}  // namespace
}  // namespace spillway
