// Faults injected through the simulated device, one per test: each must surface as a clear error
// at the call it belongs to, corrupt nothing, leak nothing, and leave the engine serving every
// other entry. Streams are held with gates where the order of a copy and a check would otherwise
// be a race, so every outcome here is deterministic.
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "allocator/errors.h"
#include "allocator/format.h"
#include "tests/counting_sim_backend.h"
#include "tests/offload/fault_fixture.h"

namespace spillway::testing {
namespace {

// The device refuses memory for a reload: it is full, and no step of the allocator's
// out-of-memory ladder, nor the engine's rescue, can make room. Acquire must report an
// out-of-memory error naming the storage, leave the entry spilled with its host copy, and
// succeed once memory is there.
TEST_F(OffloadFaultInjection, OffloadDeviceMallocFailureDuringReload) {
  auto [a, b, ida, idb] = SpillOneHoldOne();
  ASSERT_FALSE(HasFailure());

  // Fill the device: a's old segment goes back and a 48 MiB block stays live on the compute
  // stream, so no step of the out-of-memory ladder can make room (nothing is cached, b is held).
  allocator_->EmptyCache();
  void* filler = allocator_->Malloc(48 * kMiB, 0, compute_);
  ASSERT_EQ(backend_->bytes_in_use(0), 64 * kMiB);

  const int64_t failed_before = backend_->num_failed_device_mallocs();
  try {
    engine_->Acquire(ida, compute_);
    ADD_FAILURE() << "Acquire succeeded although the device refused the reload's memory";
  } catch (const OutOfMemoryError& e) {
    EXPECT_TRUE(
        Contains(e.what(), "could not reload a saved storage of " + FormatBytes(12 * kMiB)));
    EXPECT_EQ(e.requested_bytes(), 12 * kMiB);
    EXPECT_EQ(e.device(), 0);
  }
  // Asked, then after the allocator's own steps, after the engine's rescue, after those again.
  EXPECT_EQ(backend_->num_failed_device_mallocs() - failed_before, 4);
  EXPECT_EQ(AllocStat("num_ooms"), 1);

  // Nothing half-done: still spilled with its host copy, no device block kept, no reload counted.
  EXPECT_EQ(StateOf(a), Residency::kSpilled);
  EXPECT_EQ(a->data(), nullptr);
  EXPECT_EQ(EngineStat("spilled_bytes.current"), static_cast<int64_t>(12 * kMiB));
  EXPECT_EQ(EngineStat("host_bytes.current"), static_cast<int64_t>(12 * kMiB));
  EXPECT_EQ(EngineStat("num_reloads"), 0);
  EXPECT_EQ(AllocStat("allocated_bytes.all.current"), static_cast<int64_t>(64 * kMiB));

  EXPECT_EQ(Read(b), Pattern(16 * kMiB, 2));
  // Once the program gives memory back, the same Acquire succeeds.
  allocator_->Free(filler);
  allocator_->EmptyCache();
  EXPECT_EQ(AcquireAndRead(ida, 12 * kMiB), Pattern(12 * kMiB, 1));
  engine_->Synchronize();
  EXPECT_EQ(StateOf(a), Residency::kResident);
  EXPECT_EQ(EngineStat("num_reloads"), 1);
  // The other entry is served as before.
  EXPECT_EQ(AcquireAndRead(idb, 16 * kMiB), Pattern(16 * kMiB, 2));

  a.reset();
  b.reset();
  DropAllAndExpectNoLeaks({ida, idb});
}

// A device malloc that fails once, where a retry would succeed: the ladder's next attempt serves
// the reload. Here the failure hits the attempt made right after the ladder handed a cached
// side-stream segment back to the full device; the attempt after the engine's rescue succeeds.
TEST_F(OffloadFaultInjection, OffloadTransientDeviceMallocFailureDuringReloadIsRetried) {
  auto [a, b, ida, idb] = SpillOneHoldOne();
  ASSERT_FALSE(HasFailure());
  const StreamRef side = backend_->create_stream(0);
  allocator_->EmptyCache();
  void* filler = allocator_->Malloc(36 * kMiB, 0, compute_);
  allocator_->Free(allocator_->Malloc(12 * kMiB, 0, side));  // cached, useless to compute_
  ASSERT_EQ(backend_->bytes_in_use(0), 64 * kMiB);

  const int64_t failed_before = backend_->num_failed_device_mallocs();
  backend_->fail_device_malloc_after(2);  // the attempt after the side segment went back
  EXPECT_EQ(AcquireAndRead(ida, 12 * kMiB), Pattern(12 * kMiB, 1));
  backend_->fail_device_malloc_after(-1);
  EXPECT_EQ(backend_->num_failed_device_mallocs() - failed_before, 2);  // no room, then the fault
  EXPECT_EQ(AllocStat("num_ooms"), 0);
  engine_->Synchronize();
  EXPECT_EQ(StateOf(a), Residency::kResident);
  EXPECT_EQ(EngineStat("num_reloads"), 1);

  allocator_->Free(filler);
  a.reset();
  b.reset();
  DropAllAndExpectNoLeaks({ida, idb});
}

// Pinned memory cannot be had when a spill needs it: the spill is skipped for that reason, the
// entry stays resident with its bytes, and once pinned memory is back both it and new entries
// spill and reload normally.
TEST_F(OffloadFaultInjection, OffloadPinnedAllocationFailureDuringSpill) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(4 * kMiB, 7);
  const KeeperId ida = Save(a);
  a->holders = 0;
  // Enough failures for every attempt the pinned pool makes (a whole chunk, then the exact size).
  backend_->fail_host_malloc(1000);
  engine_->ForwardEnd();
  backend_->fail_host_malloc(0);

