#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "allocator/block.h"

namespace spillway {
namespace {

Block MakeBlock(uint64_t stream, size_t size, uintptr_t ptr) {
  Block b;
  b.stream = stream;
  b.size = size;
  b.ptr = ptr;
  return b;
}

const auto kAcceptAll = [](const FreeKey&) { return true; };

TEST(FreeIndex, BestFitStaysOnTheRequestedStream) {
  FreeIndex index;
  Block small1 = MakeBlock(1, 1024, 0x10000);
  Block large1 = MakeBlock(1, 4096, 0x20000);
  Block mid2 = MakeBlock(2, 2048, 0x30000);  // a better fit, but on another stream
  for (Block* b : {&small1, &large1, &mid2}) index.Insert(b);
  EXPECT_EQ(index.size(), 3u);
  EXPECT_EQ(index.TakeBestFit(1, 1500, kAcceptAll), &large1);
  EXPECT_EQ(index.TakeBestFit(1, 1500, kAcceptAll), nullptr);  // taken: nothing left that fits
  EXPECT_EQ(index.TakeBestFit(2, 1500, kAcceptAll), &mid2);
  EXPECT_EQ(index.TakeBestFit(3, 1, kAcceptAll), nullptr);  // a stream never seen ...
  EXPECT_EQ(index.tree_count(), 2u);                        // ... gets no tree from a lookup
  EXPECT_EQ(index.size(), 1u);
}

TEST(FreeIndex, LargestSizeIsTheLargestFreeBlockOfAnyStream) {
  FreeIndex index;
  EXPECT_EQ(index.LargestSize(), 0u);
  Block a = MakeBlock(1, 4096, 0x10000);
  Block b = MakeBlock(2, 8192, 0x20000);
  Block c = MakeBlock(1, 2048, 0x30000);
  for (Block* blk : {&a, &b, &c}) index.Insert(blk);
  EXPECT_EQ(index.LargestSize(), 8192u);
  EXPECT_EQ(index.TakeBestFit(2, 1, kAcceptAll), &b);
  EXPECT_EQ(index.LargestSize(), 4096u);  // stream 2's tree is empty now
  index.Erase(&a);
  EXPECT_EQ(index.LargestSize(), 2048u);
}

TEST(FreeIndex, SizeZeroNeverTakesTheSentinel) {
  FreeIndex index;
  Block b = MakeBlock(1, 512, 0x10000);
  index.Insert(&b);
  EXPECT_EQ(index.TakeBestFit(1, 0, kAcceptAll), &b);
  EXPECT_EQ(index.TakeBestFit(1, 0, kAcceptAll), nullptr);
  EXPECT_EQ(index.size(), 0u);
}

TEST(FreeIndex, EqualSizesGoLowestAddressFirst) {
  FreeIndex index;
  Block high = MakeBlock(1, 2048, 0x90000);
  Block low = MakeBlock(1, 2048, 0x10000);
  Block mid = MakeBlock(1, 2048, 0x50000);
  for (Block* b : {&high, &low, &mid}) index.Insert(b);
  EXPECT_EQ(index.TakeBestFit(1, 2048, kAcceptAll), &low);
  EXPECT_EQ(index.TakeBestFit(1, 2048, kAcceptAll), &mid);
  EXPECT_EQ(index.TakeBestFit(1, 2048, kAcceptAll), &high);
}

TEST(FreeIndex, RejectedCandidateLeavesTheIndexUnchanged) {
  FreeIndex index;
  Block b = MakeBlock(1, 8192, 0x10000);
  index.Insert(&b);
  size_t seen = 0;
  EXPECT_EQ(index.TakeBestFit(1, 512,
                              [&](const FreeKey& key) {
                                seen = key.size;
                                return false;
                              }),
            nullptr);
  EXPECT_EQ(seen, 8192u);
  EXPECT_EQ(index.size(), 1u);
  EXPECT_EQ(index.TakeBestFit(1, 512, kAcceptAll), &b);
}

TEST(FreeIndex, EraseRemovesExactlyThatBlock) {
  FreeIndex index;
  Block a = MakeBlock(1, 2048, 0x10000);
  Block b = MakeBlock(1, 2048, 0x20000);
  index.Insert(&a);
  index.Insert(&b);
  index.Erase(&a);
  EXPECT_EQ(index.TakeBestFit(1, 1, kAcceptAll), &b);
  EXPECT_EQ(index.size(), 0u);
}

TEST(FreeIndex, PruneDropsOnlyEmptyStreamsAndKeepsWorking) {
  FreeIndex index;
  std::vector<Block> blocks;
  blocks.reserve(8);
  for (uint64_t stream = 1; stream <= 8; ++stream)
    blocks.push_back(MakeBlock(stream, 1024, stream << 20));
  for (Block& b : blocks) index.Insert(&b);
  for (uint64_t stream = 1; stream <= 7; ++stream) {
    EXPECT_EQ(index.TakeBestFit(stream, 1024, kAcceptAll), &blocks[stream - 1]);
  }
  EXPECT_EQ(index.tree_count(), 8u);
  index.PruneEmpty();
  EXPECT_EQ(index.tree_count(), 1u);  // stream 8 still holds a block
  EXPECT_EQ(index.size(), 1u);
  // The stream used last before the prune (7) had its tree dropped: using it again must build a
  // new one, not touch the freed tree (ASan reports that).
  Block again = MakeBlock(7, 512, 0x70000);
  index.Insert(&again);
  EXPECT_EQ(index.TakeBestFit(7, 512, kAcceptAll), &again);
  EXPECT_EQ(index.TakeBestFit(8, 512, kAcceptAll), &blocks[7]);
}

}  // namespace
}  // namespace spillway
