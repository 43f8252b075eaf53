// The random operations of the differential test (differential_test.cc) and its directed
// least-segment probe: each acts on the allocator and brings the reference model up to date.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "allocator/device_allocator.h"
#include "allocator/errors.h"
#include "allocator/size_policy.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "gtest/gtest.h"
#include "tests/allocator/byte_pattern.h"
#include "tests/allocator/differential_fixture.h"
#include "tests/allocator/differential_model.h"
#include "tests/allocator/test_util.h"

namespace spillway::testing {

// ---- Randomness ----

size_t AllocatorDifferentialTest::RandomSize() {
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

// ---- Operations ----

bool AllocatorDifferentialTest::DoMalloc(size_t size, int s) {
  const size_t rounded = policy_.RoundSize(size);
  const PoolKind pool = policy_.PoolFor(rounded);
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
  FillAllocPattern(p, size, a.tag);
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

void AllocatorDifferentialTest::DoFree(std::map<uintptr_t, LiveAlloc>::iterator it, bool verify) {
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

void AllocatorDifferentialTest::EnqueueReadBack(uintptr_t addr, const LiveAlloc& a, int u) {
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

void AllocatorDifferentialTest::EnqueueRewrite(uintptr_t addr, const LiveAlloc& a, int u) {
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

void AllocatorDifferentialTest::DoRecordStream() {
  auto it = RandomLive();
  const int u = Chance(15) ? it->second.stream : OtherStream(it->second.stream);
  alloc_.RecordStream(reinterpret_cast<void*>(it->first), streams_[u]);
  if (u == it->second.stream) return;  // a no-op: the allocation stream is always waited for
  it->second.uses.insert(u);
  if (Chance(50)) EnqueueReadBack(it->first, it->second, u);
}

void AllocatorDifferentialTest::DoUseAndFree() {
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

void AllocatorDifferentialTest::DoSynchronize(int s) {
  backend_->synchronize_stream(0, streams_[s].handle);
  for (auto& [addr, p] : model_.pending) p.outstanding.erase(s);
  ++counts_.syncs;
}

bool AllocatorDifferentialTest::DoPressure() {
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

// ---- The least-segment probe ----

size_t AllocatorDifferentialTest::FullSegmentSize(size_t rounded) const {
  const size_t max_split = policy_.max_split_size();
  const size_t pytorch_size = policy_.SegmentSize(rounded);
  if (rounded >= max_split || pytorch_size - rounded < max_split) return pytorch_size;
  for (size_t size = policy_.SmallestSegmentSize(rounded); size < pytorch_size;
       size += kRoundLarge) {
    const size_t remainder = size - rounded;
    if (size < max_split || (remainder > kSmallSize && remainder < max_split)) return size;
  }
  return pytorch_size;
}

void AllocatorDifferentialTest::DoLeastSegmentProbe() {
  constexpr size_t kRequest = 3 * kMiB;
  const size_t least = policy_.SmallestSegmentSize(policy_.RoundSize(kRequest));
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

}  // namespace spillway::testing