  EXPECT_EQ(EngineStat("skipped.no_pinned"), 1);
  EXPECT_EQ(StateOf(a), Residency::kResident);
  EXPECT_EQ(Read(a), Pattern(4 * kMiB, 7));
  EXPECT_EQ(EngineStat("num_spills"), 0);
  EXPECT_EQ(EngineStat("host_bytes.current"), 0);
  EXPECT_EQ(EngineStat("spilled_bytes.current"), 0);
  EXPECT_EQ(engine_->stats().host_reserved_bytes, 0);
  EXPECT_EQ(AllocStat("allocated_bytes.all.current"), static_cast<int64_t>(4 * kMiB));

  // A new entry spills and comes back intact.
  std::shared_ptr<TestStorage> b = NewStorage(2 * kMiB, 8);
  const KeeperId idb = Save(b);
  EndForwardSavesOnly({b});
  EXPECT_EQ(StateOf(b), Residency::kSpilled);
  EXPECT_EQ(AcquireAndRead(idb, 2 * kMiB), Pattern(2 * kMiB, 8));

  // Eager does not retry a refused entry by itself, but the out-of-memory rescue still can.
  EXPECT_GT(engine_->ReleaseMemory(0, 4 * kMiB), 0u);
  EXPECT_EQ(StateOf(a), Residency::kSpilled);
  EXPECT_EQ(AcquireAndRead(ida, 4 * kMiB), Pattern(4 * kMiB, 7));

