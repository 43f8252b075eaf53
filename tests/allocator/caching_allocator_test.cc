// Core caching behaviour: pools, best fit, split and merge, cache reuse, limits, empty_cache.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <set>
#include <vector>

#include "tests/allocator/sim_fixture.h"
#include "tests/counting_sim_backend.h"

namespace spillway::testing {
namespace {

using CachingAllocatorTest = SimAllocatorTest;

TEST_F(CachingAllocatorTest, ReturnsAlignedWritableMemory) {
  void* p = Alloc(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 512, 0u);
  std::memset(p, 0xAB, 1000);  // simulated device memory is host memory
  allocator_->Free(p);
}

TEST_F(CachingAllocatorTest, CachedPathReusesBlockWithoutBackendCall) {
  void* p = Alloc(4096);
  allocator_->Free(p);
  const int64_t mallocs = backend_->num_device_mallocs();
  void* q = Alloc(4096);
  EXPECT_EQ(q, p);
  EXPECT_EQ(backend_->num_device_mallocs(), mallocs);
  allocator_->Free(q);
}

TEST_F(CachingAllocatorTest, SmallRequestsShareOneTwoMiBSegment) {
  void* a = Alloc(512);
  void* b = Alloc(512);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b), reinterpret_cast<uintptr_t>(a) + 512);
  EXPECT_EQ(Stat("segment.small_pool.current"), 1);
  EXPECT_EQ(Stat("reserved_bytes.small_pool.current"), int64_t{2 << 20});
  allocator_->Free(a);
  allocator_->Free(b);
}

TEST_F(CachingAllocatorTest, MidSizeRequestCarvesTwentyMiBSegment) {
  void* p = Alloc(3 * kMiB / 2);
  EXPECT_EQ(Stat("reserved_bytes.large_pool.current"), int64_t{20 << 20});
  EXPECT_EQ(Stat("allocated_bytes.large_pool.current"), int64_t{3 * kMiB / 2});
  EXPECT_EQ(Stat("inactive_split.large_pool.current"), 1);
  void* q = Alloc(2 * kMiB);  // served from the remainder, no new segment
  EXPECT_EQ(Stat("segment.large_pool.current"), 1);
  allocator_->Free(p);
  allocator_->Free(q);
}

// A 20 MiB segment for a 1-10 MiB request is PyTorch's size, chosen for the room it leaves. When
// it does not fit (under a limit, or on the device), a segment of just the request's size does:
// the request is served while the device can hold it. (PyTorch's allocator fails it.)
TEST_F(CachingAllocatorTest, MidSizeRequestTakesItsOwnSizeWhenTwentyMiBDoNotFit) {
  AllocatorConfig config;
  config.memory_limit_bytes = 20 * kMiB;
  Reset(config);
  void* small = Alloc(100);  // a 2 MiB small-pool segment: 18 MiB left under the limit
  void* mid = Alloc(2 * kMiB);
  EXPECT_EQ(Stat("reserved_bytes.large_pool.current"), int64_t{2 << 20});
  allocator_->Free(mid);
  allocator_->Free(small);

  Reset(AllocatorConfig{});  // under a watermark (the offload budget), the own size comes first
  allocator_->SetWatermark(0, 16 * kMiB);
  void* under = Alloc(2 * kMiB);
  EXPECT_EQ(Stat("reserved_bytes.all.current"), int64_t{2 << 20});
  allocator_->Free(under);

  Reset(AllocatorConfig{}, 30 * kMiB);  // no limit, a 30 MiB device
  std::vector<void*> blocks;
  blocks.reserve(15);
  for (int i = 0; i < 15; ++i) blocks.push_back(Alloc(2 * kMiB));  // 30 MiB in all
  EXPECT_EQ(Stat("reserved_bytes.all.current"), int64_t{30 << 20});
  EXPECT_EQ(Stat("segment.large_pool.current"), 6) << "one of 20 MiB, then five of 2 MiB";
  EXPECT_THROW(Alloc(2 * kMiB), OutOfMemoryError);
  for (void* p : blocks) allocator_->Free(p);
}

