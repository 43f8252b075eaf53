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
// Directed tests of the pending-free states and the free's fallbacks when an event cannot be
// created or recorded are in pending_free_test.cc.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "allocator/config.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"
#include "allocator/size_policy.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "gtest/gtest.h"
#include "tests/allocator/byte_pattern.h"
#include "tests/allocator/differential_model.h"
#include "tests/allocator/test_util.h"
#include "tests/sanitizers.h"

namespace spillway {
namespace {

using testing::kKiB;
using testing::kMiB;
using testing::LiveAlloc;
using testing::PendingFree;
using testing::Tally;
constexpr int kNumStreams = 3;  // the streams random operations use
// A fourth stream only the least-segment probe allocates on: it holds no segment between probes,
// so the probe's request always needs a fresh one.
constexpr int kProbeStream = kNumStreams;
constexpr int kAllStreams = kNumStreams + 1;
constexpr size_t kCapacity = 256 * kMiB;
// Copies on other streams touch at most this prefix of a block (keeps the test fast).
constexpr size_t kMaxCopyBytes = 64 * kKiB;

// ---- Byte patterns ------------------------------------------------------------------------------

#if defined(SPILLWAY_UNDER_TSAN)
// ThreadSanitizer shadows every byte copied or compared, which makes patterns over hundreds of
// MiB take minutes: there the pattern covers each allocation's first and last 64 KiB only.
constexpr size_t kPatternSpan = 64 * kKiB;
constexpr int kStepsPerSeed = 2500;
#else
constexpr size_t kPatternSpan = testing::kWholePattern;
constexpr int kStepsPerSeed = 5000;
#endif
constexpr int kProbeEvery = 1000;  // steps between least-segment probes

void FillPattern(void* p, size_t n, uint64_t tag) { testing::FillEnds(p, n, tag, kPatternSpan); }

size_t PatternMismatch(const void* p, size_t n, uint64_t tag) {
  return testing::EndsMismatch(p, n, tag, kPatternSpan);
}

// ---- The test ----------------------------------------------------------------------------------

// An asynchronous copy on another stream and the host buffer it uses, kept until it ran.
struct InflightCopy {
  EventHandle done = nullptr;  // recorded on the stream right after the copy
  std::unique_ptr<unsigned char[]> host;
  size_t bytes = 0;
  bool verify = false;  // device-to-host: the buffer must hold `tag`'s pattern
  uint64_t tag = 0;
};

struct DiffParam {
  const char* name;
  uint64_t seed;
  AllocatorConfig config;
};

void PrintTo(const DiffParam& p, std::ostream* os) { *os << p.name << " seed " << p.seed; }

AllocatorConfig SplitLimitsConfig() {
  AllocatorConfig config;
  config.max_split_size = 6 * kMiB;
  config.roundup_power2_divisions.fill(4);
  return config;
}

class AllocatorDifferentialTest : public ::testing::TestWithParam<DiffParam> {
 protected:
  AllocatorDifferentialTest()
      : rng_(GetParam().seed),
        policy_(GetParam().config),
        backend_(std::make_shared<SimBackend>(
            SimBackend::Options{.devices = 1,
                                .capacity_bytes = kCapacity,
                                .host_capacity_bytes = 0,
                                .max_jitter = std::chrono::microseconds(150),
                                .seed = GetParam().seed})),
        alloc_(backend_, GetParam().config) {
    streams_[0] = backend_->default_stream(0);
    for (int s = 1; s < kAllStreams; ++s) streams_[s] = backend_->create_stream(0);
  }

  ~AllocatorDifferentialTest() override {
    // Let every queued copy finish before host buffers and events go away.
    for (int s = 0; s < kAllStreams; ++s) backend_->synchronize_stream(0, streams_[s].handle);
    for (InflightCopy& c : inflight_) backend_->destroy_event(0, c.done);
    for (auto& [addr, p] : model_.pending) {
      for (EventHandle e : p.markers) backend_->destroy_event(0, e);
    }
  }

  // ---- Randomness ----

  uint64_t Uniform(uint64_t lo, uint64_t hi) {  // inclusive
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_);
  }
  bool Chance(int percent) { return Uniform(0, 99) < static_cast<uint64_t>(percent); }