  a.reset();
  b.reset();
  DropAllAndExpectNoLeaks({ida, idb});
}

// A device-to-host copy fails on the copy stream. The copy runs only after the spill has been
// enqueued completely (the producer stream is held until then), so the failure is found by the
// engine's wait in Synchronize. The entry's bytes are lost: it must become failed, and Acquire
// must say so rather than reload whatever the host buffer held. Every other entry is unaffected.
TEST_F(OffloadFaultInjection, OffloadFailedSpillCopy) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 11);
  std::shared_ptr<TestStorage> b = NewStorage(2 * kMiB, 12);
  std::shared_ptr<TestStorage> c = NewStorage(2 * kMiB, 13);
  const KeeperId ida = Save(a);
  const KeeperId idb = Save(b);
  const KeeperId idc = Save(c);
  EndForwardSavesOnly({b});  // spills cleanly, before any fault
  ASSERT_EQ(StateOf(b), Residency::kSpilled);

  a->holders = 0;
  {
    auto hold = backend_->hold_stream(0, compute_.handle);
    WithNextCopyFailing([&] { engine_->ForwardEnd(); });  // a's device-to-host copy
    ASSERT_EQ(StateOf(a), Residency::kSpilling);
  }
  EXPECT_NO_THROW(engine_->Synchronize()) << "the failure belongs to a's entry, not to the caller";
  EXPECT_EQ(StateOf(a), Residency::kFailed);
  ExpectLost(ida);  // the error is the entry's, every time asked
  EXPECT_EQ(a->data(), nullptr);
  // Released afterwards (spillway.release, which lost saves do not stop): the save still names
  // the copy that lost it.
  engine_->MarkReleased(a.get(), "freed by the test");
  ExpectLost(ida);
  EXPECT_EQ(EngineStat("spilled_bytes.current"), static_cast<int64_t>(2 * kMiB));  // b only

  // The entry spilled before the fault, the one never spilled, and a spill after it are intact.
  EXPECT_EQ(AcquireAndRead(idb, 2 * kMiB), Pattern(2 * kMiB, 12));
  EXPECT_EQ(Read(c), Pattern(2 * kMiB, 13));
  EndForwardSavesOnly({c});
  EXPECT_EQ(StateOf(c), Residency::kSpilled);
  EXPECT_EQ(AcquireAndRead(idc, 2 * kMiB), Pattern(2 * kMiB, 13));

  a.reset();
  b.reset();
  c.reset();
  DropAllAndExpectNoLeaks({ida, idb, idc});
}

// An event call fails while a spill is being enqueued. A first spill makes three: it creates the
// event marking the producer's work, records it, and records the copy-done event after the copy
// was enqueued (the copy-done event reuses the first). Whichever fails, the spill is abandoned
// with its reason counted and the entry stays resident with its bytes; afterwards the entry and
// the engine work normally.
TEST_F(OffloadFaultInjection, OffloadFailedEventDuringSpill) {
  for (int n = 1; n <= 3; ++n) {
    SCOPED_TRACE(::testing::Message() << "event call " << n << " of the spill fails");
    Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
    std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 30 + n);
    const KeeperId ida = Save(a);
    a->holders = 0;
    const size_t copied_before = backend_->bytes_copied(CopyKind::kDeviceToHost);
    backend_->fail_event_after(n);
    engine_->ForwardEnd();
    backend_->fail_event_after(-1);
    engine_->Synchronize();
    // Only the last failure point comes after the copy was enqueued; the copy then ran, reading
    // the still-resident block into a pinned buffer the pool reuses only after it.
    EXPECT_EQ(backend_->bytes_copied(CopyKind::kDeviceToHost) - copied_before,
              n == 3 ? 2 * kMiB : 0u);

    EXPECT_EQ(EngineStat("skipped.copy_error"), 1);
    EXPECT_EQ(StateOf(a), Residency::kResident);
    EXPECT_NE(a->data(), nullptr);
    EXPECT_EQ(Read(a), Pattern(2 * kMiB, 30 + n));
    EXPECT_EQ(EngineStat("num_spills"), 0);
    EXPECT_EQ(EngineStat("host_bytes.current"), 0);
    EXPECT_EQ(EngineStat("spilled_bytes.current"), 0);
    EXPECT_EQ(AllocStat("allocated_bytes.all.current"), static_cast<int64_t>(2 * kMiB));

    // The rescue spills it now, and it comes back intact; so does a new entry.
    EXPECT_GT(engine_->ReleaseMemory(0, 2 * kMiB), 0u);
    EXPECT_EQ(StateOf(a), Residency::kSpilled);
    EXPECT_EQ(AcquireAndRead(ida, 2 * kMiB), Pattern(2 * kMiB, 30 + n));
    std::shared_ptr<TestStorage> b = NewStorage(kMiB, 40 + n);
    const KeeperId idb = Save(b);
    EndForwardSavesOnly({b});
    EXPECT_EQ(StateOf(b), Residency::kSpilled);
    EXPECT_EQ(AcquireAndRead(idb, kMiB), Pattern(kMiB, 40 + n));

    a.reset();
    b.reset();
    DropAllAndExpectNoLeaks({ida, idb});
  }
}