TEST_F(CachingAllocatorTest, FreeCoalescesWithBothNeighbours) {
  void* a = Alloc(kMiB / 2);
  void* b = Alloc(kMiB / 2);
  void* c = Alloc(kMiB / 2);
  allocator_->Free(a);
  allocator_->Free(c);
  EXPECT_EQ(Stat("inactive_split.small_pool.current"), 2);
  allocator_->Free(b);  // merges a, b, c and the tail into one whole segment
  EXPECT_EQ(Stat("inactive_split.small_pool.current"), 0);
  EXPECT_EQ(Stat("inactive_split_bytes.small_pool.current"), 0);
  const Snapshot snap = allocator_->TakeSnapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  ASSERT_EQ(snap.segments[0].blocks.size(), 1u);
  EXPECT_EQ(snap.segments[0].blocks[0].size, 2 * kMiB);
  EXPECT_EQ(snap.segments[0].blocks[0].state, BlockState::kInactive);
}

TEST_F(CachingAllocatorTest, BestFitPicksSmallestSufficientBlock) {
  // Two dedicated segments (>= 10 MiB requests get their own), freed: 12 MiB and 16 MiB.
  void* big = Alloc(16 * kMiB);
  void* small = Alloc(12 * kMiB);
  allocator_->Free(big);
  allocator_->Free(small);
  void* p = Alloc(11 * kMiB);
  EXPECT_EQ(p, small);
  void* q = Alloc(13 * kMiB);
  EXPECT_EQ(q, big);
  allocator_->Free(p);
  allocator_->Free(q);
}

// Below 20 MiB, max_split_size would make the remainder of PyTorch's shared 20 MiB segment an
// oversize block, of use to no request below it: each 1-10 MiB request took 20 MiB of its own,
// and three of them left a 64 MiB device unable to hold 4 MiB more.
TEST_F(CachingAllocatorTest, AMaxSplitSizeUnder20MiBGivesRequestsBelowItTheirOwnSize) {
  AllocatorConfig config;
  config.max_split_size = 6 * kMiB;
  Reset(config, 64 * kMiB);
  std::vector<void*> held(3);
  for (void*& p : held) p = Alloc(3 * kMiB / 2);
  EXPECT_EQ(Stat("reserved_bytes.all.current"), static_cast<int64_t>(6 * kMiB));  // 2 MiB each
  held.push_back(Alloc(4 * kMiB));
  EXPECT_EQ(Stat("reserved_bytes.all.current"), static_cast<int64_t>(10 * kMiB));
  for (void* p : held) allocator_->Free(p);
}

TEST_F(CachingAllocatorTest, MaxSplitSizeKeepsOversizeBlocksWhole) {
  AllocatorConfig config;
  config.max_split_size = 20 * kMiB;
  Reset(config);
  void* big = Alloc(64 * kMiB);
  allocator_->Free(big);
  // A small large-pool request must not carve the oversize block: a new 20 MiB segment is made.
  void* p = Alloc(2 * kMiB);
  EXPECT_NE(p, big);
  EXPECT_EQ(Stat("segment.large_pool.current"), 2);
  allocator_->Free(p);
}

TEST_F(CachingAllocatorTest, ZeroSizeReturnsNullAndFreeNullIsNoop) {
  EXPECT_EQ(Alloc(0), nullptr);
  EXPECT_NO_THROW(allocator_->Free(nullptr));
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(backend_->num_device_mallocs(), 0);
}

TEST_F(CachingAllocatorTest, EmptyCacheReleasesOnlyWholeFreeSegments) {
  void* keep = Alloc(512);
  void* drop = Alloc(12 * kMiB);
  allocator_->Free(drop);
  EXPECT_EQ(Stat("segment.all.current"), 2);
  allocator_->EmptyCache();
  EXPECT_EQ(Stat("segment.all.current"), 1);
  EXPECT_EQ(Stat("num_device_free"), 1);
  EXPECT_EQ(backend_->bytes_in_use(0), 2 * kMiB);
  allocator_->Free(keep);
  allocator_->EmptyCache();
  EXPECT_EQ(backend_->bytes_in_use(0), 0u);
  EXPECT_EQ(Stat("reserved_bytes.all.current"), 0);
}

