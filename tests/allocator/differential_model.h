// The reference model of the randomized differential test (differential_test.cc): what the test
// believes is live and awaiting stream events, and the check of the allocator's snapshot and
// statistics against that belief after every step.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <set>
#include <span>
#include <vector>

#include "allocator/backend.h"
#include "allocator/size_policy.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "gtest/gtest.h"

namespace spillway::testing {

// An allocation the test holds. `stream` and `uses` are indices into the test's streams.
struct LiveAlloc {
  size_t requested = 0;
  size_t block_size = 0;  // what the allocator handed out (>= the rounded request)
  PoolKind pool = PoolKind::kSmall;
  int stream = 0;
  uint64_t tag = 0;
  std::set<int> uses;  // streams other than `stream` named by record_stream
};

// A free that must wait for work on other streams.
struct PendingFree {
  size_t requested = 0;
  size_t block_size = 0;
  PoolKind pool = PoolKind::kSmall;
  int stream = 0;
  // Use streams not synchronized since the free: once empty, the next event processing must
  // release the block.
  std::set<int> outstanding;
  // Recorded on every use stream just before the free, so each completes no later than the
  // allocator's own event: a released block must find all of them complete.
  std::vector<EventHandle> markers;
};

// What the device must look like in terms of the model's own bookkeeping.
struct Tally {
  int released = 0;  // pending frees the allocator completed since the last check
  int64_t reserved_bytes = 0;
  size_t largest_free = 0;
};

class ReferenceModel {
 public:
  // Checks `snap` and `stats` against the model and brings the model up to date (pending frees
  // the allocator completed leave it). `events_processed`: the step may have completed pending
  // frees. `streams[i]` is the stream the model calls i.
  Tally Reconcile(const Snapshot& snap, const DeviceStats& stats, bool events_processed,
                  std::span<const StreamRef> streams, Backend& backend) {
    Expected exp;
    std::map<uintptr_t, const BlockSnapshot*> allocated, pending_blocks;
    std::map<uintptr_t, const SegmentSnapshot*> segment_of;
    Tally tally;
    uintptr_t previous_end = 0;

    for (const SegmentSnapshot& seg : snap.segments) {
      const int pi = PoolIndex(seg.pool);
      EXPECT_EQ(seg.device, 0);
      EXPECT_GE(seg.address, previous_end) << "segments overlap";
      previous_end = seg.address + seg.total_size;
      if (seg.pool == PoolKind::kSmall) {
        EXPECT_EQ(seg.total_size, kSmallBuffer);
      } else {
        // kLargeBuffer, or the request rounded to 2 MiB (at least kMinLargeAlloc, or less when
        // PyTorch's size did not fit).
        EXPECT_TRUE(seg.total_size > 0 && seg.total_size % kRoundLarge == 0)
            << "large segment of " << seg.total_size << " bytes";
      }
      for (int i : {0, pi}) {
        exp.segment[i] += 1;
        exp.reserved_bytes[i] += static_cast<int64_t>(seg.total_size);
      }
      EXPECT_FALSE(seg.blocks.empty());
      uintptr_t cursor = seg.address;
      size_t allocated_size = 0, active_size = 0, requested_size = 0;
      bool previous_inactive = false;
      for (const BlockSnapshot& b : seg.blocks) {
        EXPECT_EQ(b.address, cursor)
            << "blocks of the segment at " << seg.address << " are not contiguous";
        EXPECT_GT(b.size, 0u);
        EXPECT_EQ(b.size % kMinBlockSize, 0u);
        cursor = b.address + b.size;
        const bool inactive = b.state == BlockState::kInactive;
        EXPECT_FALSE(inactive && previous_inactive)
            << "two adjacent free blocks at " << b.address << " were not merged";
        previous_inactive = inactive;
        switch (b.state) {
          case BlockState::kActiveAllocated:
            allocated.emplace(b.address, &b);
            segment_of.emplace(b.address, &seg);
            allocated_size += b.size;
            active_size += b.size;
            requested_size += b.requested_size;
            break;
          case BlockState::kActivePendingFree:
            pending_blocks.emplace(b.address, &b);
            active_size += b.size;
            requested_size += b.requested_size;
            break;
          case BlockState::kInactive:
            EXPECT_EQ(b.requested_size, 0u) << "free block at " << b.address;
            tally.largest_free = std::max(tally.largest_free, b.size);
            if (seg.blocks.size() > 1) {
              for (int i : {0, pi}) {
                exp.inactive_split[i] += 1;
                exp.inactive_split_bytes[i] += static_cast<int64_t>(b.size);
              }
            }
            break;
        }
      }
      EXPECT_EQ(cursor, seg.address + seg.total_size)
          << "blocks of the segment at " << seg.address << " do not add up to its size";
      EXPECT_EQ(seg.allocated_size, allocated_size);
      EXPECT_EQ(seg.active_size, active_size);
      EXPECT_EQ(seg.requested_size, requested_size);
    }

    // Live set == active_allocated blocks.
    EXPECT_EQ(allocated.size(), live.size()) << "snapshot and model disagree on the live set";
    for (const auto& [addr, a] : live) {
      auto it = allocated.find(addr);
      if (it == allocated.end()) {
        ADD_FAILURE() << "live allocation at " << addr
                      << " is not active_allocated in the snapshot";
        continue;
      }
      EXPECT_EQ(it->second->size, a.block_size);
      EXPECT_EQ(it->second->requested_size, a.requested);
      const SegmentSnapshot& seg = *segment_of.at(addr);
      EXPECT_EQ(seg.stream, streams[a.stream].id) << "allocation lives in another stream's segment";
      EXPECT_EQ(seg.pool, a.pool);
      for (int i : {0, PoolIndex(a.pool)}) {
        exp.allocation[i] += 1;
        exp.allocated_bytes[i] += static_cast<int64_t>(a.block_size);
        exp.requested_bytes[i] += static_cast<int64_t>(a.requested);
        exp.active[i] += 1;
        exp.active_bytes[i] += static_cast<int64_t>(a.block_size);
      }
    }

    // Pending frees: still pending, or released by event processing once their uses completed.
    for (auto it = pending.begin(); it != pending.end();) {
      PendingFree& p = it->second;
      auto found = pending_blocks.find(it->first);
      if (found != pending_blocks.end() && found->second->size == p.block_size) {
        EXPECT_FALSE(events_processed && p.outstanding.empty())
            << "block at " << it->first
            << " still pending although every use stream was synchronized and events processed";
        // Still counted in requested_bytes, and the snapshot says so too.
        EXPECT_EQ(found->second->requested_size, p.requested) << "pending block at " << it->first;
        for (int i : {0, PoolIndex(p.pool)}) {
          exp.requested_bytes[i] += static_cast<int64_t>(p.requested);
          exp.active[i] += 1;
          exp.active_bytes[i] += static_cast<int64_t>(p.block_size);
        }
        ++it;
        continue;
      }
      EXPECT_TRUE(events_processed)
          << "block at " << it->first << " left active_pending_free without event processing";
      for (EventHandle marker : p.markers) {
        EXPECT_TRUE(backend.query_event(0, marker))
            << "block at " << it->first << " released before work on a use stream completed";
        backend.destroy_event(0, marker);
      }
      ++tally.released;
      it = pending.erase(it);
    }
    EXPECT_EQ(pending_blocks.size(), pending.size()) << "unexpected active_pending_free blocks";

    CheckStat("allocation", stats.allocation, exp.allocation);
    CheckStat("allocated_bytes", stats.allocated_bytes, exp.allocated_bytes);
    CheckStat("requested_bytes", stats.requested_bytes, exp.requested_bytes);
    CheckStat("active", stats.active, exp.active);
    CheckStat("active_bytes", stats.active_bytes, exp.active_bytes);
    CheckStat("segment", stats.segment, exp.segment);
    CheckStat("reserved_bytes", stats.reserved_bytes, exp.reserved_bytes);
    CheckStat("inactive_split", stats.inactive_split, exp.inactive_split);
    CheckStat("inactive_split_bytes", stats.inactive_split_bytes, exp.inactive_split_bytes);

    peak_allocation_ = std::max(peak_allocation_, exp.allocation[0]);
    peak_allocated_bytes_ = std::max(peak_allocated_bytes_, exp.allocated_bytes[0]);
    peak_reserved_bytes_ = std::max(peak_reserved_bytes_, exp.reserved_bytes[0]);
    peak_active_ = std::max(peak_active_, exp.active[0]);
    EXPECT_EQ(stats.allocation.all().peak, peak_allocation_);
    EXPECT_EQ(stats.allocated_bytes.all().peak, peak_allocated_bytes_);
    EXPECT_EQ(stats.reserved_bytes.all().peak, peak_reserved_bytes_);
    EXPECT_EQ(stats.active.all().peak, peak_active_);
    EXPECT_EQ(stats.allocation.all().allocated, allocations_total);
    EXPECT_EQ(stats.allocation.all().freed, frees_total);
    tally.reserved_bytes = exp.reserved_bytes[0];
    return tally;
  }