// Event calls that keep failing must not cost an event each: the event taken for a failed record
// goes back to the engine's pool, so a long run with intermittent event failures keeps a constant
// number of events. Each round: a spill whose first event call (the record of the producer's
// work, on a pooled event) fails, the same entry spilled for real, a reload whose first event
// call fails the same way, and the reload for real.
TEST_F(OffloadFaultInjection, OffloadFailedEventRecordsDoNotGrowTheEventPool) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  std::vector<size_t> live_events;
  for (int round = 0; round < 6; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    std::shared_ptr<TestStorage> a = NewStorage(kMiB, 60 + round);
    const KeeperId id = Save(a);
    a->holders = 0;
    if (round > 0) {  // the first round fills the pools
      backend_->fail_event_after(1);
      engine_->ForwardEnd();
      backend_->fail_event_after(-1);
      ASSERT_EQ(StateOf(a), Residency::kResident);
      EXPECT_EQ(EngineStat("skipped.copy_error"), round);
    }
    if (round == 0) {
      engine_->ForwardEnd();
      engine_->Synchronize();
    } else {
      EXPECT_GT(engine_->ReleaseMemory(0, kMiB), 0u);  // a skipped entry waits for the rescue
    }
    ASSERT_EQ(StateOf(a), Residency::kSpilled);
    if (round > 0) {  // and a reload whose first event call (the consumer's, pooled) fails
      backend_->fail_event_after(1);
      EXPECT_THROW(engine_->Acquire(id, compute_), BackendError);
      backend_->fail_event_after(-1);
      ASSERT_EQ(StateOf(a), Residency::kSpilled);
    }
    EXPECT_EQ(AcquireAndRead(id, kMiB), Pattern(kMiB, 60 + round));
    a.reset();
    DropAllAndExpectNoLeaks({id});
    live_events.push_back(backend_->num_live_events());
  }
  for (size_t round = 2; round < live_events.size(); ++round) {
    EXPECT_EQ(live_events[round], live_events[1]) << "round " << round;
  }
}

// An event call fails while a reload is being enqueued: it creates the event marking the
// consumer's use of the new block, records it, and records the copy-done event after the
// host-to-device copy was enqueued. Acquire reports the backend error and the entry stays
// spilled. When the copy was already enqueued, the block it writes must not be handed out again
// before the copy ran; the copy stream is held so that the copy provably runs after the next
// allocation on the consumer stream was made and written.
TEST_F(OffloadFaultInjection, OffloadFailedEventDuringReload) {
  for (int n = 1; n <= 3; ++n) {
    SCOPED_TRACE(::testing::Message() << "event call " << n << " of the reload fails");
    Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
    std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 50 + n);
    const KeeperId ida = Save(a);
    EndForwardSavesOnly({a});
    ASSERT_EQ(StateOf(a), Residency::kSpilled);

    auto hold = backend_->hold_stream(0, engine_->h2d_stream_for_testing(0).handle);
    backend_->fail_event_after(n);
    EXPECT_THROW(engine_->Acquire(ida, compute_), BackendError);
    backend_->fail_event_after(-1);
    EXPECT_EQ(StateOf(a), Residency::kSpilled);
    EXPECT_EQ(a->data(), nullptr);
    EXPECT_EQ(EngineStat("num_reloads"), 0);
    EXPECT_EQ(AllocStat("allocated_bytes.all.current"), 0);
    EXPECT_EQ(KernelWriteIntoNextBlock(*hold, 2 * kMiB), std::vector<uint8_t>(2 * kMiB, kFill))
        << "a copy queued by the failed reload wrote into a block handed out again";

    EXPECT_EQ(AcquireAndRead(ida, 2 * kMiB), Pattern(2 * kMiB, 50 + n));
    a.reset();
    DropAllAndExpectNoLeaks({ida});
  }
}