  size_t RandomSize() {
    static constexpr size_t kEdges[] = {
        1,        511,      512,           513,       kMiB - 1,      kMiB,
        kMiB + 1, 2 * kMiB, 10 * kMiB - 1, 10 * kMiB, 10 * kMiB + 1, 20 * kMiB};
    const uint64_t r = Uniform(0, 999);
    if (r < 20) return kEdges[Uniform(0, std::size(kEdges) - 1)];
    if (r < 450) return Uniform(1, size_t{1} << Uniform(0, 12));  // up to 4 KiB, log-skewed
    if (r < 750) return Uniform(4 * kKiB, 256 * kKiB);
    if (r < 900) return Uniform(256 * kKiB, kMiB);
    if (r < 975) return Uniform(kMiB, 10 * kMiB);
    return Uniform(10 * kMiB, 30 * kMiB);
  }

  int RandomStream() { return static_cast<int>(Uniform(0, kNumStreams - 1)); }
  int OtherStream(int s) {
    return (s + 1 + static_cast<int>(Uniform(0, kNumStreams - 2))) % kNumStreams;
  }

  std::map<uintptr_t, LiveAlloc>::iterator RandomLive() {
    return std::next(model_.live.begin(),
                     static_cast<std::ptrdiff_t>(Uniform(0, model_.live.size() - 1)));
  }

  // ---- Operations ----

  // Returns true when the allocator may have processed stream events during the step.
  bool DoMalloc(size_t size) { return DoMalloc(size, RandomStream()); }

  bool DoMalloc(size_t size, int s) {
    const size_t rounded = policy_.RoundSize(size);
    const PoolKind pool = SizePolicy::PoolFor(rounded);
    const size_t segment_size = FullSegmentSize(rounded);
    const DeviceStats before = alloc_.stats(0);

    // Best fit as the model sees it (valid unless events or the OOM ladder change the pools).
    const BlockSnapshot* best = nullptr;
    for (const SegmentSnapshot& seg : last_.segments) {
      if (seg.stream != streams_[s].id || seg.pool != pool) continue;
      for (const BlockSnapshot& b : seg.blocks) {
        if (b.state != BlockState::kInactive || b.size < rounded) continue;
        if (best == nullptr || b.size < best->size ||
            (b.size == best->size && b.address < best->address)) {
          best = &b;
        }
      }
    }
    std::optional<uintptr_t> predicted;  // nullopt: a new segment
    if (best != nullptr && policy_.AcceptsBlock(best->size, rounded)) predicted = best->address;
    std::set<uintptr_t> old_segments;
    for (const SegmentSnapshot& seg : last_.segments) old_segments.insert(seg.address);
    // Whether PyTorch's segment size fits now (a cached-segment release can only add room).
    const size_t reserved_before = static_cast<size_t>(before.reserved_bytes.all().current);
    const bool full_segment_fits = (limit_ == 0 || reserved_before + segment_size <= limit_) &&
                                   backend_->mem_info(0).free_bytes >= segment_size;

    void* p = nullptr;
    try {
      p = alloc_.Malloc(size, 0, streams_[s]);
    } catch (const OutOfMemoryError& e) {
      ++counts_.ooms;
      CheckOutOfMemory(e, s, rounded, pool, segment_size, before);
      return true;
    }
    ++counts_.mallocs;
    const auto addr = reinterpret_cast<uintptr_t>(p);
    EXPECT_NE(p, nullptr);
    EXPECT_EQ(addr % kMinBlockSize, 0u) << "allocations are 512-byte aligned";

    const std::optional<AllocationInfo> info = alloc_.Lookup(p);
    EXPECT_TRUE(info.has_value());
    if (!info.has_value()) return true;
    EXPECT_EQ(info->requested, size);
    EXPECT_EQ(info->stream.id, streams_[s].id);
    EXPECT_GE(info->size, rounded);
    if (info->size < size) return true;  // writing the pattern would run past the block
    // A small request lands in the large pool only as the out-of-memory ladder's last step.
    if (info->pool != pool) {
      ++counts_.cross_pool;
      EXPECT_EQ(pool, PoolKind::kSmall);
      EXPECT_GT(alloc_.stats(0).num_alloc_retries, before.num_alloc_retries)
          << "a small request took large-pool space before the out-of-memory ladder ran";
    }
    if (info->size > rounded) {
      EXPECT_FALSE(policy_.ShouldSplit(info->pool, info->size, rounded))
          << "block of " << info->size << " for a " << rounded
          << "-byte request should have been split";
    }
    EXPECT_TRUE(policy_.AcceptsBlock(info->size, rounded)) << info->size << " for " << rounded;

    LiveAlloc a{size, info->size, info->pool, s, next_tag_++, {}};
    FillPattern(p, size, a.tag);
    model_.live.emplace(addr, std::move(a));
    ++model_.allocations_total;

    // Verified after the snapshot check, which tells whether pending frees were released.
    malloc_check_ = MallocCheck{addr,
                                rounded,
                                segment_size,
                                full_segment_fits,
                                predicted,
                                std::move(old_segments),
                                before.num_alloc_retries};
    return true;
  }

