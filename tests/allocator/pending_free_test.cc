// Directed tests of frees that must wait for other streams: a block freed with a stream use
// stays active_pending_free until event processing releases it, and when the event cannot be
// created or recorded the free falls back to waiting on the host instead of losing the block or
// reusing it early. The randomized differential test covers the same states at random.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <vector>

#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "allocator/config.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"
#include "allocator/snapshot.h"
#include "gtest/gtest.h"
#include "tests/allocator/test_util.h"

namespace spillway::testing {
namespace {

using namespace std::chrono_literals;

// The free took effect at once: nothing allocated, active or requested any more.
void ExpectFreedAtOnce(const CachingAllocator& alloc) {
  const DeviceStats stats = alloc.stats(0);
  EXPECT_EQ(stats.allocation.all().current, 0);
  EXPECT_EQ(stats.active.all().current, 0);
  EXPECT_EQ(stats.active_bytes.all().current, 0);
  EXPECT_EQ(stats.requested_bytes.all().current, 0);
}

// A simulated device without jitter, an allocator over it, and a count of the stream errors the
// allocator passes on to its observer.
struct ObservedAllocator {
  explicit ObservedAllocator(int devices = 1)
      : backend(std::make_shared<SimBackend>(Options(devices))), alloc(backend, AllocatorConfig{}) {
    alloc.SetStreamErrorObserver([this](const StreamError&) { ++errors; });
  }
  static SimBackend::Options Options(int devices) {
    SimBackend::Options options = JitterOptions(0us);
    options.devices = devices;
    return options;
  }
  const std::shared_ptr<SimBackend> backend;
  std::atomic<int> errors{0};
  CachingAllocator alloc;
};

// Directed: a free with a stream use stays active_pending_free, whatever the use stream does,
// until events are processed; once that stream is synchronized, processing releases it.
TEST(PendingFreeTest, PendingFreeReleasedOnlyByEventProcessing) {
  auto backend = std::make_shared<SimBackend>(JitterOptions(2000us));
  CachingAllocator alloc(backend, AllocatorConfig{});
  const StreamRef a = backend->default_stream(0);
  const StreamRef b = backend->create_stream(0);
  auto state_of = [&](void* p) -> std::string {
    for (const SegmentSnapshot& seg : alloc.TakeSnapshot().segments) {
      for (const BlockSnapshot& blk : seg.blocks) {
        if (blk.address == reinterpret_cast<uintptr_t>(p))
          return std::string(BlockStateName(blk.state));
      }
    }
    return "not a block";
  };

  void* p = alloc.Malloc(100 * kKiB, 0, a);
  std::vector<unsigned char> host(100 * kKiB);
  backend->memcpy_async(0, host.data(), p, host.size(), CopyKind::kDeviceToHost, b.handle);
  alloc.RecordStream(p, b);
  EventHandle marker = backend->create_event(0);
  backend->record_event(0, marker, b.handle);
  alloc.Free(p);
  EXPECT_EQ(state_of(p), "active_pending_free");
  EXPECT_EQ(alloc.stats(0).active.all().current, 1);
  EXPECT_EQ(alloc.stats(0).allocation.all().current, 0);
  EXPECT_EQ(alloc.stats(0).requested_bytes.all().current, static_cast<int64_t>(100 * kKiB));
  // Work on b still runs after the free; however far it got, nothing but event processing
  // changes the block's state.
  backend->synchronize_stream(0, b.handle);
  EXPECT_EQ(state_of(p), "active_pending_free");
  EXPECT_TRUE(backend->query_event(0, marker));
  // A malloc processes events first: the block is free again and served back.
  void* q = alloc.Malloc(100 * kKiB, 0, a);
  EXPECT_EQ(q, p);
  EXPECT_EQ(alloc.stats(0).requested_bytes.all().current, static_cast<int64_t>(100 * kKiB));
  alloc.Free(q);
  EXPECT_EQ(state_of(p), "inactive");
  EXPECT_EQ(alloc.stats(0).active.all().current, 0);
  EXPECT_EQ(alloc.stats(0).requested_bytes.all().current, 0);
  backend->destroy_event(0, marker);
}

// When the event for a stream use cannot be recorded, the free waits for that stream on the host
// instead: the block is free at once, not pending and not lost.
TEST(PendingFreeTest, FreeFallsBackToHostWaitWhenEventRecordFails) {
  auto backend = std::make_shared<SimBackend>(JitterOptions(500us));
  CachingAllocator alloc(backend, AllocatorConfig{});
  const StreamRef a = backend->default_stream(0);
  const StreamRef b = backend->create_stream(0);
  // One ordinary pending free first, so the allocator has a spare event and the injected failure
  // below hits record_event rather than create_event.
  void* p = alloc.Malloc(4096, 0, a);
  alloc.RecordStream(p, b);
  alloc.Free(p);
  backend->synchronize_stream(0, b.handle);
  alloc.ProcessEvents(0);
  ASSERT_EQ(alloc.stats(0).active.all().current, 0);

  p = alloc.Malloc(4096, 0, a);
  std::vector<unsigned char> host(4096);
  backend->memcpy_async(0, host.data(), p, host.size(), CopyKind::kDeviceToHost, b.handle);
  EventHandle copied = backend->create_event(0);
  backend->record_event(0, copied, b.handle);
  alloc.RecordStream(p, b);
  backend->fail_event_after(1);
  EXPECT_NO_THROW(alloc.Free(p));
  backend->fail_event_after(-1);
  EXPECT_TRUE(backend->query_event(0, copied)) << "the free did not wait for stream b";
  ExpectFreedAtOnce(alloc);
  EXPECT_EQ(alloc.Malloc(4096, 0, a), p);
  backend->destroy_event(0, copied);
}

// Same when the event cannot even be created (no spare event yet): the block must not be lost
// half-freed, with Free throwing and the block in neither the pool nor the live set.
TEST(PendingFreeTest, FreeFallsBackToHostWaitWhenEventCreationFails) {
  auto backend = std::make_shared<SimBackend>(JitterOptions(0us));
  CachingAllocator alloc(backend, AllocatorConfig{});
  const StreamRef a = backend->default_stream(0);
  const StreamRef b = backend->create_stream(0);
  void* p = alloc.Malloc(4096, 0, a);
  alloc.RecordStream(p, b);
  backend->fail_event_after(1);  // the allocator's first create_event
  EXPECT_NO_THROW(alloc.Free(p));
  backend->fail_event_after(-1);
  ExpectFreedAtOnce(alloc);
  const Snapshot snap = alloc.TakeSnapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  EXPECT_EQ(snap.segments[0].blocks.size(), 1u) << "the freed block was not merged back";
  EXPECT_EQ(alloc.Malloc(4096, 0, a), p) << "the freed block was lost";
  alloc.Free(p);
  alloc.EmptyCache();
  EXPECT_EQ(alloc.stats(0).reserved_bytes.all().current, 0) << "the segment could not be released";
  EXPECT_EQ(backend->bytes_in_use(0), 0u);
}

// A poll that hears of an earlier copy's failure on a stream (the simulated device reports it
// once, to the first call that looks, before looking at the event) says nothing of the stream's
// later work: the block stays pending until the stream has passed its free, and the stream's
// owner hears of the failure.
TEST(PendingFreeTest, AFailureHeardByAPollLeavesTheBlockPending) {
  ObservedAllocator observed;
  auto& [backend, errors, alloc] = observed;
  const StreamRef a = backend->default_stream(0);
  const StreamRef u = backend->create_stream(0);
  void* p = alloc.Malloc(4096, 0, a);
  void* scratch = alloc.Malloc(4096, 0, a);
  std::vector<unsigned char> host(4096);
  auto first_hold = backend->hold_stream(0, u.handle);
  backend->fail_copy_after(1);
  backend->memcpy_async(0, host.data(), scratch, 512, CopyKind::kDeviceToHost, u.handle);
  backend->fail_copy_after(-1);
  backend->memcpy_async(0, host.data(), scratch, 512, CopyKind::kDeviceToHost, u.handle);
  auto second_hold = backend->hold_stream(0, u.handle);
  backend->memcpy_async(0, host.data(), p, 4096, CopyKind::kDeviceToHost, u.handle);  // reads p
  alloc.RecordStream(p, u);
  alloc.Free(p);
  first_hold->Open();
  // The good copy after the failing one has run: the failure is there, u waits at the second gate.
  while (backend->num_copies() < 1) std::this_thread::yield();

  void* q = alloc.Malloc(4096, 0, a);
  EXPECT_NE(q, p) << "p was handed out again while u still had to read it";
  EXPECT_EQ(errors, 1) << "the failure found by the poll did not reach the stream's owner";
  EXPECT_EQ(alloc.stats(0).active.all().current, 3) << "p is no longer pending";
  second_hold->Open();
  backend->synchronize_stream(0, u.handle);
  alloc.Free(q);
  alloc.Free(scratch);
  alloc.ProcessEvents(0);
  ExpectFreedAtOnce(alloc);
}

// A free whose stream use cannot get an event waits on the host; when that wait drains the
// stream and then reports an earlier copy's failure, the stream has passed the free: the block is
// free, Free does not throw, and the failure goes to the stream's owner.
TEST(PendingFreeTest, AHostWaitThatHearsAnEarlierFailureStillFrees) {
  ObservedAllocator observed;
  auto& [backend, errors, alloc] = observed;
  const StreamRef a = backend->default_stream(0);
  const StreamRef b = backend->create_stream(0);
  void* p = alloc.Malloc(4096, 0, a);
  alloc.RecordStream(p, b);
  std::vector<unsigned char> host(4096);
  backend->fail_copy_after(1);
  backend->memcpy_async(0, host.data(), p, host.size(), CopyKind::kDeviceToHost, b.handle);
  backend->fail_copy_after(-1);
  backend->fail_event_after(1);  // the allocator's first create_event: no spare yet
  EXPECT_NO_THROW(alloc.Free(p));
  backend->fail_event_after(-1);
  ExpectFreedAtOnce(alloc);
  EXPECT_EQ(errors, 1);
  EXPECT_EQ(alloc.Malloc(4096, 0, a), p) << "the freed block was lost";
  alloc.Free(p);
  alloc.EmptyCache();
  EXPECT_EQ(backend->bytes_in_use(0), 0u);
}

// record_stream with a stream of another device, as PyTorch allows: the free must wait for that
// stream (here device 1's default stream, held busy). Recorded as one of the block's own device,
// the null handle named device 0's default stream, idle, and the block was reused at once.
TEST(PendingFreeTest, AStreamOfAnotherDeviceHoldsTheFreeBack) {
  ObservedAllocator observed(/*devices=*/2);
  auto& [backend, errors, alloc] = observed;
  const StreamRef a = backend->default_stream(0);
  const StreamRef other = backend->default_stream(1);
  void* p = alloc.Malloc(4096, 0, a);
  EXPECT_THROW(alloc.RecordStream(p, other, 2), InvalidArgumentError);
  // Opened by the free's wait; without one, it stays shut and the free returns.
  auto hold = backend->hold_stream(1, other.handle, SimBackend::HoldRelease::kWhenHostWaits);
  alloc.RecordStream(p, other, 1);
  alloc.RecordStream(p, other, 1);  // once is enough
  alloc.Free(p);
  EXPECT_TRUE(hold->opened_by_wait()) << "the free did not wait for the other device's stream";
  hold->Open();
  ExpectFreedAtOnce(alloc);
  EXPECT_EQ(alloc.Malloc(4096, 0, a), p) << "the freed block was lost";
  alloc.Free(p);  // a new allocation of the block: the old use is gone, nothing waits
  ExpectFreedAtOnce(alloc);
  EXPECT_EQ(errors, 0);
}

// A free whose streams cannot be waited for (here both were destroyed after the use was recorded:
// one of the block's device, one of another device) quarantines the block: it is never handed
// out again, each stream's failure reaches the observer, and the statistics count the block once.
TEST(PendingFreeTest, AStreamThatCannotBeWaitedForQuarantinesTheBlock) {
  ObservedAllocator observed(/*devices=*/2);
  auto& [backend, errors, alloc] = observed;
  const StreamRef a = backend->default_stream(0);
  const StreamRef own = backend->create_stream(0);
  const StreamRef other = backend->create_stream(1);
  void* p = alloc.Malloc(4096, 0, a);
  alloc.RecordStream(p, own);
  alloc.RecordStream(p, other, 1);
  backend->destroy_stream(0, own.handle);
  backend->destroy_stream(1, other.handle);
  EXPECT_NO_THROW(alloc.Free(p));
  EXPECT_EQ(errors, 2) << "each stream that could not be waited for goes to the observer";
  EXPECT_EQ(alloc.stats(0).quarantined_blocks, 1);
  EXPECT_EQ(alloc.stats(0).quarantined_bytes, 4096);
  EXPECT_EQ(alloc.FlatStats(0).at("spillway.quarantined_bytes"), 4096);
  EXPECT_EQ(alloc.stats(0).active.all().current, 1) << "the block left active_pending_free";
  EXPECT_EQ(alloc.stats(0).allocation.all().current, 0);
  alloc.ResetAccumulatedStats(0);
  EXPECT_EQ(alloc.stats(0).quarantined_blocks, 1) << "a reset forgot the quarantined block";
  for (int i = 0; i < 4; ++i) {
    void* q = alloc.Malloc(4096, 0, a);
    EXPECT_NE(q, p) << "the quarantined block was handed out again";
    alloc.Free(q);
  }
}

// A simulated device whose next device_free fails.
class FailingFreeBackend : public SimBackend {
 public:
  using SimBackend::SimBackend;
  void device_free(int device, void* ptr) override {
    if (fail_next_free) {
      fail_next_free = false;
      throw BackendError("device_free", "injected free failure");
    }
    SimBackend::device_free(device, ptr);
  }
  bool fail_next_free = false;
};

// A segment whose device free fails stays cached, whole and reusable: not dropped from the free
// index while still counted as reserved (its space was lost, and a later EmptyCache freed it
// twice).
TEST(PendingFreeTest, ASegmentWhoseDeviceFreeFailsStaysCached) {
  auto backend = std::make_shared<FailingFreeBackend>(JitterOptions(0us));
  CachingAllocator alloc(backend, AllocatorConfig{});
  const StreamRef a = backend->default_stream(0);
  void* p = alloc.Malloc(4 * kMiB, 0, a);
  alloc.Free(p);
  backend->fail_next_free = true;
  EXPECT_THROW(alloc.EmptyCache(), BackendError);
  EXPECT_EQ(alloc.stats(0).reserved_bytes.all().current, static_cast<int64_t>(20 * kMiB));
  const int64_t mallocs = backend->num_device_mallocs();
  EXPECT_EQ(alloc.Malloc(4 * kMiB, 0, a), p);
  EXPECT_EQ(backend->num_device_mallocs(), mallocs) << "the cached segment was not reused";
  alloc.Free(p);
  EXPECT_NO_THROW(alloc.EmptyCache());
  EXPECT_EQ(alloc.stats(0).reserved_bytes.all().current, 0);
  EXPECT_EQ(backend->bytes_in_use(0), 0u);
}

// A release that fails on one device does not keep the others' cached memory: EmptyCache goes on,
// then reports the failure.
TEST(PendingFreeTest, EmptyCacheReleasesTheOtherDevicesWhenOneFails) {
  SimBackend::Options options = JitterOptions(0us);
  options.devices = 2;
  auto backend = std::make_shared<FailingFreeBackend>(options);
  CachingAllocator alloc(backend, AllocatorConfig{});
  for (int device : {0, 1})
    alloc.Free(alloc.Malloc(4 * kMiB, device, backend->default_stream(device)));
  backend->fail_next_free = true;
  EXPECT_THROW(alloc.EmptyCache(), BackendError);
  EXPECT_EQ(alloc.stats(0).reserved_bytes.all().current, static_cast<int64_t>(20 * kMiB));
  EXPECT_EQ(alloc.stats(1).reserved_bytes.all().current, 0) << "device 1 kept its cache";
  EXPECT_EQ(backend->bytes_in_use(1), 0u);
}

// The offload engine takes back a block whose free still waits for a copy reading it (a spill
// backward wants before the copy is done): the block is live again, counted, traced as a completed
// free and an allocation, and its next free waits for the copy's stream again. Only the pending
// free of the allocation the tag names is taken back: not once its free completed (the memory may
// be someone else's by now), not twice, and not another allocation's pending at the same address.
TEST(PendingFreeTest, APendingFreeIsTakenBackWholeAndItsNextFreeWaitsAgain) {
  auto backend = std::make_shared<SimBackend>(JitterOptions(0us));
  CachingAllocator alloc(backend, AllocatorConfig{});
  alloc.RecordHistory(true, 64);
  const StreamRef compute = backend->default_stream(0);
  const StreamRef copy = backend->create_stream(0);
  constexpr size_t kBytes = 3 * kMiB;
  void* p = alloc.Malloc(kBytes, 0, compute);
  const auto block_bytes = static_cast<int64_t>(alloc.Lookup(p)->size);
  EXPECT_EQ(alloc.TagForRevival(&kBytes, 0), 0u) << "a tag for what is no allocation";
  std::vector<unsigned char> host(kBytes);
  {
    auto hold = backend->hold_stream(0, copy.handle);  // the copy reading the block cannot finish
    backend->memcpy_async(0, host.data(), p, kBytes, CopyKind::kDeviceToHost, copy.handle);
    alloc.RecordStream(p, copy);
    const uint64_t tag = alloc.TagForRevival(p, 0);
    ASSERT_NE(tag, 0u);
    alloc.Free(p);
    EXPECT_FALSE(alloc.Lookup(p).has_value());
    EXPECT_FALSE(alloc.Revive(p, 0, tag + 1)) << "another allocation's tag";
    ASSERT_TRUE(alloc.Revive(p, 0, tag));
    EXPECT_FALSE(alloc.Revive(p, 0, tag)) << "taken back twice";
    const DeviceStats stats = alloc.stats(0);
    EXPECT_EQ(stats.allocation.all().current, 1);
    EXPECT_EQ(stats.allocated_bytes.all().current, block_bytes);
    EXPECT_EQ(stats.active.all().current, 1);
    EXPECT_EQ(stats.requested_bytes.all().current, static_cast<int64_t>(kBytes));
    ASSERT_TRUE(alloc.Lookup(p).has_value());
    EXPECT_EQ(alloc.Lookup(p)->stream.id, compute.id);
    // Freed again while the copy still runs: pending again, so a request of its size gets other
    // memory, not the block the copy reads.
    alloc.Free(p);
    void* q = alloc.Malloc(kBytes, 0, compute);
    EXPECT_NE(q, p) << "the block was reused while a copy still read it";
    alloc.Free(q);
  }
  backend->synchronize_stream(0, copy.handle);
  alloc.ProcessEvents(0);
  EXPECT_EQ(alloc.stats(0).active.all().current, 0);

  // p's memory, reused by r and freed pending at the same address: r's, not p's allocation's.
  const uint64_t p_tag = [&] {
    void* again = alloc.Malloc(kBytes, 0, compute);
    EXPECT_EQ(again, p);
    const uint64_t tag = alloc.TagForRevival(again, 0);
    alloc.RecordStream(again, copy);
    alloc.Free(again);
    backend->synchronize_stream(0, copy.handle);
    alloc.ProcessEvents(0);
    return tag;
  }();
  EXPECT_FALSE(alloc.Revive(p, 0, p_tag)) << "a completed free was taken back";
  void* r = alloc.Malloc(kBytes, 0, compute);
  ASSERT_EQ(r, p) << "the block's completed free should make it reusable";
  {
    auto hold = backend->hold_stream(0, copy.handle);
    alloc.RecordStream(r, copy);
    const uint64_t r_tag = alloc.TagForRevival(r, 0);
    alloc.Free(r);
    EXPECT_FALSE(alloc.Revive(p, 0, p_tag)) << "another allocation's pending free was taken back";
    EXPECT_TRUE(alloc.Revive(r, 0, r_tag));
    alloc.Free(r);
  }
  backend->synchronize_stream(0, copy.handle);
  alloc.ProcessEvents(0);
  EXPECT_EQ(alloc.stats(0).active.all().current, 0);
  // What the history says of p's address: allocated, freed (requested), the free completed and
  // the block allocated again, freed again, and so on: a trace PyTorch's viewer replays with
  // nothing of its own.
  std::vector<TraceAction> at_p;
  const Snapshot snapshot = alloc.TakeSnapshot();
  for (const TraceEntry& entry : snapshot.device_traces[0]) {
    if (entry.addr == reinterpret_cast<uintptr_t>(p) &&
        entry.action != TraceAction::kSegmentAlloc) {
      at_p.push_back(entry.action);
    }
  }
  std::vector<TraceAction> expected;
  // p; p taken back; p's memory again (freed at once); r; r taken back.
  for (int cycle = 0; cycle < 5; ++cycle) {
    for (const TraceAction action :
         {TraceAction::kAlloc, TraceAction::kFreeRequested, TraceAction::kFreeCompleted}) {
      expected.push_back(action);
    }
  }
  EXPECT_EQ(at_p, expected);
}

}  // namespace
}  // namespace spillway::testing
