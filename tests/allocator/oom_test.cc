// The out-of-memory ladder: callbacks, cache release and retry, and the final error.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "allocator/speculative.h"
#include "tests/allocator/sim_fixture.h"

namespace spillway::testing {
namespace {

class OomTest : public SimAllocatorTest {
 protected:
  void SetUp() override { Reset(AllocatorConfig{}, 64 * kMiB); }
};

TEST_F(OomTest, ErrorMessageCarriesTheDiagnostics) {
  void* held = Alloc(40 * kMiB);
  try {
    Alloc(30 * kMiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.requested_bytes(), 30 * kMiB);
    EXPECT_EQ(e.device(), 0);
    for (const char* part :
         {"device 0", "tried to allocate 30.00 MiB", "Allocated 40.00 MiB", "reserved 40.00 MiB",
          "limit none", "24.00 MiB free of 64.00 MiB", "largest cached free block"}) {
      EXPECT_NE(what.find(part), std::string::npos) << "missing '" << part << "' in: " << what;
    }
  }
  EXPECT_EQ(Stat("num_ooms"), 1);
  allocator_->Free(held);
}

TEST_F(OomTest, OomIsRecordedInHistory) {
  allocator_->RecordHistory(true, 100);
  EXPECT_THROW(Alloc(100 * kMiB), OutOfMemoryError);
  const auto trace = allocator_->TakeSnapshot().device_traces.at(0);
  ASSERT_FALSE(trace.empty());
  EXPECT_EQ(trace.back().action, TraceAction::kOom);
  EXPECT_EQ(trace.back().size, 100 * kMiB);
  EXPECT_EQ(trace.back().addr, 64 * kMiB);  // free device bytes, as PyTorch records
}

// Inside a SpeculativeAllocations scope (a prefetch) the front asks its device core for a cached
// block or a new segment only: a request that needs the ladder fails at once, with no cached
// segment released, no holder asked and nothing on record. The same request outside the scope
// is served by the ladder (the cached segment goes back, and the new one fits).
TEST_F(OomTest, SpeculativeAllocationsTakeOnlyWhatIsThereAndLeaveNoRecord) {
  allocator_->RecordHistory(true, 100);
  void* held = Alloc(24 * kMiB);
  allocator_->Free(Alloc(20 * kMiB));  // a wholly free cached segment: 44 MiB reserved
  int asked = 0;
  allocator_->AddFreeMemoryCallback([&](int, size_t) -> size_t {
    ++asked;
    return 0;
  });
  {
    const SpeculativeAllocations outer;
    {
      const SpeculativeAllocations inner;  // scopes nest: leaving this one keeps the outer's
    }
    void* cached = Alloc(16 * kMiB);  // a cached block serves a guess
    allocator_->Free(cached);
    EXPECT_THROW(Alloc(30 * kMiB), OutOfMemoryError);  // needs the 20 MiB segment released
  }
  EXPECT_FALSE(SpeculativeAllocations::Active());
  EXPECT_EQ(asked, 0);
  EXPECT_EQ(Stat("num_ooms"), 0);
  EXPECT_EQ(Stat("num_alloc_retries"), 0);
  EXPECT_EQ(Stat("reserved_bytes.all.current"), static_cast<int64_t>(44 * kMiB));
  const Snapshot snapshot = allocator_->TakeSnapshot();
  for (const TraceEntry& entry : snapshot.device_traces.at(0)) {
    EXPECT_NE(entry.action, TraceAction::kOom);
  }
  void* served = Alloc(30 * kMiB);  // no longer a guess: the ladder releases the cached segment
  EXPECT_EQ(Stat("num_alloc_retries"), 1);
  EXPECT_EQ(Stat("reserved_bytes.all.current"), static_cast<int64_t>(54 * kMiB));
  allocator_->Free(served);
  allocator_->Free(held);
}

// A request larger than the device, or than its limit, fits nowhere: the holders (the offload
// engine) are not asked to give memory back for it (they spilled everything they could, for
// nothing), and the error is the same.
TEST_F(OomTest, HoldersAreNotAskedForARequestThatCanNeverFit) {
  void* held = Alloc(8 * kMiB);
  int calls = 0;
  allocator_->AddFreeMemoryCallback([&](int, size_t) -> size_t {
    ++calls;
    if (held == nullptr) return 0;
    allocator_->Free(held);
    held = nullptr;
    return 8 * kMiB;
  });
  EXPECT_THROW(Alloc(100 * kMiB), OutOfMemoryError);  // more than the device
  EXPECT_EQ(calls, 0);
  allocator_->SetMemoryLimit(32 * kMiB, 0);
  EXPECT_THROW(Alloc(40 * kMiB), OutOfMemoryError);  // more than the limit
  EXPECT_EQ(calls, 0);
  EXPECT_NE(held, nullptr) << "the holders gave memory back for a request that fits nowhere";
  void* fits = Alloc(30 * kMiB);  // one that fits once they do: they are asked
  EXPECT_EQ(calls, 1);
  allocator_->Free(fits);
}

// A limit set lower after memory was reserved: a segment larger than the new limit can still
// serve a request larger than it, once its holder gives it back. The holders are asked.
TEST_F(OomTest, ARequestOverALoweredLimitThatASegmentCanServeAsksTheHolders) {
  void* held = Alloc(40 * kMiB);
  allocator_->AddFreeMemoryCallback([&](int, size_t) -> size_t {
    if (held == nullptr) return 0;
    allocator_->Free(held);
    held = nullptr;
    return 40 * kMiB;
  });
  allocator_->SetMemoryLimit(32 * kMiB, 0);
  void* again = nullptr;
  ASSERT_NO_THROW(again = Alloc(40 * kMiB));
  EXPECT_EQ(held, nullptr);
  allocator_->Free(again);
}

// What fits is the least segment that serves, not the request: a 4 KiB request needs a 2 MiB
// small-pool segment, which a 1 MiB limit never allows. And a segment over the limit serves only
// requests of its own stream. The holders are asked in neither case.
TEST_F(OomTest, HoldersAreNotAskedWhenNoSegmentThatServesCouldFit) {
  const StreamRef other = backend_->create_stream(0);
  void* held = Alloc(40 * kMiB, other);
  int calls = 0;
  allocator_->AddFreeMemoryCallback([&](int, size_t) -> size_t {
    ++calls;
    return 0;
  });
  allocator_->SetMemoryLimit(32 * kMiB, 0);
  EXPECT_THROW(Alloc(36 * kMiB, stream_), OutOfMemoryError);  // the 40 MiB segment is `other`'s
  EXPECT_EQ(calls, 0);
  allocator_->SetMemoryLimit(1 * kMiB, 0);
  EXPECT_THROW(Alloc(4096, stream_), OutOfMemoryError);
  EXPECT_EQ(calls, 0);
  allocator_->SetMemoryLimit(0, 0);
  allocator_->Free(held);
}

TEST_F(OomTest, FreeMemoryCallbackTurnsFailureIntoSuccess) {
  void* held = Alloc(40 * kMiB);
  size_t asked = 0;
  int calls = 0;
  allocator_->AddFreeMemoryCallback([&](int device, size_t bytes) -> size_t {
    EXPECT_EQ(device, 0);
    ++calls;
    asked = bytes;
    if (held == nullptr) return 0;
    allocator_->Free(held);  // the engine frees through the allocator: no lock may be held
    held = nullptr;
    return 40 * kMiB;
  });
  void* p = Alloc(30 * kMiB);
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(asked, 30 * kMiB);
  allocator_->Free(p);
}

// A spill costs a copy now and a reload later: the holders are asked for what the least new
// segment needs (2 MiB for a 2 MiB request), not for PyTorch's 20 MiB segment.
TEST_F(OomTest, HoldersAreAskedForTheLeastSegmentThatServes) {
  void* held = Alloc(50 * kMiB);
  void* spillable = Alloc(14 * kMiB);  // the device is full
  std::vector<size_t> asked;
  allocator_->AddFreeMemoryCallback([&](int, size_t bytes) -> size_t {
    asked.push_back(bytes);
    if (spillable == nullptr) return 0;
    allocator_->Free(spillable);
    spillable = nullptr;
    return 14 * kMiB;
  });
  void* p = Alloc(2 * kMiB);
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(asked, std::vector<size_t>{2 * kMiB});
  allocator_->Free(p);
  allocator_->Free(held);
}

// What a holder frees can lie scattered over segments that stay in use: while it gives memory
// back the allocator asks again (for twice as much each time), until the request fits.
TEST_F(OomTest, HoldersAreAskedAgainWhileTheyGiveMemoryBack) {
  Reset(AllocatorConfig{}, 40 * kMiB);  // two 20 MiB segments, four 5 MiB blocks in each
  std::vector<void*> blocks(8);
  for (void*& b : blocks) b = Alloc(5 * kMiB);
  ASSERT_EQ(Stat("segment.all.current"), 2);
  std::sort(blocks.begin(), blocks.end());  // blocks[0..3] in one segment, [4..7] in the other
  // One block a call, never two neighbours until the fifth: only then do 12 MiB lie in one piece.
  std::vector<void*> order = {blocks[0], blocks[4], blocks[2], blocks[6], blocks[1]};
  std::vector<size_t> asked;
  allocator_->AddFreeMemoryCallback([&](int, size_t bytes) -> size_t {
    asked.push_back(bytes);
    if (asked.size() > order.size()) return 0;
    allocator_->Free(order[asked.size() - 1]);
    return 5 * kMiB;
  });
  void* p = Alloc(12 * kMiB);
  EXPECT_EQ(p, blocks[0]) << "served from the three free neighbours";
  EXPECT_EQ(asked, (std::vector<size_t>{12 * kMiB, 24 * kMiB, 48 * kMiB, 96 * kMiB, 192 * kMiB}));
  EXPECT_EQ(Stat("num_alloc_retries"), 1) << "one malloc retried, however many rounds it took";
  allocator_->Free(p);
  for (void* b : {blocks[3], blocks[5], blocks[7]}) allocator_->Free(b);
}

// Whether the holders gave memory back is not read from the statistics: a reset of the
// accumulated statistics meanwhile (any thread may call torch.cuda.reset_accumulated_memory_stats)
// zeroed the freed-bytes count, and the ladder gave up after one round with a spurious OOM.
TEST_F(OomTest, AStatisticsResetDuringTheLadderDoesNotEndIt) {
  Reset(AllocatorConfig{}, 40 * kMiB);
  std::vector<void*> blocks(8);
  for (void*& b : blocks) b = Alloc(5 * kMiB);
  std::sort(blocks.begin(), blocks.end());
  std::vector<void*> order = {blocks[0], blocks[4], blocks[2], blocks[6], blocks[1]};
  size_t calls = 0;
  allocator_->AddFreeMemoryCallback([&](int device, size_t) -> size_t {
    if (calls == order.size()) return 0;
    allocator_->Free(order[calls++]);
    allocator_->ResetAccumulatedStats(device);
    return 5 * kMiB;
  });
  void* p = nullptr;
  EXPECT_NO_THROW(p = Alloc(12 * kMiB));
  EXPECT_EQ(p, blocks[0]);
  EXPECT_EQ(calls, order.size());
  allocator_->Free(p);
  for (void* b : {blocks[3], blocks[5], blocks[7]}) allocator_->Free(b);
}

// A holder that claims to have freed memory but did not cannot keep the allocator asking.
TEST_F(OomTest, AHolderThatFreesNothingIsAskedOnce) {
  void* held = Alloc(64 * kMiB);
  int calls = 0;
  allocator_->AddFreeMemoryCallback([&](int, size_t bytes) -> size_t {
    ++calls;
    return bytes;
  });
  EXPECT_THROW(Alloc(2 * kMiB), OutOfMemoryError);
  EXPECT_EQ(calls, 1);
  allocator_->Free(held);
}

TEST_F(OomTest, CallbacksAreNotAskedWhileTheBackendHasRoom) {
  int calls = 0;
  const uint64_t id = allocator_->AddFreeMemoryCallback([&](int, size_t) -> size_t {
    ++calls;
    return 0;
  });
  void* p = Alloc(20 * kMiB);
  EXPECT_EQ(calls, 0);
  allocator_->Free(p);
  allocator_->RemoveFreeMemoryCallback(id);
  EXPECT_THROW(Alloc(100 * kMiB), OutOfMemoryError);
  EXPECT_EQ(calls, 0);
}

TEST_F(OomTest, CachedSegmentsOfOtherStreamsAreReleasedAndRetried) {
  const StreamRef other = backend_->create_stream(0);
  void* p = Alloc(40 * kMiB, other);
  allocator_->Free(p);  // cached on `other`, useless to `stream_`
  void* q = Alloc(40 * kMiB, stream_);
  EXPECT_NE(q, nullptr);
  EXPECT_EQ(Stat("num_alloc_retries"), 1);
  EXPECT_EQ(Stat("num_device_free"), 1);
  EXPECT_EQ(Stat("num_sync_all_streams"), 0);  // nothing was pending: no wait
  allocator_->Free(q);
}

TEST_F(OomTest, TransientBackendFailureIsRetried) {
  backend_->fail_device_malloc_after(1);
  void* p = Alloc(kMiB);
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(Stat("num_alloc_retries"), 1);
  allocator_->Free(p);
}

TEST_F(OomTest, FailedAllocationLeavesStateUnchanged) {
  void* held = Alloc(40 * kMiB);
  const auto before = allocator_->FlatStats(0);
  EXPECT_THROW(Alloc(30 * kMiB), OutOfMemoryError);
  auto after = allocator_->FlatStats(0);
  for (const char* key : {"allocated_bytes.all.current", "reserved_bytes.all.current",
                          "allocation.all.current", "active.all.current"}) {
    EXPECT_EQ(after.at(key), before.at(key)) << key;
  }
  allocator_->Free(held);
  EXPECT_NE(Alloc(30 * kMiB), nullptr);  // and the allocator still serves
}

TEST_F(OomTest, SmallRequestTakesLargePoolSpaceOnlyAtTheEdgeOfMemory) {
  Reset(AllocatorConfig{}, 20 * kMiB);  // room for one large segment and nothing else
  void* big = Alloc(2 * kMiB);          // a 20 MiB large-pool segment, 18 MiB of it free
  void* small = Alloc(kMiB / 2);        // no room for a 2 MiB small segment
  ASSERT_NE(small, nullptr);
  const std::optional<AllocationInfo> info = allocator_->Lookup(small);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->pool, PoolKind::kLarge);
  EXPECT_EQ(info->size, kMiB / 2);  // split off, by the large pool's rules
  EXPECT_EQ(allocator_->SegmentOf(small)->base, allocator_->SegmentOf(big)->base);
  EXPECT_EQ(Stat("num_alloc_retries"), 1);  // after the wait and the release, not before
  EXPECT_EQ(Stat("num_ooms"), 0);
  EXPECT_EQ(Stat("allocation.large_pool.current"), 2);
  EXPECT_EQ(Stat("allocation.small_pool.current"), 0);
  EXPECT_EQ(Stat("segment.small_pool.current"), 0);
  allocator_->Free(small);
  allocator_->Free(big);
  allocator_->EmptyCache();
  EXPECT_EQ(Stat("reserved_bytes.all.current"), 0);
}

// A spill costs copies: the offload engine (a free-memory callback) is asked only after what the
// allocator can do on its own, here a small request in the large pool's free space.
TEST_F(OomTest, CallbacksComeAfterTheAllocatorsOwnSteps) {
  Reset(AllocatorConfig{}, 20 * kMiB);  // room for one large segment and nothing else
  int calls = 0;
  allocator_->AddFreeMemoryCallback([&](int, size_t) -> size_t {
    ++calls;
    return 0;
  });
  void* big = Alloc(2 * kMiB);  // a 20 MiB large-pool segment, 18 MiB of it free
  void* small = Alloc(kMiB / 2);
  EXPECT_EQ(allocator_->SegmentOf(small)->base, allocator_->SegmentOf(big)->base);
  EXPECT_EQ(calls, 0);
  EXPECT_THROW(Alloc(19 * kMiB), OutOfMemoryError);  // nothing of its own left: then it asks
  EXPECT_EQ(calls, 1);
  allocator_->Free(small);
  allocator_->Free(big);
}

TEST_F(OomTest, SmallRequestGetsItsOwnPoolWhileTheDeviceHasRoom) {
  void* big = Alloc(2 * kMiB);  // 18 MiB free in the large pool
  void* small = Alloc(kMiB / 2);
  EXPECT_EQ(allocator_->Lookup(small)->pool, PoolKind::kSmall);
  EXPECT_EQ(Stat("segment.small_pool.current"), 1);
  EXPECT_EQ(Stat("num_alloc_retries"), 0);
  allocator_->Free(small);
  allocator_->Free(big);
}

TEST_F(OomTest, SmallRequestDoesNotTakeLargePoolSpaceOfAnotherStream) {
  Reset(AllocatorConfig{}, 20 * kMiB);
  const StreamRef other = backend_->create_stream(0);
  void* big = Alloc(2 * kMiB, other);  // the free 18 MiB belong to `other`
  EXPECT_THROW(Alloc(kMiB / 2, stream_), OutOfMemoryError);
  allocator_->Free(big);
}

// The held streams below open when the host waits for their work: the out-of-memory ladder's wait
// is then the moment that work completes, whatever the timing, and a ladder that does not wait
// finds the block still pending.
TEST(OomLadderTest, ABlockTheWaitFreedIsReusedWithoutADeviceRoundTrip) {
  SimBackend::Options options;
  options.capacity_bytes = 64 * kMiB;
  auto backend = std::make_shared<SimBackend>(options);
  AllocatorConfig config;
  config.memory_limit_bytes = 20 * kMiB;
  CachingAllocator alloc(backend, config);
  const StreamRef main = backend->default_stream(0);
  const StreamRef side = backend->create_stream(0);
  void* p = alloc.Malloc(12 * kMiB, 0, main);  // a 12 MiB segment: a second one passes the limit
  auto hold = backend->hold_stream(0, side.handle, SimBackend::HoldRelease::kWhenHostWaits);
  alloc.RecordStream(p, side);
  alloc.Free(p);  // waits for `side`, which is held
  void* q = alloc.Malloc(12 * kMiB, 0, main);
  const auto stats = alloc.FlatStats(0);
  EXPECT_EQ(stats.at("num_sync_all_streams"), 1) << "the ladder's wait ran";
  EXPECT_EQ(q, p) << "the block the wait freed serves the request";
  EXPECT_EQ(stats.at("num_device_free"), 0) << "its segment went back to the device and came again";
  EXPECT_EQ(stats.at("num_device_alloc"), 1);
  alloc.Free(q);
  hold.reset();
}

// Under a watermark (the offload engine's budget) a block still read by another stream, as a
// spill's copy reads it, is awaited before reserved memory grows past the watermark; below it, or
// with no watermark, the allocator takes a new segment and never blocks the host.
TEST(OomLadderTest, PendingBlocksAreAwaitedBeforeReservedPassesTheWatermark) {
  struct Outcome {
    bool reused;
    int64_t waits;
    int64_t device_allocs;
  };
  const auto run = [](std::optional<size_t> watermark) {
    SimBackend::Options options;
    options.capacity_bytes = 64 * kMiB;
    auto backend = std::make_shared<SimBackend>(options);
    CachingAllocator alloc(backend, AllocatorConfig{});
    if (watermark.has_value()) alloc.SetWatermark(0, *watermark);
    const StreamRef main = backend->default_stream(0);
    const StreamRef copy = backend->create_stream(0);
    void* p = alloc.Malloc(12 * kMiB, 0, main);  // a 12 MiB segment
    auto hold = backend->hold_stream(0, copy.handle, SimBackend::HoldRelease::kWhenHostWaits);
    alloc.RecordStream(p, copy);
    alloc.Free(p);  // waits for `copy`, which is held
    void* q = alloc.Malloc(12 * kMiB, 0, main);
    const auto stats = alloc.FlatStats(0);
    const Outcome outcome{q == p, stats.at("num_sync_all_streams"), stats.at("num_device_alloc")};
    alloc.Free(q);
    hold.reset();
    return outcome;
  };
  const Outcome capped = run(16 * kMiB);  // a second segment would reserve 24 MiB
  EXPECT_TRUE(capped.reused) << "the awaited block serves the request";
  EXPECT_EQ(capped.waits, 1);
  EXPECT_EQ(capped.device_allocs, 1);
  for (const std::optional<size_t> watermark :
       {std::optional<size_t>(), std::optional(32 * kMiB)}) {
    const Outcome free_to_grow = run(watermark);
    EXPECT_FALSE(free_to_grow.reused) << "a new segment, without waiting";
    EXPECT_EQ(free_to_grow.waits, 0);
    EXPECT_EQ(free_to_grow.device_allocs, 2);
  }
}

// Where every access to device memory is stream work (CUDA), the awaited block is handed over
// without blocking the host: the allocating stream waits for the copy still reading it.
TEST(OomLadderTest, WhereAccessesFollowStreamsTheAllocatingStreamWaitsInsteadOfTheHost) {
  SimBackend::Options options;
  options.capacity_bytes = 64 * kMiB;
  options.accesses_follow_streams = true;
  auto backend = std::make_shared<SimBackend>(options);
  CachingAllocator alloc(backend, AllocatorConfig{});
  alloc.SetWatermark(0, 16 * kMiB);
  const StreamRef main = backend->default_stream(0);
  const StreamRef copy = backend->create_stream(0);
  constexpr size_t kBytes = 12 * kMiB;
  constexpr size_t kCopied = 64 * kKiB;  // what the copies move: quick, so timing is not close
  const std::vector<uint8_t> before(kCopied, 0xA1);
  const std::vector<uint8_t> after(kCopied, 0xB2);
  void* p = alloc.Malloc(kBytes, 0, main);
  backend->memcpy_async(0, p, before.data(), kCopied, CopyKind::kHostToDevice, main.handle);
  backend->synchronize_stream(0, main.handle);
  // A spill: the copy to the host reads the block on `copy` (held), and the block is freed.
  std::vector<uint8_t> spilled(kCopied);
  // Opened by a wait for the copy: `main`'s once the block is handed over (a host wait would
  // open it too, and the test sees that in num_sync_all_streams).
  auto hold = backend->hold_stream(0, copy.handle, SimBackend::HoldRelease::kWhenWaitedFor);
  backend->memcpy_async(0, spilled.data(), p, kCopied, CopyKind::kDeviceToHost, copy.handle);
  alloc.RecordStream(p, copy);
  alloc.Free(p);

  void* q = alloc.Malloc(kBytes, 0, main);
  EXPECT_EQ(q, p) << "the block still being copied serves the request";
  const auto stats = alloc.FlatStats(0);
  EXPECT_EQ(stats.at("num_sync_all_streams"), 0) << "the host did not wait";
  EXPECT_EQ(stats.at("num_device_alloc"), 1);
  // The new owner writes on `main`, which must wait for the copy. Had it not waited, its write
  // would run with the copy still held, and the hold would stay shut.
  backend->memcpy_async(0, q, after.data(), kCopied, CopyKind::kHostToDevice, main.handle);
  backend->synchronize_stream(0, main.handle);
  EXPECT_TRUE(hold->opened_by_wait()) << "main did not wait for the copy";
  hold->Open();
  backend->synchronize_stream(0, copy.handle);
  EXPECT_TRUE(spilled == before) << "the copy read the block before its new owner wrote it";
  std::vector<uint8_t> now(kCopied);
  backend->memcpy_async(0, now.data(), q, kCopied, CopyKind::kDeviceToHost, main.handle);
  backend->synchronize_stream(0, main.handle);
  EXPECT_TRUE(now == after) << "the new owner's bytes";
  alloc.Free(q);
  hold.reset();
}

// The hand-over takes only blocks of the request's pool kind: a pending small block cannot serve
// a large request, and waiting for its copy would only hold the allocating stream back.
TEST(OomLadderTest, TheHandOverLeavesBlocksOfTheOtherPoolKindPending) {
  SimBackend::Options options;
  options.capacity_bytes = 64 * kMiB;
  options.accesses_follow_streams = true;
  auto backend = std::make_shared<SimBackend>(options);
  CachingAllocator alloc(backend, AllocatorConfig{});
  alloc.SetWatermark(0, kMiB);  // every new segment passes it
  const StreamRef main = backend->default_stream(0);
  const StreamRef copy = backend->create_stream(0);
  void* small = alloc.Malloc(kMiB / 2, 0, main);
  auto hold = backend->hold_stream(0, copy.handle, SimBackend::HoldRelease::kWhenHostWaits);
  alloc.RecordStream(small, copy);
  alloc.Free(small);
  void* large = alloc.Malloc(12 * kMiB, 0, main);
  const auto stats = alloc.FlatStats(0);
  EXPECT_EQ(stats.at("active_bytes.small_pool.current"), static_cast<int64_t>(kMiB / 2))
      << "the small block was handed over to a large request";
  EXPECT_EQ(stats.at("num_sync_all_streams"), 0);
  alloc.Free(large);
  hold.reset();
}

// Under a watermark only as many pending blocks are awaited as the request needs, oldest first:
// a copy stream runs its copies in order, so the oldest is done first, and every further wait
// would hold the allocating stream (or, where kernels run on the host, the host) back for a copy
// the request does not need.
class AwaitOnlyWhatFitsTest : public ::testing::TestWithParam<bool> {};

TEST_P(AwaitOnlyWhatFitsTest, TheOldestPendingBlockServesAndTheOthersStayPending) {
  SimBackend::Options options;
  options.capacity_bytes = 64 * kMiB;
  options.accesses_follow_streams = GetParam();
  auto backend = std::make_shared<SimBackend>(options);
  CachingAllocator alloc(backend, AllocatorConfig{});
  alloc.SetWatermark(0, 16 * kMiB);  // every new segment passes it
  const StreamRef main = backend->default_stream(0);
  const StreamRef copy = backend->create_stream(0);
  constexpr size_t kBytes = 12 * kMiB;
  std::vector<void*> spilled;
  spilled.reserve(3);
  for (int i = 0; i < 3; ++i) spilled.push_back(alloc.Malloc(kBytes, 0, main));
  auto hold = backend->hold_stream(0, copy.handle, SimBackend::HoldRelease::kWhenHostWaits);
  // Freed newest-address first, so the oldest pending block is not the one best fit would pick.
  std::reverse(spilled.begin(), spilled.end());
  for (void* p : spilled) {
    alloc.RecordStream(p, copy);
    alloc.Free(p);
  }
  void* q = alloc.Malloc(kBytes, 0, main);
  EXPECT_EQ(q, spilled.front()) << "the oldest pending block serves the request";
  const auto stats = alloc.FlatStats(0);
  EXPECT_EQ(stats.at("active_bytes.large_pool.current"), static_cast<int64_t>(3 * kBytes))
      << "the two younger blocks were awaited too";
  EXPECT_EQ(stats.at("num_device_alloc"), 3);
  EXPECT_EQ(stats.at("num_sync_all_streams"), GetParam() ? 0 : 1);
  alloc.Free(q);
  hold.reset();
  backend->synchronize_stream(0, copy.handle);
  alloc.EmptyCache();  // polls the events: the younger blocks' copies are done now
  EXPECT_EQ(alloc.FlatStats(0).at("active_bytes.all.current"), 0) << "the others were freed later";
}

INSTANTIATE_TEST_SUITE_P(Backends, AwaitOnlyWhatFitsTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "AccessesFollowStreams" : "HostWaits";
                         });

}  // namespace
}  // namespace spillway::testing