  void CheckOutOfMemory(const OutOfMemoryError& e, int s, size_t rounded, PoolKind pool,
                        size_t segment_size, const DeviceStats& before) {
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
    const size_t smallest = SizePolicy::SmallestSegmentSize(rounded);
    const size_t least = policy_.AcceptsBlock(smallest, rounded) ? smallest : segment_size;
    const size_t reserved = static_cast<size_t>(after.reserved_bytes.all().current);
    const bool over_limit = limit_ != 0 && reserved + least > limit_;
    const bool no_room = backend_->mem_info(0).free_bytes < least;
    EXPECT_TRUE(over_limit || no_room)
        << "OOM for a " << least << "-byte segment with " << backend_->mem_info(0).free_bytes
        << " bytes free on the device, reserved " << reserved << ", limit " << limit_;
  }

  // `verify`: check the pattern first (not while copies may be writing the block).
  void DoFree(std::map<uintptr_t, LiveAlloc>::iterator it, bool verify = true) {
    const uintptr_t addr = it->first;
    LiveAlloc a = std::move(it->second);
    model_.live.erase(it);
    if (verify) VerifyPattern(addr, a);
    PendingFree pending{a.requested, a.block_size, a.pool, a.stream, a.uses, {}};
    for (int u : a.uses) {
      EventHandle marker = backend_->create_event(0);
      backend_->record_event(0, marker, streams_[u].handle);
      pending.markers.push_back(marker);
    }
    alloc_.Free(reinterpret_cast<void*>(addr));
    ++counts_.frees;
    ++model_.frees_total;
    if (!a.uses.empty()) {
      ++counts_.pending_frees;
      model_.pending.emplace(addr, std::move(pending));
    }
  }

  // Enqueues on stream `u` a copy of the first bytes of `addr` into a host buffer; verified once
  // the copy ran.
  void EnqueueReadBack(uintptr_t addr, const LiveAlloc& a, int u) {
    InflightCopy c;
    c.bytes = std::min(a.requested, kMaxCopyBytes);
    c.host = std::make_unique<unsigned char[]>(c.bytes);
    c.verify = true;
    c.tag = a.tag;
    backend_->memcpy_async(0, c.host.get(), reinterpret_cast<const void*>(addr), c.bytes,
                           CopyKind::kDeviceToHost, streams_[u].handle);
    c.done = backend_->create_event(0);
    backend_->record_event(0, c.done, streams_[u].handle);
    inflight_.push_back(std::move(c));
    ++counts_.copies;
  }

  // Enqueues on stream `u` a write of the block's own pattern: harmless while the block is ours,
  // corrupts the next owner if the block is handed out before the copy ran.
  void EnqueueRewrite(uintptr_t addr, const LiveAlloc& a, int u) {
    InflightCopy c;
    c.bytes = std::min(a.requested, kMaxCopyBytes);
    c.host = std::make_unique<unsigned char[]>(c.bytes);
    testing::BytePattern(a.tag).Fill(c.host.get(), 0, c.bytes);
    backend_->memcpy_async(0, reinterpret_cast<void*>(addr), c.host.get(), c.bytes,
                           CopyKind::kHostToDevice, streams_[u].handle);
    c.done = backend_->create_event(0);
    backend_->record_event(0, c.done, streams_[u].handle);
    inflight_.push_back(std::move(c));
    ++counts_.copies;
  }