  // [addr, addr + size) is the live block at `addr`: no other live block and no block awaiting
  // stream events may overlap it.
  void CheckNoOverlap(uintptr_t addr, size_t size) const {
    auto it_live = live.find(addr);
    ASSERT_NE(it_live, live.end());
    if (std::next(it_live) != live.end()) {
      EXPECT_GE(std::next(it_live)->first, addr + size)
          << "block [" << addr << ", +" << size << ") overlaps the live block at "
          << std::next(it_live)->first;
    }
    if (it_live != live.begin()) {
      const auto& [prev_addr, prev] = *std::prev(it_live);
      EXPECT_LE(prev_addr + prev.block_size, addr)
          << "block at " << addr << " overlaps the live block [" << prev_addr << ", +"
          << prev.block_size << ")";
    }
    auto it = pending.upper_bound(addr);
    if (it != pending.end()) {
      EXPECT_GE(it->first, addr + size) << "block [" << addr << ", +" << size
                                        << ") overlaps the pending-free block at " << it->first;
    }
    if (it != pending.begin()) {
      --it;
      EXPECT_LE(it->first + it->second.block_size, addr)
          << "block at " << addr << " overlaps the pending-free block [" << it->first << ", +"
          << it->second.block_size << ")";
    }
  }

  std::map<uintptr_t, LiveAlloc> live;       // by address
  std::map<uintptr_t, PendingFree> pending;  // by address
  int64_t allocations_total = 0;             // every malloc the test made
  int64_t frees_total = 0;                   // every free the test made

 private:
  // Per pool, in the order of StatArray: all, small, large.
  struct Expected {
    std::array<int64_t, 3> allocation{}, allocated_bytes{}, requested_bytes{}, active{},
        active_bytes{}, segment{}, reserved_bytes{}, inactive_split{}, inactive_split_bytes{};
  };

  static int PoolIndex(PoolKind kind) { return 1 + static_cast<int>(kind); }

  static void CheckStat(const char* name, const StatArray& actual,
                        const std::array<int64_t, 3>& expected) {
    static constexpr const char* kPools[] = {"all", "small_pool", "large_pool"};
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(actual.by_pool[i].current, expected[i]) << name << "." << kPools[i] << ".current";
      EXPECT_GE(actual.by_pool[i].peak, actual.by_pool[i].current) << name << "." << kPools[i];
      EXPECT_EQ(actual.by_pool[i].allocated - actual.by_pool[i].freed, actual.by_pool[i].current)
          << name << "." << kPools[i] << ": allocated - freed != current";
    }
  }

  int64_t peak_allocation_ = 0, peak_allocated_bytes_ = 0, peak_reserved_bytes_ = 0,
          peak_active_ = 0;
};

}  // namespace spillway::testing