// A burst of blocks grows the allocator's own host bookkeeping; empty_cache gives back what the
// blocks still alive do not need, and those blocks stay intact. With hysteresis: the first
// empty_cache after the burst keeps room for it (a training step that repeats the burst after
// each empty_cache must not regrow the bookkeeping every time), the next one, with no burst
// between them, gives it back.
TEST_F(CachingAllocatorTest, EmptyCacheGivesBackBookkeepingABurstGrew) {
  const size_t idle = allocator_->MetadataBytes(0);
  std::vector<void*> burst;
  burst.reserve(20000);
  for (int i = 0; i < 20000; ++i) burst.push_back(Alloc(512));
  const size_t grown = allocator_->MetadataBytes(0);
  EXPECT_GT(grown, 20000u * 32) << "one 32-byte Block per live allocation at least";
  // Keep the first few (the lowest ids) and one from the middle of the burst.
  std::vector<void*> kept(burst.begin(), burst.begin() + 8);
  kept.push_back(burst[5000]);
  for (void* p : burst) {
    if (std::find(kept.begin(), kept.end(), p) == kept.end()) allocator_->Free(p);
  }
  for (size_t i = 0; i < kept.size(); ++i) std::memset(kept[i], static_cast<int>(i + 1), 512);
  allocator_->EmptyCache();
  EXPECT_EQ(allocator_->MetadataBytes(0), grown) << "the burst's round gave its room back at once";
  // The burst again: it fits the room kept (no growth), and it is the round's peak once more.
  std::vector<void*> replay;
  replay.reserve(20000);
  for (int i = 0; i < 20000; ++i) replay.push_back(Alloc(512));
  EXPECT_EQ(allocator_->MetadataBytes(0), grown) << "the replay regrew the bookkeeping";
  for (void* p : replay) allocator_->Free(p);
  allocator_->EmptyCache();
  EXPECT_EQ(allocator_->MetadataBytes(0), grown);
  allocator_->EmptyCache();  // a round with no burst: now it goes
  const size_t trimmed = allocator_->MetadataBytes(0);
  EXPECT_LT(trimmed, grown / 2) << "the tail of the id space no live block uses went back";
  // What the kept blocks are is unchanged: their size, their bytes, and that they free cleanly.
  for (size_t i = 0; i < kept.size(); ++i) {
    const auto info = allocator_->Lookup(kept[i]);
    ASSERT_TRUE(info.has_value());
    EXPECT_EQ(info->requested, 512u);
    EXPECT_EQ(static_cast<const unsigned char*>(kept[i])[511], i + 1);
  }
  // The allocator goes on working: a second burst, then everything back.
  std::vector<void*> again;
  again.reserve(20000);
  for (int i = 0; i < 20000; ++i) again.push_back(Alloc(512));
  EXPECT_EQ(std::set<void*>(again.begin(), again.end()).size(), again.size());
  for (void* p : again) allocator_->Free(p);
  for (void* p : kept) allocator_->Free(p);
  allocator_->EmptyCache();
  allocator_->EmptyCache();
  EXPECT_EQ(allocator_->MetadataBytes(0), idle);
  EXPECT_EQ(Stat("reserved_bytes.all.current"), 0);
}

TEST_F(CachingAllocatorTest, MemoryLimitInBytesIsEnforced) {
  AllocatorConfig config;
  config.memory_limit_bytes = 30 * kMiB;
  Reset(config);
  void* a = Alloc(12 * kMiB);
  void* b = Alloc(12 * kMiB);
  EXPECT_THROW(Alloc(12 * kMiB), OutOfMemoryError);
  EXPECT_LE(Stat("reserved_bytes.all.peak"), int64_t{30 << 20});
  allocator_->Free(a);
  allocator_->Free(b);
}