  void DoRecordStream() {
    auto it = RandomLive();
    const int u = Chance(15) ? it->second.stream : OtherStream(it->second.stream);
    alloc_.RecordStream(reinterpret_cast<void*>(it->first), streams_[u]);
    if (u == it->second.stream) return;  // a no-op: the allocation stream is always waited for
    it->second.uses.insert(u);
    if (Chance(50)) EnqueueReadBack(it->first, it->second, u);
  }

  // A use on another stream right before the free: the pattern must survive until the copies ran.
  // The rewrite goes on the stream of any earlier read-back, so the two never run concurrently.
  void DoUseAndFree() {
    auto it = RandomLive();
    LiveAlloc& a = it->second;
    VerifyPattern(it->first, a);
    const bool rewrite = a.uses.size() <= 1;
    const int u = a.uses.size() == 1 ? *a.uses.begin() : OtherStream(a.stream);
    alloc_.RecordStream(reinterpret_cast<void*>(it->first), streams_[u]);
    a.uses.insert(u);
    EnqueueReadBack(it->first, a, u);
    if (rewrite) EnqueueRewrite(it->first, a, u);
    DoFree(it, /*verify=*/false);
  }

  void DoSynchronize(int s) {
    backend_->synchronize_stream(0, streams_[s].handle);
    for (auto& [addr, p] : model_.pending) p.outstanding.erase(s);
    ++counts_.syncs;
  }

  // Returns true when the allocator may have processed stream events.
  bool DoPressure() {
    if (Chance(50)) return DoMalloc(Uniform(64 * kMiB, 320 * kMiB));
    if (limit_ == 0) {
      const auto reserved = static_cast<size_t>(alloc_.stats(0).reserved_bytes.all().current);
      limit_ = reserved + Uniform(0, 32) * kMiB + 1;
      limit_steps_left_ = 200;
      ++counts_.limits;
    } else {
      limit_ = 0;
    }
    alloc_.SetMemoryLimit(limit_, 0);
    EXPECT_EQ(alloc_.memory_limit(0), limit_);
    return false;
  }

  // PyTorch's segment size, unless what it leaves beside the request is a block no request below
  // max_split_size may take (max_split_size under 20 MiB): then the least segment, in steps of
  // 2 MiB, that the request may take whole or that splits into it and a usable remainder.
  size_t FullSegmentSize(size_t rounded) const {
    const size_t max_split = policy_.max_split_size();
    const size_t pytorch_size = SizePolicy::SegmentSize(rounded);
    if (rounded >= max_split || pytorch_size - rounded < max_split) return pytorch_size;
    for (size_t size = SizePolicy::SmallestSegmentSize(rounded); size < pytorch_size;
         size += kRoundLarge) {
      const size_t remainder = size - rounded;
      if (size < max_split || (remainder > kSmallSize && remainder < max_split)) return size;
    }
    return pytorch_size;
  }

