// Statistics (PyTorch's names and meanings, resets) and the history ring.
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "allocator/errors.h"
#include "tests/allocator/sim_fixture.h"
#include "tests/counting_sim_backend.h"

namespace spillway::testing {
namespace {

using StatsHistoryTest = SimAllocatorTest;

TEST_F(StatsHistoryTest, FlatStatsHaveEveryPyTorchKey) {
  const auto stats = allocator_->FlatStats(0);
  for (const char* array :
       {"allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
        "active_bytes", "inactive_split_bytes", "requested_bytes"}) {
    for (const char* pool : {"all", "small_pool", "large_pool"}) {
      for (const char* field : {"current", "peak", "allocated", "freed"}) {
        const std::string key = std::string(array) + "." + pool + "." + field;
        EXPECT_TRUE(stats.contains(key)) << key;
      }
    }
  }
  for (const char* stat : {"oversize_allocations", "oversize_segments"}) {
    for (const char* field : {"current", "peak", "allocated", "freed"}) {
      const std::string key = std::string(stat) + "." + field;
      EXPECT_TRUE(stats.contains(key)) << key;
    }
  }
  for (const char* counter : {"num_alloc_retries", "num_ooms", "num_sync_all_streams",
                              "num_device_alloc", "num_device_free"}) {
    EXPECT_TRUE(stats.contains(counter)) << counter;
  }
  EXPECT_EQ(stats.at("max_split_size"), -1);  // unlimited, as PyTorch reports it
}

// With max_split_size set, blocks and segments at least that large are counted as oversize (as
// PyTorch counts them): the allocation from its malloc to its free request (even when the free
// then waits for another stream), the segment until it goes back to the device.
TEST_F(StatsHistoryTest, OversizeAllocationsAndSegmentsWithMaxSplitSize) {
  AllocatorConfig config;
  config.max_split_size = 32 * kMiB;
  Reset(config);
  EXPECT_EQ(Stat("max_split_size"), int64_t{32 * kMiB});
  void* small = Alloc(4 * kMiB);  // a 20 MiB segment: below the limit
  void* mid = Alloc(30 * kMiB);   // its own 30 MiB segment: below the limit
  EXPECT_EQ(Stat("oversize_segments.current"), 0);
  EXPECT_EQ(Stat("oversize_allocations.current"), 0);
  void* big = Alloc(40 * kMiB);   // its own 40 MiB segment: both oversize
  void* big2 = Alloc(32 * kMiB);  // exactly the limit counts
  EXPECT_EQ(Stat("oversize_allocations.current"), 2);
  EXPECT_EQ(Stat("oversize_segments.current"), 2);

  // A free that must wait for another stream: no longer allocated at once.
  const StreamRef side = backend_->create_stream(0);
  allocator_->RecordStream(big, side);
  allocator_->Free(big);
  EXPECT_EQ(Stat("oversize_allocations.current"), 1);
  EXPECT_EQ(Stat("oversize_allocations.peak"), 2);
  EXPECT_EQ(Stat("oversize_allocations.freed"), 1);
  EXPECT_EQ(Stat("oversize_segments.current"), 2);  // cached, still reserved
  allocator_->Free(big2);
  allocator_->Free(mid);
  allocator_->Free(small);
  backend_->synchronize_stream(0, side.handle);
  allocator_->EmptyCache();
  EXPECT_EQ(Stat("oversize_allocations.current"), 0);
  EXPECT_EQ(Stat("oversize_segments.current"), 0);
  EXPECT_EQ(Stat("oversize_segments.allocated"), 2);
  EXPECT_EQ(Stat("oversize_segments.freed"), 2);
  EXPECT_EQ(Stat("segment.all.current"), 0);
  allocator_->ResetAccumulatedStats(0);
  allocator_->ResetPeakStats(0);
  EXPECT_EQ(Stat("oversize_segments.allocated"), 0);
  EXPECT_EQ(Stat("oversize_allocations.peak"), 0);
  backend_->destroy_stream(0, side.handle);
}

TEST_F(StatsHistoryTest, NoOversizeWithoutMaxSplitSize) {
  void* big = Alloc(64 * kMiB);
  EXPECT_EQ(Stat("oversize_allocations.current"), 0);
  EXPECT_EQ(Stat("oversize_segments.current"), 0);
  allocator_->Free(big);
}

TEST_F(StatsHistoryTest, CountersFollowAllocationsAndFrees) {
  void* a = Alloc(1000);          // small pool, 1024 bytes
  void* b = Alloc(3 * kMiB + 1);  // large pool
  EXPECT_EQ(Stat("allocation.all.current"), 2);
  EXPECT_EQ(Stat("allocation.small_pool.current"), 1);
  EXPECT_EQ(Stat("allocated_bytes.small_pool.current"), 1024);
  EXPECT_EQ(Stat("allocated_bytes.large_pool.current"), int64_t{3 * kMiB + 512});
  EXPECT_EQ(Stat("requested_bytes.all.current"), int64_t{1000 + 3 * kMiB + 1});
  EXPECT_EQ(Stat("num_device_alloc"), 2);
  allocator_->Free(a);
  allocator_->Free(b);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("allocation.all.allocated"), 2);
  EXPECT_EQ(Stat("allocation.all.freed"), 2);
  EXPECT_EQ(Stat("allocated_bytes.all.peak"), int64_t{1024 + 3 * kMiB + 512});
  EXPECT_EQ(Stat("requested_bytes.all.current"), 0);
  EXPECT_EQ(Stat("active_bytes.all.current"), 0);
}

TEST_F(StatsHistoryTest, ResetPeakAndAccumulated) {
  void* a = Alloc(8 * kMiB);
  allocator_->Free(a);
  EXPECT_EQ(Stat("allocated_bytes.all.peak"), int64_t{8 * kMiB});
  allocator_->ResetPeakStats(0);
  EXPECT_EQ(Stat("allocated_bytes.all.peak"), 0);
  EXPECT_EQ(Stat("reserved_bytes.all.peak"), int64_t{20 * kMiB});  // still reserved
  allocator_->ResetAccumulatedStats(0);
  EXPECT_EQ(Stat("allocation.all.allocated"), 0);
  EXPECT_EQ(Stat("num_device_alloc"), 0);
  EXPECT_EQ(Stat("segment.all.current"), 1);  // current values survive both resets
}

TEST_F(StatsHistoryTest, HistoryRecordsActionsInOrderWithContext) {
  int gathered = 0;
  allocator_->RecordHistory(true, 64, [&]() -> TraceContext {
    ++gathered;
    return std::make_shared<const int>(gathered);
  });
  void* p = Alloc(4096);
  allocator_->Free(p);
  allocator_->EmptyCache();
  const auto trace = allocator_->TakeSnapshot().device_traces.at(0);
  ASSERT_EQ(trace.size(), 5u);
  EXPECT_EQ(trace[0].action, TraceAction::kSegmentAlloc);
  EXPECT_EQ(trace[1].action, TraceAction::kAlloc);
  EXPECT_EQ(trace[1].addr, reinterpret_cast<uintptr_t>(p));
  EXPECT_EQ(trace[1].size, 4096u);
  EXPECT_EQ(trace[1].stream, stream_.id);
  ASSERT_NE(trace[1].context, nullptr);
  EXPECT_EQ(*static_cast<const int*>(trace[1].context.get()), 1);
  EXPECT_EQ(trace[2].action, TraceAction::kFreeRequested);
  EXPECT_EQ(trace[3].action, TraceAction::kFreeCompleted);
  EXPECT_EQ(trace[4].action, TraceAction::kSegmentFree);
  EXPECT_LE(trace[0].time_us, trace[4].time_us);
  EXPECT_EQ(TraceActionName(trace[2].action), "free_requested");
}

// PyTorch's context="all" gathers a context at each free too; context="alloc" only at allocations
// (the gatherer, Python frames under torch, is not even called at a free).
TEST_F(StatsHistoryTest, FreesCarryAContextUnlessOnlyAllocationsAskForOne) {
  for (const bool free_context : {true, false}) {
    SCOPED_TRACE(free_context ? "context at frees" : "context at allocations only");
    int gathered = 0;
    allocator_->RecordHistory(
        true, 64,
        [&]() -> TraceContext {
          ++gathered;
          return std::make_shared<const int>(gathered);
        },
        free_context);
    void* p = Alloc(4096);
    allocator_->Free(p, 0);  // both Free overloads gather the same way
    void* q = Alloc(4096);
    allocator_->Free(q);
    const auto trace = allocator_->TakeSnapshot().device_traces.at(0);
    int allocs = 0;
    int frees = 0;
    for (const TraceEntry& e : trace) {
      if (e.action == TraceAction::kAlloc) {
        ++allocs;
        EXPECT_NE(e.context, nullptr);
      }
      if (e.action == TraceAction::kFreeRequested) {
        ++frees;
        EXPECT_EQ(e.context != nullptr, free_context);
      }
    }
    EXPECT_EQ(allocs, 2);
    EXPECT_EQ(frees, 2);
    EXPECT_EQ(gathered, free_context ? 4 : 2);
    allocator_->RecordHistory(false);
  }
}

// The number a test's gatherer put in a context, 0 for none.
int ContextNumber(const TraceContext& context) {
  return context == nullptr ? 0 : *static_cast<const int*>(context.get());
}

// As PyTorch's: free_completed carries the frames of the allocation it ends (PyTorch's viewer
// said "This block has no frames" of every block Spillway freed), and segment_alloc and
// segment_free those of the allocation that made the segment, as the segment itself does; a
// free that waits for another stream included.
TEST_F(StatsHistoryTest, FreeCompletedAndSegmentEventsCarryTheFramesOfTheirAllocation) {
  int gathered = 0;
  allocator_->RecordHistory(
      true, 64, [&]() -> TraceContext { return std::make_shared<const int>(++gathered); },
      /*free_context=*/false);
  void* first = Alloc(4096);   // context 1: makes the segment
  void* second = Alloc(4096);  // context 2: in that segment
  const StreamRef side = backend_->create_stream(0);
  allocator_->RecordStream(second, side);
  allocator_->Free(second);  // completes once `side` is past the free
  const Snapshot live = allocator_->TakeSnapshot();
  ASSERT_EQ(live.segments.size(), 1u);
  EXPECT_EQ(ContextNumber(live.segments[0].context), 1);
  backend_->synchronize_stream(0, side.handle);
  allocator_->ProcessEvents(0);
  allocator_->Free(first);
  allocator_->EmptyCache();
  const auto trace = allocator_->TakeSnapshot().device_traces.at(0);
  std::vector<std::tuple<TraceAction, uintptr_t, int>> events;
  for (const TraceEntry& e : trace) {
    events.emplace_back(e.action, e.addr, ContextNumber(e.context));
  }
  const auto a = reinterpret_cast<uintptr_t>(first);
  const auto b = reinterpret_cast<uintptr_t>(second);
  const std::vector<std::tuple<TraceAction, uintptr_t, int>> expected = {
      {TraceAction::kSegmentAlloc, live.segments[0].address, 1},
      {TraceAction::kAlloc, a, 1},
      {TraceAction::kAlloc, b, 2},
      {TraceAction::kFreeRequested, b, 0},  // no context asked for at frees
      {TraceAction::kFreeCompleted, b, 2},
      {TraceAction::kFreeRequested, a, 0},
      {TraceAction::kFreeCompleted, a, 1},
      {TraceAction::kSegmentFree, live.segments[0].address, 1},
  };
  EXPECT_EQ(events, expected);
  backend_->destroy_stream(0, side.handle);
}

// What the layers above learn of an allocation after it was made (saved for backward, spilled,
// reloaded) reaches the history in its free's entries and the snapshot in its live block: only
// while history is recorded, only rising, and forgotten when the block is freed.
TEST_F(StatsHistoryTest, AFreeCarriesTheCategoryItsAllocationWasGiven) {
  void* before = Alloc(4096);
  allocator_->SetTraceCategory(before, TraceCategory::kSavedForBackward);  // not recording: no-op
  allocator_->RecordHistory(true, 64);
  void* spilled = Alloc(4096);
  allocator_->SetTraceCategory(spilled, TraceCategory::kSpilled);
  allocator_->SetTraceCategory(spilled, TraceCategory::kSavedForBackward);  // does not lower it
  void* reloaded = Alloc(4096);
  allocator_->SetTraceCategory(reloaded, TraceCategory::kReloaded);
  int not_allocated = 0;
  allocator_->SetTraceCategory(&not_allocated, TraceCategory::kSpilled);  // ignored
  const Snapshot snap = allocator_->TakeSnapshot();
  for (const SegmentSnapshot& seg : snap.segments) {
    for (const BlockSnapshot& blk : seg.blocks) {
      const auto* at = reinterpret_cast<void*>(blk.address);
      const TraceCategory expected = at == reloaded  ? TraceCategory::kReloaded
                                     : at == spilled ? TraceCategory::kSpilled
                                                     : TraceCategory::kUnknown;
      EXPECT_EQ(blk.category, expected) << blk.address;
    }
  }
  allocator_->Free(spilled);
  allocator_->Free(before);
  void* reused = Alloc(4096);  // the block of one of them, which starts unknown again
  ASSERT_TRUE(reused == spilled || reused == before);
  allocator_->Free(reused);
  allocator_->Free(reloaded);
  const auto trace = allocator_->TakeSnapshot().device_traces.at(0);
  std::vector<std::tuple<TraceAction, uintptr_t, TraceCategory>> frees;
  for (const TraceEntry& e : trace) {
    if (e.action == TraceAction::kFreeRequested || e.action == TraceAction::kFreeCompleted) {
      frees.emplace_back(e.action, e.addr, e.category);
    }
  }
  const auto at = [](void* p) { return reinterpret_cast<uintptr_t>(p); };
  const std::vector<std::tuple<TraceAction, uintptr_t, TraceCategory>> expected = {
      {TraceAction::kFreeRequested, at(spilled), TraceCategory::kSpilled},
      {TraceAction::kFreeCompleted, at(spilled), TraceCategory::kSpilled},
      {TraceAction::kFreeRequested, at(before), TraceCategory::kUnknown},
      {TraceAction::kFreeCompleted, at(before), TraceCategory::kUnknown},
      {TraceAction::kFreeRequested, at(reused), TraceCategory::kUnknown},
      {TraceAction::kFreeCompleted, at(reused), TraceCategory::kUnknown},
      {TraceAction::kFreeRequested, at(reloaded), TraceCategory::kReloaded},
      {TraceAction::kFreeCompleted, at(reloaded), TraceCategory::kReloaded},
  };
  EXPECT_EQ(frees, expected);
  EXPECT_EQ(TraceCategoryName(TraceCategory::kSavedForBackward), "saved_for_backward");
}

// As PyTorch's: an allocation's events carry the caller's size, which memory_viz draws (every
// small tensor showed as 512 bytes, unlike the snapshot's requested_size); a segment's, its size.
TEST_F(StatsHistoryTest, HistoryCarriesTheRequestedSizeOfAnAllocation) {
  allocator_->RecordHistory(true, 64, nullptr);
  void* p = Alloc(1000);
  allocator_->Free(p);
  allocator_->EmptyCache();
  const auto trace = allocator_->TakeSnapshot().device_traces.at(0);
  ASSERT_EQ(trace.size(), 5u);
  EXPECT_EQ(trace[0].size, kSmallBuffer);  // segment_alloc
  for (size_t i = 1; i <= 3; ++i) {
    EXPECT_EQ(trace[i].size, 1000u) << TraceActionName(trace[i].action);
  }
  EXPECT_EQ(trace[4].size, kSmallBuffer);  // segment_free
}

TEST_F(StatsHistoryTest, HistoryRingKeepsTheNewestEntries) {
  allocator_->RecordHistory(true, 4);
  for (int i = 0; i < 10; ++i) allocator_->Free(Alloc(4096));
  const auto trace = allocator_->TakeSnapshot().device_traces.at(0);
  ASSERT_EQ(trace.size(), 4u);
  EXPECT_EQ(trace[0].action, TraceAction::kFreeCompleted);
  EXPECT_EQ(trace[1].action, TraceAction::kAlloc);
  EXPECT_EQ(trace[2].action, TraceAction::kFreeRequested);
  EXPECT_EQ(trace[3].action, TraceAction::kFreeCompleted);
}

// PyTorch's _record_memory_history() asks for sys.maxsize entries by default: the ring grows as
// entries come (it was allocated whole at once: length_error for that, tens of GB per device for
// a large number that could be allocated).
TEST_F(StatsHistoryTest, AHistoryOfAnyMaximumSizeGrowsAsEntriesCome) {
  ASSERT_NO_THROW(allocator_->RecordHistory(true, std::numeric_limits<int64_t>::max()));
  allocator_->Free(Alloc(4096));
  const auto trace = allocator_->TakeSnapshot().device_traces.at(0);
  ASSERT_EQ(trace.size(), 4u);
  EXPECT_EQ(trace[0].action, TraceAction::kSegmentAlloc);
  EXPECT_EQ(trace[3].action, TraceAction::kFreeCompleted);
}

TEST_F(StatsHistoryTest, HistoryOffRecordsNothingAndSkipsTheGatherer) {
  int gathered = 0;
  allocator_->RecordHistory(true, 8, [&]() -> TraceContext {
    ++gathered;
    return nullptr;
  });
  allocator_->RecordHistory(false);
  allocator_->Free(Alloc(4096));
  EXPECT_EQ(gathered, 0);
}

// As PyTorch's allocator does (the `enabled=None` of _record_memory_history): a stop forgets the
// history, so a snapshot after it shows none, and the next recording starts from nothing.
TEST_F(StatsHistoryTest, StoppingTheHistoryClearsIt) {
  allocator_->RecordHistory(true, 100);
  allocator_->Free(Alloc(4096));
  ASSERT_FALSE(allocator_->TakeSnapshot().device_traces.at(0).empty());
  allocator_->RecordHistory(false);
  EXPECT_TRUE(allocator_->TakeSnapshot().device_traces.at(0).empty());
  allocator_->RecordHistory(true, 100);
  allocator_->Free(Alloc(4096));
  const auto trace = allocator_->TakeSnapshot().device_traces.at(0);
  ASSERT_EQ(trace.size(), 3u);  // the block from the cache: no segment event this time
  EXPECT_EQ(trace[0].action, TraceAction::kAlloc);
}

// Segments and trace entries name streams by id; the snapshot also maps each id to the stream's
// handle (what PyTorch's snapshots show), and keeps the mapping after the segments are gone,
// since trace entries still name those streams.
TEST_F(StatsHistoryTest, SnapshotMapsStreamIdsToHandles) {
  allocator_->RecordHistory(true);
  const StreamRef side = backend_->create_stream(0);
  allocator_->Free(Alloc(4096));
  allocator_->Free(Alloc(4096, side));
  const Snapshot live = allocator_->TakeSnapshot();
  ASSERT_EQ(live.segments.size(), 2u);
  for (const SegmentSnapshot& seg : live.segments) {
    EXPECT_TRUE(live.stream_handles.contains(seg.stream)) << seg.stream;
  }
  EXPECT_EQ(live.stream_handles.at(stream_.id), reinterpret_cast<uintptr_t>(stream_.handle));
  EXPECT_EQ(live.stream_handles.at(side.id), reinterpret_cast<uintptr_t>(side.handle));
  EXPECT_NE(stream_.id, side.id);
  allocator_->EmptyCache();
  const Snapshot after = allocator_->TakeSnapshot();
  EXPECT_TRUE(after.segments.empty());
  for (const TraceEntry& e : after.device_traces.at(0)) {
    if (e.action == TraceAction::kOom) continue;
    EXPECT_TRUE(after.stream_handles.contains(e.stream)) << TraceActionName(e.action);
  }
  EXPECT_EQ(after.stream_handles.size(), 2u);
  backend_->destroy_stream(0, side.handle);
}

TEST_F(StatsHistoryTest, SnapshotDescribesSegmentsAndBlocks) {
  void* a = Alloc(1000);
  void* b = Alloc(2000);
  allocator_->Free(a);
  const Snapshot snap = allocator_->TakeSnapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  const SegmentSnapshot& seg = snap.segments[0];
  EXPECT_EQ(seg.total_size, 2 * kMiB);
  EXPECT_EQ(seg.allocated_size, 2048u);
  EXPECT_EQ(seg.requested_size, 2000u);
  EXPECT_EQ(seg.pool, PoolKind::kSmall);
  ASSERT_EQ(seg.blocks.size(), 3u);
  EXPECT_EQ(seg.blocks[0].state, BlockState::kInactive);
  EXPECT_EQ(seg.blocks[1].state, BlockState::kActiveAllocated);
  EXPECT_EQ(seg.blocks[1].address, reinterpret_cast<uintptr_t>(b));
  EXPECT_EQ(BlockStateName(seg.blocks[1].state), "active_allocated");
  size_t total = 0;
  for (const BlockSnapshot& blk : seg.blocks) total += blk.size;
  EXPECT_EQ(total, seg.total_size);
  allocator_->Free(b);
}

TEST_F(StatsHistoryTest, ClearHistoryDropsEntriesAndKeepsRecording) {
  EXPECT_FALSE(allocator_->history_enabled());
  allocator_->RecordHistory(true, 16);
  EXPECT_TRUE(allocator_->history_enabled());
  allocator_->Free(Alloc(4096));
  ASSERT_FALSE(allocator_->TakeSnapshot().device_traces.at(0).empty());
  allocator_->ClearHistory();
  EXPECT_TRUE(allocator_->TakeSnapshot().device_traces.at(0).empty());
  void* p = Alloc(4096);
  const auto trace = allocator_->TakeSnapshot().device_traces.at(0);
  ASSERT_EQ(trace.size(), 1u);
  EXPECT_EQ(trace[0].action, TraceAction::kAlloc);
  allocator_->Free(p);
}

TEST_F(StatsHistoryTest, SegmentOfFindsTheContainingSegmentLiveOrFree) {
  void* a = Alloc(4096);
  void* b = Alloc(8192);  // same 2 MiB small segment, after `a`
  const auto range = allocator_->SegmentOf(static_cast<char*>(b) + 100);
  ASSERT_TRUE(range.has_value());
  EXPECT_EQ(range->base, a);
  EXPECT_EQ(range->size, 2 * kMiB);
  EXPECT_EQ(range->device, 0);
  allocator_->Free(b);
  ASSERT_TRUE(allocator_->SegmentOf(b).has_value());  // free blocks still belong to the segment
  EXPECT_FALSE(allocator_->SegmentOf(static_cast<char*>(a) + 2 * kMiB).has_value());
  int local = 0;
  EXPECT_FALSE(allocator_->SegmentOf(&local).has_value());
  allocator_->Free(a);
  allocator_->EmptyCache();
  EXPECT_FALSE(allocator_->SegmentOf(a).has_value());
}

TEST_F(StatsHistoryTest, MemoryFractionReadsBackAsSet) {
  EXPECT_EQ(allocator_->memory_fraction(0), std::nullopt);
  allocator_->SetMemoryFraction(0.25, 0);
  EXPECT_EQ(allocator_->memory_fraction(0), 0.25);
  EXPECT_EQ(allocator_->memory_limit(0), (size_t{512} << 20) / 4);
}

TEST(DeviceMemoryQueries, OnlyWhenAFractionNeedsTheTotal) {
  auto backend = CountingSimBackend::Make(4, 64 * kMiB);
  CachingAllocator allocator(backend, AllocatorConfig{});
  allocator.Free(allocator.Malloc(4096, 1, backend->default_stream(1)));
  EXPECT_TRUE(backend->mem_info_calls.empty());
  allocator.SetMemoryFraction(0.5, 2);
  EXPECT_EQ(backend->mem_info_calls[2], 1);
  EXPECT_EQ(allocator.memory_limit(2), 32 * kMiB);
  allocator.SetMemoryFraction(0.25, 2);  // the total is asked once
  EXPECT_EQ(backend->mem_info_calls[2], 1);
  EXPECT_EQ(backend->mem_info_calls.count(0) + backend->mem_info_calls.count(3), 0u);
}

// A fraction from the configuration (per_process_memory_fraction) asked every device for its
// total when the allocator was made: on CUDA a context on each GPU of the node, for every rank.
TEST(DeviceMemoryQueries, AConfiguredFractionResolvesOnTheDevicesFirstNeed) {
  auto backend = CountingSimBackend::Make(3, 64 * kMiB);
  AllocatorConfig config;
  config.per_process_memory_fraction = 0.25;  // 16 MiB
  CachingAllocator allocator(backend, config);
  EXPECT_TRUE(backend->mem_info_calls.empty());
  const StreamRef stream = backend->default_stream(1);
  void* a = allocator.Malloc(12 * kMiB, 1, stream);
  EXPECT_THROW(allocator.Malloc(12 * kMiB, 1, stream), OutOfMemoryError);  // past the limit
  EXPECT_EQ(allocator.memory_limit(1), 16 * kMiB);
  EXPECT_EQ(backend->mem_info_calls.count(0) + backend->mem_info_calls.count(2), 0u);
  allocator.Free(a);
}

TEST(DeviceMemoryQueries, AFractionWatermarkResolvesOnTheDevicesFirstMemory) {
  auto backend = CountingSimBackend::Make(3, 64 * kMiB);
  CachingAllocator allocator(backend, AllocatorConfig{});
  // (device, incoming bytes, bytes allocated on it when the handler ran)
  std::vector<std::tuple<int, size_t, int64_t>> pressured;
  allocator.SetPressureHandler([&](int device, size_t incoming) {
    pressured.emplace_back(device, incoming, allocator.stats(device).allocated_bytes.all().current);
  });
  for (int d = 0; d < 3; ++d) allocator.SetWatermarkFraction(d, 0.25);  // 16 MiB
  EXPECT_TRUE(backend->mem_info_calls.empty());
  const StreamRef stream = backend->default_stream(1);
  void* a = allocator.Malloc(12 * kMiB, 1, stream);
  EXPECT_EQ(backend->mem_info_calls[1], 1);
  EXPECT_TRUE(pressured.empty());
  void* b = allocator.Malloc(8 * kMiB + 1, 1, stream);  // 20 MiB allocated > 16 MiB
  // The handler ran before the allocation was made, told what it will take: it can make room.
  EXPECT_EQ(pressured,
            (std::vector<std::tuple<int, size_t, int64_t>>{{1, 8 * kMiB + 512, 12 * kMiB}}));
  EXPECT_EQ(backend->mem_info_calls.size(), 1u);  // devices 0 and 2 were never asked
  allocator.Free(a);
  allocator.Free(b);
  EXPECT_THROW(allocator.SetWatermarkFraction(0, 0.0), InvalidArgumentError);
  EXPECT_THROW(allocator.SetWatermarkFraction(0, 1.5), InvalidArgumentError);
}

}  // namespace
}  // namespace spillway::testing
