#include "allocator/size_policy.h"

#include <gtest/gtest.h>

namespace spillway {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(SizePolicy, RoundsToMultiplesOf512) {
  const SizePolicy policy{AllocatorConfig{}};
  EXPECT_EQ(policy.RoundSize(1), 512u);
  EXPECT_EQ(policy.RoundSize(512), 512u);
  EXPECT_EQ(policy.RoundSize(513), 1024u);
  EXPECT_EQ(policy.RoundSize(3 * kMiB + 1), 3 * kMiB + 512);
}

TEST(SizePolicy, PoolsAndSegmentSizesFollowPyTorch) {
  const SizePolicy policy{AllocatorConfig{}};
  EXPECT_EQ(policy.PoolFor(kMiB), PoolKind::kSmall);
  EXPECT_EQ(policy.PoolFor(kMiB + 512), PoolKind::kLarge);
  EXPECT_EQ(policy.SegmentSize(512), 2 * kMiB);
  EXPECT_EQ(policy.SegmentSize(kMiB), 2 * kMiB);
  EXPECT_EQ(policy.SegmentSize(kMiB + 512), 20 * kMiB);
  EXPECT_EQ(policy.SegmentSize(10 * kMiB - 512), 20 * kMiB);
  EXPECT_EQ(policy.SegmentSize(10 * kMiB), 10 * kMiB);
  EXPECT_EQ(policy.SegmentSize(15 * kMiB + 512), 16 * kMiB);
}

// The pinned pool's rules: one pool, segments of at least the given size, and a remainder split
// off only when it is at least max(512 B, 1/64 of the request).
TEST(SizePolicy, UniformRules) {
  const SizePolicy policy = SizePolicy::Uniform(64 * kMiB + 1);
  EXPECT_EQ(policy.RoundSize(1), 512u);
  EXPECT_EQ(policy.RoundSize(3 * kMiB + 1), 3 * kMiB + 512) << "no power-of-two rounding";
  EXPECT_EQ(policy.PoolFor(512), PoolKind::kLarge);
  EXPECT_EQ(policy.PoolFor(kMiB), PoolKind::kLarge);
  EXPECT_EQ(policy.SegmentSize(512), 64 * kMiB + 512) << "the segment size rounds to 512 B";
  EXPECT_EQ(policy.SegmentSize(100 * kMiB), 100 * kMiB);
  EXPECT_EQ(policy.SmallestSegmentSize(512), 512u);
  EXPECT_EQ(policy.FullSegmentSize(4096), 64 * kMiB + 512);
  EXPECT_EQ(policy.LeastSegmentSize(4096), 4096u);
  // 1 MiB - 8 KiB leaves 8 KiB < 15.9 KiB: kept; 1 MiB - 16 KiB leaves 16 KiB >= 15.75 KiB.
  EXPECT_FALSE(policy.ShouldSplit(PoolKind::kLarge, kMiB, kMiB - (size_t{8} << 10)));
  EXPECT_TRUE(policy.ShouldSplit(PoolKind::kLarge, kMiB, kMiB - (size_t{16} << 10)));
  EXPECT_TRUE(policy.ShouldSplit(PoolKind::kLarge, 4096, 3584)) << "512 B is always worth it";
  EXPECT_FALSE(policy.ShouldSplit(PoolKind::kLarge, 4096, 4096));
  EXPECT_TRUE(policy.AcceptsBlock(64 * kMiB, 512)) << "no oversize rules";
  // Segments below one block are none: the least is a block.
  EXPECT_EQ(SizePolicy::Uniform(0).SegmentSize(512), 512u);
}

TEST(SizePolicy, RoundupPower2Divisions) {
  AllocatorConfig config;
  config.roundup_power2_divisions.fill(4);
  const SizePolicy policy{config};
  // As in PyTorch's code, divisions apply only above 512 * divisions bytes.
  EXPECT_EQ(policy.RoundSize(1200), 1536u);
  EXPECT_EQ(policy.RoundSize(3000), 3072u);  // [2048, 4096) in steps of 512
  EXPECT_EQ(policy.RoundSize(2600), 3072u);
  EXPECT_EQ(policy.RoundSize(5 * kMiB), 5 * kMiB);
  EXPECT_EQ(policy.RoundSize(5 * kMiB + 1), 6 * kMiB);
  EXPECT_EQ(policy.RoundSize(4 * kMiB), 4 * kMiB);  // powers of two stay
}

TEST(SizePolicy, DivisionsBeyondTheSizeLeavePlainRounding) {
  AllocatorConfig config;
  config.roundup_power2_divisions.fill(2048);
  // Above 2048 * 512 bytes, in 2048 steps per power of two: [2, 4) MiB in steps of 1 KiB.
  EXPECT_EQ(SizePolicy{config}.RoundSize(3 * kMiB - 600), 3 * kMiB);
  // The parser accepts any power of two; 512 * 2^55 wraps to 0 in 64 bits, and every request
  // became a power of two.
  config.roundup_power2_divisions.fill(size_t{1} << 55);
  EXPECT_EQ(SizePolicy{config}.RoundSize(3 * kMiB), 3 * kMiB);
  EXPECT_EQ(SizePolicy{config}.RoundSize(5 * kMiB + 1), 5 * kMiB + 512);
}

TEST(SizePolicy, SplitRules) {
  AllocatorConfig config;
  config.max_split_size = 40 * kMiB;
  const SizePolicy policy{config};
  EXPECT_TRUE(policy.ShouldSplit(PoolKind::kSmall, 2 * kMiB, 2 * kMiB - 512));
  EXPECT_FALSE(policy.ShouldSplit(PoolKind::kSmall, 2 * kMiB, 2 * kMiB));
  // Large pool: only a remainder above 1 MiB is kept.
  EXPECT_TRUE(policy.ShouldSplit(PoolKind::kLarge, 20 * kMiB, 2 * kMiB));
  EXPECT_FALSE(policy.ShouldSplit(PoolKind::kLarge, 20 * kMiB, 19 * kMiB));
  // Nothing at or above max_split_size is split.
  EXPECT_FALSE(policy.ShouldSplit(PoolKind::kLarge, 80 * kMiB, 40 * kMiB));
}

TEST(SizePolicy, OversizeBlocksAreNotHandedToSmallRequests) {
  AllocatorConfig config;
  config.max_split_size = 40 * kMiB;
  const SizePolicy policy{config};
  EXPECT_FALSE(policy.AcceptsBlock(64 * kMiB, 2 * kMiB));
  EXPECT_TRUE(policy.AcceptsBlock(30 * kMiB, 2 * kMiB));
  EXPECT_TRUE(policy.AcceptsBlock(50 * kMiB, 45 * kMiB));
  EXPECT_FALSE(policy.AcceptsBlock(70 * kMiB, 45 * kMiB));  // would waste >= 20 MiB
}

TEST(SizePolicy, SegmentsLeaveNoRemainderThatNoRequestMayTake) {
  // Default configuration: PyTorch's shared 20 MiB segment first; the request's own size is the
  // least one.
  const SizePolicy plain{AllocatorConfig{}};
  EXPECT_EQ(plain.FullSegmentSize(kMiB + kMiB / 2), 20 * kMiB);
  EXPECT_EQ(plain.LeastSegmentSize(kMiB + kMiB / 2), 2 * kMiB);
  EXPECT_EQ(plain.FullSegmentSize(12 * kMiB), 12 * kMiB);
  // max_split_size 8 MiB: a 20 MiB segment would leave an oversize remainder no request below
  // 8 MiB may take, so the request's own size is taken.
  AllocatorConfig eight;
  eight.max_split_size = 8 * kMiB;
  EXPECT_EQ(SizePolicy{eight}.FullSegmentSize(kMiB + kMiB / 2), 2 * kMiB);
  EXPECT_EQ(SizePolicy{eight}.FullSegmentSize(3 * kMiB), 4 * kMiB);
  // max_split_size 4 MiB: a 4 MiB block is oversize and never goes to a 3.5 MiB request, and
  // 0.5 MiB is too little to split off; 6 MiB splits into the request and a 2.5 MiB block.
  AllocatorConfig four;
  four.max_split_size = 4 * kMiB;
  EXPECT_EQ(SizePolicy{four}.FullSegmentSize(3 * kMiB + kMiB / 2), 6 * kMiB);
  EXPECT_EQ(SizePolicy{four}.LeastSegmentSize(3 * kMiB + kMiB / 2), 6 * kMiB);
  // At or above max_split_size the request is oversize and takes PyTorch's size.
  EXPECT_EQ(SizePolicy{four}.FullSegmentSize(5 * kMiB), 20 * kMiB);
}

}  // namespace
}  // namespace spillway