TEST_F(CachingAllocatorTest, MemoryFractionLimitsAndCanBeChanged) {
  Reset(AllocatorConfig{}, 100 * kMiB);
  allocator_->SetMemoryFraction(0.25, 0);
  EXPECT_EQ(allocator_->memory_limit(0), 25 * kMiB);
  EXPECT_THROW(Alloc(30 * kMiB), OutOfMemoryError);
  allocator_->SetMemoryFraction(0.5, 0);
  void* p = Alloc(30 * kMiB);
  allocator_->Free(p);
  allocator_->SetMemoryFraction(1.0, 0);
  EXPECT_EQ(allocator_->memory_limit(0), 100 * kMiB);
  // As in PyTorch, 0 allows no new memory, and so does a fraction too small for a single byte:
  // a limit nothing fits under, not "no limit".
  for (const double nothing : {0.0, 1e-12}) {
    allocator_->SetMemoryFraction(nothing, 0);
    EXPECT_EQ(allocator_->memory_limit(0), 1u);
    EXPECT_EQ(allocator_->memory_fraction(0), nothing);
    EXPECT_THROW(Alloc(512), OutOfMemoryError);
  }
}

TEST_F(CachingAllocatorTest, GarbageCollectionReleasesOldFreeSegmentsBeforeGrowing) {
  AllocatorConfig config;
  config.memory_limit_bytes = 64 * kMiB;
  config.garbage_collection_threshold = 0.5;
  Reset(config);
  void* a = Alloc(12 * kMiB);
  void* b = Alloc(12 * kMiB);
  allocator_->Free(a);
  allocator_->Free(b);
  // 24 MiB cached; a 16 MiB segment would pass 32 MiB (the threshold), so cached ones go first.
  void* c = Alloc(16 * kMiB);
  EXPECT_LE(Stat("reserved_bytes.all.current"), int64_t{32 << 20});
  EXPECT_GE(Stat("num_device_free"), 1);
  allocator_->Free(c);
}

TEST_F(CachingAllocatorTest, DevicesAreIndependent) {
  Reset(AllocatorConfig{}, 64 * kMiB, 2);
  void* p0 = allocator_->Malloc(4096, 0, backend_->default_stream(0));
  void* p1 = allocator_->Malloc(4096, 1, backend_->default_stream(1));
  EXPECT_EQ(allocator_->FlatStats(1).at("allocation.all.current"), 1);
  EXPECT_EQ(allocator_->Lookup(p1)->device, 1);
  allocator_->Free(p1);  // found without naming the device
  allocator_->Free(p0, 0);
  EXPECT_EQ(allocator_->FlatStats(1).at("allocation.all.current"), 0);
  EXPECT_EQ(allocator_->FlatStats(0).at("allocation.all.current"), 0);
}

// PyTorch frees by pointer alone, so the allocator tries first the device that answered the last
// pointer-only call (bench: FreeByPointer). Whichever device that was, every such call must still
// reach the owner, and a pointer no device owns must still be refused.
TEST_F(CachingAllocatorTest, PointerOnlyCallsReachTheOwnerWhicheverDeviceAnsweredLast) {
  Reset(AllocatorConfig{}, 64 * kMiB, 3);
  void* p[3];
  for (int d = 0; d < 3; ++d) p[d] = allocator_->Malloc(4096, d, backend_->default_stream(d));
  for (int d : {2, 0, 1, 1, 2}) EXPECT_EQ(allocator_->Lookup(p[d])->device, d);
  for (int d : {1, 0, 2}) EXPECT_EQ(allocator_->SegmentOf(p[d])->device, d);
  const StreamRef side = backend_->create_stream(0);
  allocator_->RecordStream(p[0], side);  // after device 2 answered
  allocator_->Free(p[2]);
  EXPECT_THROW(allocator_->Free(p[2]), InvalidArgumentError);  // device 2 answered last
  EXPECT_FALSE(allocator_->Lookup(p[2]).has_value());
  allocator_->Free(p[1]);
  allocator_->Free(p[0]);
  EXPECT_EQ(allocator_->FlatStats(0).at("active.all.current"), 1) << "the recorded use was lost";
  backend_->synchronize_stream(0, side.handle);
  allocator_->ProcessEvents(0);
  for (int d = 0; d < 3; ++d) {
    EXPECT_EQ(allocator_->FlatStats(d).at("allocation.all.current"), 0) << "device " << d;
    EXPECT_EQ(allocator_->FlatStats(d).at("active.all.current"), 0) << "device " << d;
  }
}

