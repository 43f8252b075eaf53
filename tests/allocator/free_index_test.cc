#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "allocator/block.h"

namespace spillway {
namespace {

// A free block as the index sees it: its stream, key and id (ids are distinct per test).
struct Entry {
  uint64_t stream;
  FreeKey key;
};

Entry MakeBlock(uint64_t stream, size_t size, uintptr_t ptr) {
  static BlockId next_id = 1;
  return Entry{stream, FreeKey{size, ptr, next_id++}};
}

void Insert(FreeIndex& index, const Entry& e) { index.Insert(e.stream, e.key); }
void Erase(FreeIndex& index, const Entry& e) { index.Erase(e.stream, e.key); }
BlockId Id(const Entry& e) { return e.key.block; }

const auto kAcceptAll = [](const FreeKey&) { return true; };

TEST(FreeIndex, BestFitStaysOnTheRequestedStream) {
  FreeIndex index;
  Entry small1 = MakeBlock(1, 1024, 0x10000);
  Entry large1 = MakeBlock(1, 4096, 0x20000);
  Entry mid2 = MakeBlock(2, 2048, 0x30000);  // a better fit, but on another stream
  for (const Entry* b : {&small1, &large1, &mid2}) Insert(index, *b);
  EXPECT_EQ(index.size(), 3u);
  EXPECT_EQ(index.TakeBestFit(1, 1500, kAcceptAll), Id(large1));
  EXPECT_EQ(index.TakeBestFit(1, 1500, kAcceptAll), kNoBlock);  // taken: nothing left that fits
  EXPECT_EQ(index.TakeBestFit(2, 1500, kAcceptAll), Id(mid2));
  EXPECT_EQ(index.TakeBestFit(3, 1, kAcceptAll), kNoBlock);  // a stream never seen ...
  EXPECT_EQ(index.tree_count(), 2u);                         // ... gets no tree from a lookup
  EXPECT_EQ(index.size(), 1u);
}

TEST(FreeIndex, LargestSizeIsTheLargestFreeBlockOfAnyStream) {
  FreeIndex index;
  EXPECT_EQ(index.LargestSize(), 0u);
  Entry a = MakeBlock(1, 4096, 0x10000);
  Entry b = MakeBlock(2, 8192, 0x20000);
  Entry c = MakeBlock(1, 2048, 0x30000);
  for (const Entry* blk : {&a, &b, &c}) Insert(index, *blk);
  EXPECT_EQ(index.LargestSize(), 8192u);
  EXPECT_EQ(index.TakeBestFit(2, 1, kAcceptAll), Id(b));
  EXPECT_EQ(index.LargestSize(), 4096u);  // stream 2's tree is empty now
  Erase(index, a);
  EXPECT_EQ(index.LargestSize(), 2048u);
}

TEST(FreeIndex, SizeZeroNeverTakesTheSentinel) {
  FreeIndex index;
  Entry b = MakeBlock(1, 512, 0x10000);
  Insert(index, b);
  EXPECT_EQ(index.TakeBestFit(1, 0, kAcceptAll), Id(b));
  EXPECT_EQ(index.TakeBestFit(1, 0, kAcceptAll), kNoBlock);
  EXPECT_EQ(index.size(), 0u);
}

TEST(FreeIndex, EqualSizesGoLowestAddressFirst) {
  FreeIndex index;
  Entry high = MakeBlock(1, 2048, 0x90000);
  Entry low = MakeBlock(1, 2048, 0x10000);
  Entry mid = MakeBlock(1, 2048, 0x50000);
  for (const Entry* b : {&high, &low, &mid}) Insert(index, *b);
  EXPECT_EQ(index.TakeBestFit(1, 2048, kAcceptAll), Id(low));
  EXPECT_EQ(index.TakeBestFit(1, 2048, kAcceptAll), Id(mid));
  EXPECT_EQ(index.TakeBestFit(1, 2048, kAcceptAll), Id(high));
}

// Keys hold sizes in 512-byte units; a request between two unit counts must round up, never
// down onto a block one unit too small, and a request beyond any block size finds nothing.
TEST(FreeIndex, RequestsBetweenUnitsRoundUp) {
  FreeIndex index;
  Entry fits_1536 = MakeBlock(1, 1536, 0x10000);
  Entry fits_2048 = MakeBlock(1, 2048, 0x20000);
  Insert(index, fits_1536);
  Insert(index, fits_2048);
  EXPECT_EQ(index.TakeBestFit(1, size_t{1} << 62, kAcceptAll), kNoBlock);
  EXPECT_EQ(index.TakeBestFit(1, 1537, kAcceptAll), Id(fits_2048));
  EXPECT_EQ(index.TakeBestFit(1, 1025, kAcceptAll), Id(fits_1536));
  EXPECT_EQ(index.size(), 0u);
}

TEST(FreeIndex, RejectedCandidateLeavesTheIndexUnchanged) {
  FreeIndex index;
  Entry b = MakeBlock(1, 8192, 0x10000);
  Insert(index, b);
  size_t seen = 0;
  EXPECT_EQ(index.TakeBestFit(1, 512,
                              [&](const FreeKey& key) {
                                seen = key.size();
                                return false;
                              }),
            kNoBlock);
  EXPECT_EQ(seen, 8192u);
  EXPECT_EQ(index.size(), 1u);
  EXPECT_EQ(index.TakeBestFit(1, 512, kAcceptAll), Id(b));
}

TEST(FreeIndex, EraseRemovesExactlyThatBlock) {
  FreeIndex index;
  Entry a = MakeBlock(1, 2048, 0x10000);
  Entry b = MakeBlock(1, 2048, 0x20000);
  Insert(index, a);
  Insert(index, b);
  Erase(index, a);
  EXPECT_EQ(index.TakeBestFit(1, 1, kAcceptAll), Id(b));
  EXPECT_EQ(index.size(), 0u);
}

TEST(FreeIndex, PruneDropsOnlyEmptyStreamsAndKeepsWorking) {
  FreeIndex index;
  std::vector<Entry> blocks;
  blocks.reserve(8);
  for (uint64_t stream = 1; stream <= 8; ++stream)
    blocks.push_back(MakeBlock(stream, 1024, stream << 20));
  for (const Entry& b : blocks) Insert(index, b);
  for (uint64_t stream = 1; stream <= 7; ++stream) {
    EXPECT_EQ(index.TakeBestFit(stream, 1024, kAcceptAll), Id(blocks[stream - 1]));
  }
  EXPECT_EQ(index.tree_count(), 8u);
  index.PruneEmpty();
  EXPECT_EQ(index.tree_count(), 1u);  // stream 8 still holds a block
  EXPECT_EQ(index.size(), 1u);
  // The stream used last before the prune (7) had its tree dropped: using it again must build a
  // new one, not touch the freed tree (ASan reports that).
  Entry again = MakeBlock(7, 512, 0x70000);
  Insert(index, again);
  EXPECT_EQ(index.TakeBestFit(7, 512, kAcceptAll), Id(again));
  EXPECT_EQ(index.TakeBestFit(8, 512, kAcceptAll), Id(blocks[7]));
}

}  // namespace
}  // namespace spillway