// Not an injected fault but the same hazard without one, found by tests/fuzz/residency_fuzzer:
// an entry reloaded ahead of use (a prefetch) is dropped before anyone acquired it, so no stream
// waited for its host-to-device copy. Whoever allocates its block next must not see the copy
// land after their own writes; the copy stream is held so that the copy provably runs after the
// next allocation on the prefetch's stream was made and written.
TEST_F(OffloadFaultInjection, OffloadDropWhilePrefetchingKeepsTheCopyOrdered) {
  // Stream-ordered, as on a GPU: the next owner's stream waits for the copy, and the drop does
  // not block the host (OffloadIntegrity.ADroppedPrefetchsCopyDoesNotLandOnTheNextOwner covers
  // the host-ordered case).
  accesses_follow_streams_ = true;
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 61);
  std::shared_ptr<TestStorage> b = NewStorage(2 * kMiB, 62);
  const KeeperId ida = Save(a);
  const KeeperId idb = Save(b);
  a->holders = 0;
  EndForwardSavesOnly({b});
  ASSERT_EQ(StateOf(a), Residency::kSpilled);
  ASSERT_EQ(StateOf(b), Residency::kSpilled);

  auto hold = backend_->hold_stream(0, engine_->h2d_stream_for_testing(0).handle);
  void* b_ptr = engine_->Acquire(idb, compute_);  // reloads b, and prefetches a (saved before b)
  ASSERT_EQ(StateOf(a), Residency::kReloading);
  // Backward no longer needs a: the saved tensor and its storage go.
  engine_->RemoveKeeper(ida);
  storages_.erase(std::find(storages_.begin(), storages_.end(), a));
  a.reset();
  EXPECT_EQ(KernelWriteIntoNextBlock(*hold, 2 * kMiB), std::vector<uint8_t>(2 * kMiB, kFill))
      << "the prefetch's copy landed after the next owner of its block wrote there";
  EXPECT_EQ(ReadOn(compute_, b_ptr, 2 * kMiB), Pattern(2 * kMiB, 62));

  b.reset();
  DropAllAndExpectNoLeaks({idb});
}

using OffloadEngineConstruction = WithSimBackend<OffloadEngineTest, FailingMemInfoBackend>;

// The budget fraction of `auto` on a device that already holds memory asks for the device total
// as the engine is made. When that fails, the construction fails and the allocator keeps none of
// the engine's callbacks: the next out-of-memory ladder called into the freed engine (a use after
// free, which the ASan run of this suite reports).
TEST_F(OffloadEngineConstruction, AFailedConstructionLeavesNoCallbackInTheAllocator) {
  engine_.reset();
  void* held = allocator_->Malloc(4 * kMiB, 0, compute_);
  sim_->fail_mem_info = true;
  EXPECT_THROW(OffloadEngine(*allocator_, OffloadConfig{}), BackendError);
  sim_->fail_mem_info = false;
  // Room for it only if something gave memory back: the ladder asks every registered holder.
  EXPECT_THROW(allocator_->Malloc(250 * kMiB, 0, compute_), OutOfMemoryError);
  allocator_->Free(held);
}

}  // namespace
}  // namespace spillway::testing