TEST(CachingAllocatorWithoutDevices, PointerOnlyCallsAreRefusedClearly) {
  CachingAllocator allocator(std::make_shared<SimBackend>(SimBackend::Options{.devices = 0}),
                             AllocatorConfig{});
  int not_ours = 0;
  EXPECT_FALSE(allocator.Lookup(&not_ours).has_value());
  EXPECT_THROW(allocator.Free(&not_ours), InvalidArgumentError);
  EXPECT_THROW(allocator.RecordStream(&not_ours, StreamRef{}), InvalidArgumentError);
  allocator.Free(nullptr);  // a no-op, as everywhere
}

// What a pointer into an allocation belongs to (a second storage over a block's memory starts
// inside it): the block, while it is allocated; nothing once it is free, nor for foreign memory.
TEST_F(CachingAllocatorTest, LookupContainingFindsTheBlockAnInteriorPointerBelongsTo) {
  char* a = static_cast<char*>(Alloc(4096));
  char* b = static_cast<char*>(Alloc(4096));
  ASSERT_EQ(allocator_->SegmentOf(a)->base, allocator_->SegmentOf(b)->base) << "one segment";
  EXPECT_EQ(allocator_->LookupContaining(a)->ptr, a);
  EXPECT_EQ(allocator_->LookupContaining(a + 4095)->ptr, a);
  EXPECT_EQ(allocator_->LookupContaining(b + 100)->ptr, b);
  EXPECT_FALSE(allocator_->Lookup(b + 100).has_value());  // Lookup takes starts only
  allocator_->Free(b);
  EXPECT_FALSE(allocator_->LookupContaining(b + 100).has_value()) << "a free block";
  int foreign = 0;
  EXPECT_FALSE(allocator_->LookupContaining(&foreign).has_value());
  allocator_->Free(a);
}

TEST_F(CachingAllocatorTest, LookupReportsRequestedAndRoundedSize) {
  void* p = Alloc(1000);
  const auto info = allocator_->Lookup(p);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->requested, 1000u);
  EXPECT_EQ(info->size, 1024u);
  EXPECT_EQ(info->stream.id, stream_.id);
  allocator_->Free(p);
  EXPECT_FALSE(allocator_->Lookup(p).has_value());
}

// A fraction needs the device total; when asking for it fails, nothing changes: not the fraction
// reported, not the limit allocations meet.
TEST(DeviceTotalFailureTest, AMemoryFractionWhoseDeviceTotalFailsChangesNothing) {
  auto backend =
      std::make_shared<FailingMemInfoBackend>(JitterOptions(std::chrono::microseconds(0)));
  CachingAllocator alloc(backend, AllocatorConfig{});
  backend->fail_mem_info = true;
  EXPECT_THROW(alloc.SetMemoryFraction(0.25, 0), BackendError);
  backend->fail_mem_info = false;
  EXPECT_FALSE(alloc.memory_fraction(0).has_value());
  void* p = nullptr;
  EXPECT_NO_THROW(p = alloc.Malloc(40 * kMiB, 0, backend->default_stream(0)));
  alloc.Free(p);
}

// Under a watermark the device's first segment needs the device total; when asking for it fails,
// the allocation fails whole: no segment stays reserved that no block of anyone's is in.
TEST(DeviceTotalFailureTest, AFirstSegmentWhoseWatermarkCannotBeResolvedIsNotKept) {
  auto backend =
      std::make_shared<FailingMemInfoBackend>(JitterOptions(std::chrono::microseconds(0)));
  CachingAllocator alloc(backend, AllocatorConfig{});
  alloc.SetWatermarkFraction(0, 0.5);
  backend->fail_mem_info = true;
  EXPECT_THROW(alloc.Malloc(4 * kMiB, 0, backend->default_stream(0)), BackendError);
  backend->fail_mem_info = false;
  EXPECT_EQ(alloc.stats(0).reserved_bytes.all().current, 0);
  EXPECT_EQ(backend->bytes_in_use(0), 0u);
}

}  // namespace
}  // namespace spillway::testing