  // Directed: a mid-size request (PyTorch gives it a 20 MiB segment) under a memory limit that
  // leaves room only for the least segment that holds it must get exactly that segment. Random
  // steps reach this edge only now and then, and how often depends on when pending frees happen
  // to be released, so every run also probes it on purpose, amid whatever the random steps left.
  void DoLeastSegmentProbe() {
    constexpr size_t kRequest = 3 * kMiB;
    const size_t least = SizePolicy::SmallestSegmentSize(policy_.RoundSize(kRequest));
    // Settle everything (no free may be released during the probe's malloc) and make room on the
    // device for the least segment, freeing random allocations if it is that full.
    for (;;) {
      for (int s = 0; s < kNumStreams; ++s) DoSynchronize(s);
      alloc_.ProcessEvents(0);
      alloc_.EmptyCache();
      if (backend_->mem_info(0).free_bytes >= least || model_.live.empty()) break;
      DoFree(RandomLive());
    }
    CheckMallocPlacement(CheckAll(true));
    if (HasFailure()) return;

    const size_t saved_limit = limit_;
    limit_ = static_cast<size_t>(alloc_.stats(0).reserved_bytes.all().current) + least;
    alloc_.SetMemoryLimit(limit_, 0);
    const int least_before = counts_.least_segments;
    DoMalloc(kRequest, kProbeStream);
    CheckMallocPlacement(CheckAll(false));
    // (Where the least segment is the full one, the placement check saw its size.)
    const int least_expected = FullSegmentSize(policy_.RoundSize(kRequest)) == least ? 0 : 1;
    EXPECT_EQ(counts_.least_segments, least_before + least_expected)
        << "a " << kRequest << "-byte request with room for only " << least
        << " bytes under the limit did not get a segment of that size";

    // The probe stream keeps no segment: the next probe needs a fresh one again.
    const auto probe = std::find_if(model_.live.begin(), model_.live.end(),
                                    [](const auto& e) { return e.second.stream == kProbeStream; });
    if (probe != model_.live.end()) DoFree(probe);
    alloc_.EmptyCache();
    limit_ = saved_limit;
    alloc_.SetMemoryLimit(limit_, 0);
    ++counts_.probes;
  }

  // Retires copies that have run, checking what the read-backs saw.
  void RetireCopies() {
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      if (!backend_->query_event(0, it->done)) {
        ++it;
        continue;
      }
      if (it->verify) {
        const size_t bad =
            testing::BytePattern(it->tag).FirstMismatch(it->host.get(), 0, it->bytes);
        EXPECT_EQ(bad, it->bytes) << "a copy on another stream read a block (tag " << it->tag
                                  << ") after it was reused: mismatch at byte " << bad;
      }
      backend_->destroy_event(0, it->done);
      it = inflight_.erase(it);
    }
  }

  void VerifyPattern(uintptr_t addr, const LiveAlloc& a) {
    const size_t bad = PatternMismatch(reinterpret_cast<const void*>(addr), a.requested, a.tag);
    EXPECT_EQ(bad, a.requested) << "allocation at " << addr << " (" << a.requested << " bytes, tag "
                                << a.tag << ") corrupted at byte " << bad;
  }

  void VerifyAllPatterns() {
    for (const auto& [addr, a] : model_.live) VerifyPattern(addr, a);
  }

  // ---- The per-step check ----

  // Compares snapshot and statistics with the model (differential_model.h) and the backend.
  // `events_processed`: the step may have completed pending frees. Returns how many pending
  // frees were completed.
  int CheckAll(bool events_processed) {
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

  // Best fit, checked after the snapshot told whether pending frees were released.
  void CheckMallocPlacement(int released) {
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
        EXPECT_EQ(seg->total_size, SizePolicy::SmallestSegmentSize(m.rounded));
        EXPECT_FALSE(m.full_segment_fits)
            << "a smaller segment although " << m.segment_size << " bytes fit";
        ++counts_.least_segments;
      }
    }
  }

  void Run(int steps) {
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

  // Frees everything, waits for every stream, empties the cache: all statistics return to zero.
  void Finish() {
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

  struct MallocCheck {
    uintptr_t addr;
    size_t rounded;
    size_t segment_size;
    bool full_segment_fits;
    std::optional<uintptr_t> predicted;
    std::set<uintptr_t> old_segments;
    int64_t retries_before;
  };
  struct Counts {
    int mallocs = 0, frees = 0, pending_frees = 0, pending_released = 0, ooms = 0, copies = 0,
        syncs = 0, reused = 0, new_segments = 0, empty_caches = 0, drains = 0, limits = 0,
        cross_pool = 0, least_segments = 0, probes = 0;
  };

  std::mt19937_64 rng_;
  const SizePolicy policy_;
  std::shared_ptr<SimBackend> backend_;
  CachingAllocator alloc_;
  std::array<StreamRef, kAllStreams> streams_;

  testing::ReferenceModel model_;
  std::vector<InflightCopy> inflight_;
  Snapshot last_;
  std::optional<MallocCheck> malloc_check_;
  uint64_t next_tag_ = 1;
  size_t limit_ = 0;
  int limit_steps_left_ = 0;
  Counts counts_;
};

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

}  // namespace
}  // namespace spillway
