// Randomized differential test of the caching allocator against a reference model
// (differential_model.h).
//
// Thousands of random operations (malloc, free, record_stream with real asynchronous copies on
// other streams, stream synchronization, event processing, empty_cache, memory pressure) run
// over three streams of a jittered SimBackend device. After every step the allocator's snapshot
// and statistics are compared with the model:
//  - live allocations never overlap (each other or blocks awaiting stream events) and each lies
//    in a segment of its stream and pool, with the size the size policy allows;
//  - the snapshot's active_allocated blocks are exactly the live set, its active_pending_free
//    blocks exactly the frees still waiting for stream events;
//  - every segment is tiled by contiguous blocks, free neighbours are always merged;
//  - every statistic (PyTorch names) equals what the model and the snapshot say, per pool;
//  - best fit: when nothing else can have changed, a malloc returns exactly the block the
//    (stream, size, address) order predicts, or a fresh segment when none fits;
//  - an out-of-memory error only comes when nothing could have served the request.
//  - every 1000 steps, a directed probe: a mid-size request under a limit with room only for the
//    least segment that holds it gets exactly that segment.
// Data isolation is checked with per-allocation byte patterns, and stream safety with copies
// enqueued on other streams before a free: a copy that reads a block after it was handed out again
// sees the wrong pattern, a copy that writes it corrupts the new owner's pattern.
// The fixture (constants, state, randomness) is in differential_fixture.h, the random operations
// and the least-segment probe in differential_ops.cc, the checks in differential_checks.cc.
// Directed tests of the pending-free states and the free's fallbacks when an event cannot be
// created or recorded are in pending_free_test.cc.
#include <cstddef>
#include <cstdint>
#include <cstdio>

#include "absl/strings/str_format.h"
#include "allocator/config.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "gtest/gtest.h"
#include "tests/allocator/differential_fixture.h"
#include "tests/allocator/test_util.h"
#include "tests/sanitizers.h"

namespace spillway::testing {
namespace {

AllocatorConfig SplitLimitsConfig() {
  AllocatorConfig config;
  config.max_split_size = 6 * kMiB;
  config.roundup_power2_divisions.fill(4);
  return config;
}

}  // namespace

void AllocatorDifferentialTest::Run(int steps) {
  for (int step = 0; step < steps && !HasFailure(); ++step) {
    SCOPED_TRACE(absl::StrFormat("step %d (seed %d)", step, GetParam().seed));
    bool events = false;
    const auto live_bytes = static_cast<size_t>(alloc_.stats(0).allocated_bytes.all().current);
    const bool full = live_bytes > 128 * kMiB || model_.live.size() > 600;
    const uint64_t r = Uniform(0, 999);
    if (step % kProbeEvery == kProbeEvery - 1) {
      DoLeastSegmentProbe();
      events = true;
    } else if (model_.live.empty() || (!full && r < 380)) {
      events = DoMalloc(RandomSize());
    } else if (r < 680) {
      DoFree(RandomLive());
    } else if (r < 790) {
      DoRecordStream();
    } else if (r < 880) {
      DoUseAndFree();
    } else if (r < 925) {
      DoSynchronize(RandomStream());
    } else if (r < 955) {
      alloc_.ProcessEvents(0);
      events = true;
    } else if (r < 970) {
      alloc_.EmptyCache();
      events = true;
      ++counts_.empty_caches;
      for (const SegmentSnapshot& seg : alloc_.TakeSnapshot().segments) {
        EXPECT_FALSE(seg.blocks.size() == 1 && seg.blocks[0].state == BlockState::kInactive)
            << "empty_cache kept a wholly free segment";
      }
    } else if (r < 985) {
      for (int s = 0; s < kNumStreams; ++s) DoSynchronize(s);
      alloc_.ProcessEvents(0);
      events = true;
      ++counts_.drains;
    } else {
      events = DoPressure();
    }
    if (limit_ != 0 && --limit_steps_left_ == 0) {
      limit_ = 0;
      alloc_.SetMemoryLimit(0, 0);
    }
    CheckMallocPlacement(CheckAll(events));
    RetireCopies();
    if (step % 50 == 49) VerifyAllPatterns();
  }
}

TEST_P(AllocatorDifferentialTest, RandomOperationsMatchReferenceModel) {
  Run(kStepsPerSeed);
  if (HasFailure()) return;
  Finish();
  const Counts& c = counts_;
  RecordProperty("mallocs", c.mallocs);
  RecordProperty("pending_frees", c.pending_frees);
  RecordProperty("ooms", c.ooms);
  std::printf(
      "[%s seed %llu] mallocs %d frees %d (pending %d, released by events %d) ooms %d copies %d "
      "syncs %d best-fit reuses %d new segments %d empty_cache %d drains %d limits %d "
      "small-in-large %d least segments %d\n",
      GetParam().name, static_cast<unsigned long long>(GetParam().seed), c.mallocs, c.frees,
      c.pending_frees, c.pending_released, c.ooms, c.copies, c.syncs, c.reused, c.new_segments,
      c.empty_caches, c.drains, c.limits, c.cross_pool, c.least_segments);
  // The run must have exercised what it claims to check.
  EXPECT_GT(c.mallocs, kStepsPerSeed / 5);
  EXPECT_GT(c.pending_frees, kStepsPerSeed / 100);
  EXPECT_GT(c.pending_released, 0);
  EXPECT_GT(c.reused, kStepsPerSeed / 50);
  EXPECT_GT(c.new_segments, 5);
  EXPECT_EQ(c.probes, kStepsPerSeed / kProbeEvery);
#if !defined(SPILLWAY_UNDER_TSAN)
  EXPECT_GT(c.ooms, 0);
#endif
}

INSTANTIATE_TEST_SUITE_P(Seeds, AllocatorDifferentialTest,
                         ::testing::Values(DiffParam{"default", 1, AllocatorConfig{}},
                                           DiffParam{"default", 2, AllocatorConfig{}},
                                           DiffParam{"default", 3, AllocatorConfig{}},
                                           DiffParam{"default", 4, AllocatorConfig{}},
                                           DiffParam{"split_limits", 5, SplitLimitsConfig()},
                                           DiffParam{"split_limits", 6, SplitLimitsConfig()}),
                         [](const ::testing::TestParamInfo<DiffParam>& info) {
                           return absl::StrFormat("%s_seed%d", info.param.name, info.param.seed);
                         });

}  // namespace spillway::testing
