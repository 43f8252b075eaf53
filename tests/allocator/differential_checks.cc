// The checks of the differential test (differential_test.cc): an out-of-memory error's
// justification, what copies on other streams saw, the byte patterns of live allocations, the
// per-step comparison of snapshot and statistics with the reference model and the best-fit
// placement of the last malloc, and the final drain to zero.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>

#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "allocator/errors.h"
#include "allocator/size_policy.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "gtest/gtest.h"
#include "tests/allocator/byte_pattern.h"
#include "tests/allocator/differential_fixture.h"
#include "tests/allocator/differential_model.h"

namespace spillway::testing {

// ---- Out of memory ----

void AllocatorDifferentialTest::CheckOutOfMemory(const OutOfMemoryError& e, int s, size_t rounded,
                                                 PoolKind pool, size_t segment_size,
                                                 const DeviceStats& before) {
  const DeviceStats after = alloc_.stats(0);
  EXPECT_EQ(after.num_ooms, before.num_ooms + 1);
  EXPECT_EQ(e.device(), 0);
  const Snapshot snap = alloc_.TakeSnapshot();
  for (const SegmentSnapshot& seg : snap.segments) {
    // The ladder waited for every stream use and released every wholly free segment...
    EXPECT_FALSE(seg.blocks.size() == 1 && seg.blocks[0].state == BlockState::kInactive)
        << "OOM with a cached free segment of " << seg.total_size << " bytes still held";
    for (const BlockSnapshot& b : seg.blocks) {
      EXPECT_TRUE(b.state != BlockState::kActivePendingFree)
          << "OOM with a pending free left at " << b.address;
      // ...and no cached block could serve the request.
      // (A small request may use the large pool as a last resort.)
      const bool usable_pool =
          seg.pool == pool || (pool == PoolKind::kSmall && seg.pool == PoolKind::kLarge);
      if (seg.stream == streams_[s].id && usable_pool && b.state == BlockState::kInactive &&
          b.size >= rounded) {
        EXPECT_FALSE(policy_.AcceptsBlock(b.size, rounded))
            << "OOM although the free block at " << b.address << " of " << b.size
            << " bytes could serve " << rounded;
      }
    }
  }
  // ...and the backend really had no room (or the limit forbade it) for the least segment the
  // allocator may take: the one that holds just the request, unless its block would break the
  // oversize rule.
  const size_t smallest = policy_.SmallestSegmentSize(rounded);
  const size_t least = policy_.AcceptsBlock(smallest, rounded) ? smallest : segment_size;
  const size_t reserved = static_cast<size_t>(after.reserved_bytes.all().current);
  const bool over_limit = limit_ != 0 && reserved + least > limit_;
  const bool no_room = backend_->mem_info(0).free_bytes < least;
  EXPECT_TRUE(over_limit || no_room)
      << "OOM for a " << least << "-byte segment with " << backend_->mem_info(0).free_bytes
      << " bytes free on the device, reserved " << reserved << ", limit " << limit_;
}

// ---- Copies and byte patterns ----

void AllocatorDifferentialTest::RetireCopies() {
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    if (!backend_->query_event(0, it->done)) {
      ++it;
      continue;
    }
    if (it->verify) {
      const size_t bad = testing::BytePattern(it->tag).FirstMismatch(it->host.get(), 0, it->bytes);
      EXPECT_EQ(bad, it->bytes) << "a copy on another stream read a block (tag " << it->tag
                                << ") after it was reused: mismatch at byte " << bad;
    }
    backend_->destroy_event(0, it->done);
    it = inflight_.erase(it);
  }
}

void AllocatorDifferentialTest::VerifyPattern(uintptr_t addr, const LiveAlloc& a) {
  const size_t bad = AllocPatternMismatch(reinterpret_cast<const void*>(addr), a.requested, a.tag);
  EXPECT_EQ(bad, a.requested) << "allocation at " << addr << " (" << a.requested << " bytes, tag "
                              << a.tag << ") corrupted at byte " << bad;
}

void AllocatorDifferentialTest::VerifyAllPatterns() {
  for (const auto& [addr, a] : model_.live) VerifyPattern(addr, a);
}

// ---- The per-step check ----

int AllocatorDifferentialTest::CheckAll(bool events_processed) {
  last_ = alloc_.TakeSnapshot();
  const DeviceStats stats = alloc_.stats(0);
  const Tally tally = model_.Reconcile(last_, stats, events_processed, streams_, *backend_);
  counts_.pending_released += tally.released;
  // The allocator is the backend's only user: what it reserved is what the device has out.
  EXPECT_EQ(backend_->bytes_in_use(0), static_cast<size_t>(tally.reserved_bytes));
  EXPECT_EQ(stats.num_device_alloc, backend_->num_device_mallocs());
  EXPECT_EQ(stats.num_device_free, backend_->num_device_frees());
  EXPECT_EQ(alloc_.LargestFreeBlock(0), tally.largest_free);
  return tally.released;
}

void AllocatorDifferentialTest::CheckMallocPlacement(int released) {
  if (!malloc_check_.has_value()) return;
  const MallocCheck m = std::move(*malloc_check_);
  malloc_check_.reset();
  // Against the model after reconciliation: blocks released during the malloc may be reused.
  if (auto it = model_.live.find(m.addr); it != model_.live.end())
    model_.CheckNoOverlap(m.addr, it->second.block_size);
  if (released > 0) return;  // released blocks joined the pools: the prediction is stale
  if (alloc_.stats(0).num_alloc_retries != m.retries_before) return;  // the OOM ladder ran
  const SegmentSnapshot* seg = nullptr;
  for (const SegmentSnapshot& s : last_.segments) {
    if (m.addr >= s.address && m.addr < s.address + s.total_size) seg = &s;
  }
  ASSERT_NE(seg, nullptr);
  if (m.predicted.has_value()) {
    ++counts_.reused;
    EXPECT_EQ(m.addr, *m.predicted) << "not the best-fit block for " << m.rounded << " bytes";
  } else {
    ++counts_.new_segments;
    EXPECT_EQ(m.addr, seg->address) << "expected a fresh segment";
    EXPECT_EQ(m.old_segments.count(seg->address), 0u) << "expected a fresh segment";
    // PyTorch's segment size, or, only when that did not fit, the least that holds the request.
    if (seg->total_size != m.segment_size) {
      EXPECT_EQ(seg->total_size, policy_.SmallestSegmentSize(m.rounded));
      EXPECT_FALSE(m.full_segment_fits)
          << "a smaller segment although " << m.segment_size << " bytes fit";
      ++counts_.least_segments;
    }
  }
}

// ---- The end of a run ----

void AllocatorDifferentialTest::Finish() {
  VerifyAllPatterns();
  while (!model_.live.empty()) DoFree(model_.live.begin());
  for (int s = 0; s < kNumStreams; ++s) DoSynchronize(s);
  alloc_.EmptyCache();
  CheckAll(true);
  RetireCopies();
  EXPECT_TRUE(inflight_.empty());
  EXPECT_TRUE(model_.pending.empty());
  const DeviceStats stats = alloc_.stats(0);
  EXPECT_EQ(stats.allocation.all().current, 0);
  EXPECT_EQ(stats.active.all().current, 0);
  EXPECT_EQ(stats.requested_bytes.all().current, 0);
  EXPECT_EQ(stats.reserved_bytes.all().current, 0);
  EXPECT_EQ(stats.segment.all().current, 0);
  EXPECT_EQ(backend_->bytes_in_use(0), 0u);
}

}  // namespace spillway::testing
