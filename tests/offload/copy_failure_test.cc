// A failed copy belongs to the entries whose bytes passed through it, whoever finds it: the copy
// streams report a failure once, to the first call that looks, which may be a call made for
// another entry, for the allocator, or on another stream altogether. Each test arranges one such
// path with held streams and checks that the right entries fail (their Acquire says so rather
// than return bytes that never arrived) and no other entry does.
#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "allocator/errors.h"
#include "tests/offload/fault_fixture.h"

namespace spillway::testing {
namespace {

class OffloadCopyFailure : public OffloadFaultInjection {
 protected:
  // Runs every op already enqueued on the device's streams, without asking any of them for an
  // error (the simulated device drains on a raw free and reports nothing).
  void DrainWithoutLooking() {
    void* raw = backend_->device_malloc(0, kMiB).value();
    backend_->device_free(0, raw);
  }

  // Spills `s` (saved, and held until now) by a copy that fails, and lets that copy run with
  // nobody hearing of it: the entry stays spilling, its old block pending on the copy.
  void SpillByACopyNobodyHearsFail(TestStorage& s) {
    {
      auto hold = backend_->hold_stream(0, compute_.handle);  // the copy waits behind it
      s.holders = 0;
      WithNextCopyFailing([&] { engine_->ForwardEnd(); });
      ASSERT_EQ(engine_->Describe(&s).value().residency, Residency::kSpilling);
    }
    DrainWithoutLooking();
  }
};

// The reload of an entry whose copy to the host has not run yet reads the host buffer after that
// copy. Here that copy fails: the reload's own copy succeeds (it moves whatever the buffer held),
// and the failure is found on the other stream (by Synchronize's wait for that spill's copy). The
// entry must fail, not pass for resident.
TEST_F(OffloadCopyFailure, OffloadAReloadFailsWhenTheSpillItReadsFromDid) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 71);
  std::shared_ptr<TestStorage> b = NewStorage(2 * kMiB, 72);
  const KeeperId ida = Save(a);
  const KeeperId idb = Save(b);
  a->holders = 0;
  {
    auto hold = backend_->hold_stream(0, compute_.handle);
    WithNextCopyFailing([&] { engine_->ForwardEnd(); });  // a's copy to the host
    ASSERT_EQ(StateOf(a), Residency::kSpilling);
    engine_->Acquire(ida, compute_);  // backward wants it back before it ever left
    ASSERT_EQ(StateOf(a), Residency::kReloading);
  }
  EXPECT_NO_THROW(engine_->Synchronize()) << "the failure belongs to a's entry, not to the caller";
  EXPECT_EQ(StateOf(a), Residency::kFailed)
      << "a reload of bytes that never reached the host passed for resident";
  ExpectLost(ida);
  EXPECT_EQ(Read(b), Pattern(2 * kMiB, 72));
  a.reset();
  b.reset();
  DropAllAndExpectNoLeaks({ida, idb});
}

// The same, found by the reload's own allocation: the device is full but for the block the spill
// gave back, whose reuse waits for the copy to the host; the allocator's wait finds that copy
// failed. The reload must stop there instead of copying the empty host buffer.
TEST_F(OffloadCopyFailure, OffloadAReloadStopsWhenItsAllocationFindsItsSpillFailed) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(12 * kMiB, 73);
  const KeeperId ida = Save(a);
  void* filler = allocator_->Malloc(52 * kMiB, 0, compute_);
  ASSERT_EQ(backend_->bytes_in_use(0), 64 * kMiB);
  a->holders = 0;
  auto hold = backend_->hold_stream(0, compute_.handle);
  WithNextCopyFailing([&] { engine_->ForwardEnd(); });  // a's copy to the host
  ASSERT_EQ(StateOf(a), Residency::kSpilling);
  // Acquire's own look at the copy comes first and finds it not run; the allocator's wait for the
  // block comes next and finds the failure once the hold opens. (Should the hold open before that
  // first look, Acquire finds the failure there: the outcome is the same.)
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    hold->Open();
  });
  ExpectLostAt([&] { engine_->Acquire(ida, compute_); }, /*times=*/1);
  opener.join();
  EXPECT_EQ(StateOf(a), Residency::kFailed);
  EXPECT_EQ(a->data(), nullptr) << "the block taken for the reload was kept";
  ExpectLost(ida);
  allocator_->Free(filler);
  a.reset();
  DropAllAndExpectNoLeaks({ida});
}

// A prefetch's copy fails; the next reload's copy call on the same stream is the first to find
// it. That failure is the prefetch's: the prefetched entry fails (and stops counting as a
// prefetch), and the reload that found it goes ahead and brings its own bytes back.
TEST_F(OffloadCopyFailure, OffloadAReloadThatFindsAPrefetchsFailureFailsThePrefetch) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 2 * kMiB;  // one entry ahead
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 74);
  std::shared_ptr<TestStorage> b = NewStorage(2 * kMiB, 75);
  std::shared_ptr<TestStorage> c = NewStorage(2 * kMiB, 76);
  const KeeperId ida = Save(a);
  const KeeperId idb = Save(b);
  const KeeperId idc = Save(c);
  a->holders = b->holders = 0;  // c stays on the device
  engine_->ForwardEnd();
  engine_->Synchronize();
  ASSERT_EQ(StateOf(a), Residency::kSpilled);
  ASSERT_EQ(StateOf(b), Residency::kSpilled);

  {
    // Held, so that the prefetch's copy fails only after the prefetch was issued completely.
    auto hold = backend_->hold_stream(0, engine_->h2d_stream_for_testing(0).handle);
    WithNextCopyFailing([&] { engine_->Acquire(idc, compute_); });  // prefetches b; b's copy fails
  }
  ASSERT_TRUE(engine_->Describe(b.get())->prefetched);
  DrainWithoutLooking();  // b's copy has failed; nobody has looked
  ASSERT_EQ(StateOf(b), Residency::kReloading);

  EXPECT_EQ(AcquireAndRead(ida, 2 * kMiB), Pattern(2 * kMiB, 74));
  EXPECT_EQ(StateOf(b), Residency::kFailed);
  EXPECT_FALSE(engine_->Describe(b.get())->prefetched);
  ExpectLost(idb);
  EXPECT_EQ(Read(c), Pattern(2 * kMiB, 76));
  a.reset();
  b.reset();
  c.reset();
  DropAllAndExpectNoLeaks({ida, idb, idc});
}

// A host consumer waits for a reload whose copy fails: WaitResident reports the loss, every time,
// as Acquire does, and the entry fails rather than pass for resident on the next call.
TEST_F(OffloadCopyFailure, OffloadWaitResidentReportsAFailedReload) {
  auto [a, b, ida, idb] = SpillOneHoldOne();
  ASSERT_FALSE(HasFailure());
  {
    auto hold = backend_->hold_stream(0, engine_->h2d_stream_for_testing(0).handle);
    WithNextCopyFailing([&, id = ida] { engine_->Acquire(id, compute_); });  // a's copy back
  }
  ExpectLostAt([&, id = ida] { engine_->WaitResident(id); });
  EXPECT_EQ(StateOf(a), Residency::kFailed);
  ExpectLost(ida);
  EXPECT_EQ(AcquireAndRead(idb, 16 * kMiB), Pattern(16 * kMiB, 2));
  a.reset();
  b.reset();
  DropAllAndExpectNoLeaks({ida, idb});
}

// The allocator can be the first to hear of a spill's failure (its event for the block the spill
// gave back), inside the out-of-memory ladder, which then asks the engine for memory before the
// failure is passed on: the engine gives back a prefetch that read from that spill. It must hear
// of the failure before it trusts the copy, or the entry passes for spilled with a host buffer
// that was never filled, and a later reload returns whatever it held.
TEST_F(OffloadCopyFailure, OffloadAFailureTheLadderHeardFailsThePrefetchThatReadIt) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 12 * kMiB;  // a, when backward acquires b
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(12 * kMiB, 81);
  std::shared_ptr<TestStorage> b = NewStorage(16 * kMiB, 82);
  const KeeperId ida = Save(a);
  const KeeperId idb = Save(b);
  {
    auto hold = backend_->hold_stream(0, compute_.handle);  // a's spill copy waits behind it
    a->holders = 0;
    WithNextCopyFailing([&] { engine_->ForwardEnd(); });  // a's copy to the host
    ASSERT_EQ(StateOf(a), Residency::kSpilling);
    engine_->Acquire(idb, compute_);  // backward starts: a is prefetched while still spilling
    ASSERT_EQ(StateOf(a), Residency::kReloading);
  }
  // The failing copy runs; the prefetch after it too. Nobody has looked at the spill's stream.
  backend_->synchronize_stream(0, engine_->h2d_stream_for_testing(0).handle);
  // More than is free: the ladder's wait for a's old block hears of the failure, then the
  // engine is asked to give memory back.
  void* p = nullptr;
  try {
    p = allocator_->Malloc(40 * kMiB, 0, compute_);
  } catch (const OutOfMemoryError&) {
    // Whether it fits is not the point.
  }
  EXPECT_EQ(StateOf(a), Residency::kFailed) << "a passed for spilled with bytes never copied";
  ExpectLost(ida);
  if (p != nullptr) allocator_->Free(p);
  EXPECT_EQ(AcquireAndRead(idb, 16 * kMiB), Pattern(16 * kMiB, 82));
  a.reset();
  b.reset();
  DropAllAndExpectNoLeaks({ida, idb});
}

// The same failure heard on another thread: an allocation there found it (its wait for a's old
// block), and waits to pass it on while the engine, on this thread, waits for another copy under
// its lock and then looks at a's. The failure is still pending until passed on, and the engine
// must take it: a must fail, not pass for resident with a host buffer that was never filled.
TEST_F(OffloadCopyFailure, OffloadAFailureAnotherThreadIsPassingOnFailsTheReloadThatReadIt) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 0;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> x = NewStorage(12 * kMiB, 86);  // saved first: refreshed first
  std::shared_ptr<TestStorage> a = NewStorage(12 * kMiB, 87);
  const KeeperId idx = Save(x);
  const KeeperId ida = Save(a);
  x->holders = 0;
  engine_->ForwardEnd();
  engine_->Synchronize();
  ASSERT_EQ(StateOf(x), Residency::kSpilled);
  auto h2d_hold = backend_->hold_stream(0, engine_->h2d_stream_for_testing(0).handle);
  // a's spill copy waits behind this one: nobody can hear of its failure before the allocation
  // made for that below.
  auto compute_hold = backend_->hold_stream(0, compute_.handle);
  // x's copy back waits behind the hold; its consumer is another stream, so that the compute
  // stream (which a's spill waits for) does not wait for it.
  engine_->Acquire(idx, backend_->create_stream(0));
  a->holders = 0;
  WithNextCopyFailing([&] { engine_->ForwardEnd(); });  // a's copy to the host
  engine_->Acquire(ida, compute_);  // a's copy back, queued after x's, reads that spill
  ASSERT_EQ(StateOf(a), Residency::kReloading);
  // The device is full but for a's old block, pending on the spill.
  void* filler = allocator_->Malloc(64 * kMiB - backend_->bytes_in_use(0), 0, compute_);
  ASSERT_EQ(backend_->bytes_in_use(0), 64 * kMiB);

  // The engine waits for x's copy under its lock, then looks at a's spill.
  std::thread engine_thread([&] { engine_->Synchronize(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  compute_hold->Open();  // a's spill copy runs, and fails
  // This allocation waits for a's old block, hears of the failure, gets the block and then waits
  // for the engine's lock to pass the failure on; the hold opens meanwhile. (Should the threads
  // run in another order, the failure reaches a's entry all the same.)
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    h2d_hold->Open();
  });
  void* p = allocator_->Malloc(12 * kMiB, 0, compute_);
  opener.join();
  engine_thread.join();
  EXPECT_EQ(StateOf(a), Residency::kFailed) << "a passed for resident with bytes never copied";
  ExpectLost(ida);
  allocator_->Free(p);
  allocator_->Free(filler);
  EXPECT_EQ(AcquireAndRead(idx, 12 * kMiB), Pattern(12 * kMiB, 86));
  x.reset();
  a.reset();
  DropAllAndExpectNoLeaks({idx, ida});
}

// The other order: the engine takes a failure that another thread found and is still passing
// on, then issues a spill, and that thread's delivery comes after. The failure was acted on
// already: told again, the engine must not fail the new spill, which came after it.
TEST_F(OffloadCopyFailure, OffloadAFailureToldTwiceIsActedOnOnce) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 0;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 88);
  // Made now: an allocation after the failing copy has run would hear of it first.
  std::shared_ptr<TestStorage> c = NewStorage(2 * kMiB, 89);
  const KeeperId ida = Save(a);
  ASSERT_NO_FATAL_FAILURE(SpillByACopyNobodyHearsFail(*a));
  // c's spill waits for its producer, held: it stays in flight until the end.
  const StreamRef side = backend_->create_stream(0);
  auto side_hold = backend_->hold_stream(0, side.handle);
  c->holders = 0;
  // The save of c holds the engine's lock while its storage is made (slowly, here): meanwhile an
  // allocation hears of the failure and waits for that lock to pass it on. The save's policy run
  // then takes the failure, and spills c.
  KeeperId idc = 0;
  std::thread saver([&] {
    idc = engine_
              ->AddKeeper(
                  c.get(),
                  [&] {
                    std::this_thread::sleep_for(std::chrono::milliseconds(300));
                    return c;
                  },
                  FloatView(c->nbytes()), side)
              .value();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  void* p = allocator_->Malloc(kMiB, 0, compute_);  // polls a's old block: hears of the failure
  saver.join();
  EXPECT_EQ(StateOf(a), Residency::kFailed);
  ASSERT_NE(StateOf(c), Residency::kFailed) << "a failure heard before c's spill failed it";
  side_hold->Open();
  engine_->Synchronize();
  EXPECT_EQ(StateOf(c), Residency::kSpilled);
  EXPECT_EQ(AcquireAndRead(idc, 2 * kMiB), Pattern(2 * kMiB, 89));
  allocator_->Free(p);
  a.reset();
  c.reset();
  DropAllAndExpectNoLeaks({ida, idc});
}

// The pinned pool polls the buffers that wait for each copy stream, and each stream's failure is
// heard once: a spill's allocation can hear of one stream's failure, and its second try of the
// other's. Neither is the spill's, nor its caller's: the spill is not made now, nothing escapes.
TEST_F(OffloadCopyFailure, OffloadASpillWhosePoolHearsTwoFailuresIsSkipped) {
  accesses_follow_streams_ = true;  // dropping a's queued reload must not wait for it on the host
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 0;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 91);
  std::shared_ptr<TestStorage> b = NewStorage(2 * kMiB, 92);
  std::shared_ptr<TestStorage> c = NewStorage(2 * kMiB, 93);
  const KeeperId ida = Save(a);
  const KeeperId idb = Save(b);
  const KeeperId idc = Save(c);
  a->holders = 0;
  engine_->ForwardEnd();
  engine_->Synchronize();
  ASSERT_EQ(StateOf(a), Residency::kSpilled);
  {
    // a's reload fails on the copy-back stream, and a is dropped while it is queued: its host
    // buffer waits in the pool for that stream.
    auto h2d_hold = backend_->hold_stream(0, engine_->h2d_stream_for_testing(0).handle);
    WithNextCopyFailing([&] { engine_->Acquire(ida, compute_); });
    a.reset();
    engine_->RemoveKeeper(ida);
    // b's spill fails on the copy-out stream, and b is dropped while it is queued: its buffer
    // waits for that stream.
    auto compute_hold = backend_->hold_stream(0, compute_.handle);
    b->holders = 0;
    WithNextCopyFailing([&] { engine_->ForwardEnd(); });
    ASSERT_EQ(StateOf(b), Residency::kSpilling);
    b.reset();
    engine_->RemoveKeeper(idb);
  }
  DrainWithoutLooking();  // both failures are there; nobody has heard of them
  const int64_t copy_errors = EngineStat("skipped.copy_error");
  c->holders = 0;
  EXPECT_NO_THROW(engine_->ForwardEnd()) << "a failure of copies already dropped escaped";
  EXPECT_EQ(EngineStat("skipped.copy_error"), copy_errors + 1);
  EXPECT_EQ(StateOf(c), Residency::kResident);
  EXPECT_EQ(Read(c), Pattern(2 * kMiB, 93));
  // The pool has heard everything now: the next save spills and comes back whole.
  std::shared_ptr<TestStorage> d = NewStorage(2 * kMiB, 94);
  const KeeperId idd = Save(d);
  d->holders = 0;
  engine_->ForwardEnd();
  engine_->Synchronize();
  EXPECT_EQ(StateOf(d), Residency::kSpilled);
  EXPECT_EQ(AcquireAndRead(idd, 2 * kMiB), Pattern(2 * kMiB, 94));
  c.reset();
  d.reset();
  DropAllAndExpectNoLeaks({idc, idd});
}

// The pinned pool polls the buffers freed for a copy stream, and can be the first to hear of a
// failed copy there: it knows which stream that was. A spill's failure, heard so, fails the
// spills in flight, not a healthy reload in flight on the other stream.
TEST_F(OffloadCopyFailure, OffloadASpillsFailureThePoolHearsSparesReloads) {
  accesses_follow_streams_ = true;  // dropping c's queued spill must not wait for it on the host
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 0;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 95);
  std::shared_ptr<TestStorage> c = NewStorage(2 * kMiB, 96);
  std::shared_ptr<TestStorage> d = NewStorage(2 * kMiB, 97);
  const KeeperId ida = Save(a);
  const KeeperId idc = Save(c);
  const KeeperId idd = Save(d);
  a->holders = 0;
  engine_->ForwardEnd();
  engine_->Synchronize();
  ASSERT_EQ(StateOf(a), Residency::kSpilled);
  // a's copy back waits behind a hold; its consumer is another stream, so that the compute
  // stream (which c's spill waits for) does not wait for it.
  auto h2d_hold = backend_->hold_stream(0, engine_->h2d_stream_for_testing(0).handle);
  engine_->Acquire(ida, backend_->create_stream(0));
  ASSERT_EQ(StateOf(a), Residency::kReloading);
  // c's spill fails, and c is dropped while it is queued: its host buffer waits in the pool for
  // the copy-out stream. A watcher learns when that stream has passed the copy, without looking.
  const StreamRef watcher = backend_->create_stream(0);
  {
    auto compute_hold = backend_->hold_stream(0, compute_.handle);
    c->holders = 0;
    WithNextCopyFailing([&] { engine_->ForwardEnd(); });
    ASSERT_EQ(StateOf(c), Residency::kSpilling);
    c.reset();
    engine_->RemoveKeeper(idc);
    EventHandle passed = backend_->create_event(0);
    backend_->record_event(0, passed, engine_->d2h_stream_for_testing(0).handle);
    backend_->stream_wait_event(0, watcher.handle, passed);
    backend_->destroy_event(0, passed);
  }
  backend_->synchronize_stream(0, watcher.handle);
  // d's spill asks the pool for a buffer; the pool hears of c's failure.
  d->holders = 0;
  EXPECT_NO_THROW(engine_->ForwardEnd());
  h2d_hold->Open();
  EXPECT_NO_THROW(engine_->WaitResident(ida)) << "a healthy reload failed with a spill";
  EXPECT_EQ(AcquireAndRead(ida, 2 * kMiB), Pattern(2 * kMiB, 95));
  engine_->Synchronize();
  EXPECT_EQ(AcquireAndRead(idd, 2 * kMiB), Pattern(2 * kMiB, 97));
  a.reset();
  d.reset();
  DropAllAndExpectNoLeaks({ida, idd});
}

// A failure the ladder heard before it asked the engine for memory belongs to the copies in
// flight then; the spills the rescue issues afterwards are healthy. Passed on only when the
// rescue waited for its spills, it failed them too.
TEST_F(OffloadCopyFailure, OffloadAFailureTheLadderHeardSparesTheRescuesOwnSpills) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 0;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(12 * kMiB, 84);
  // Made now: an allocation after the failing copy has run would hear of it first.
  std::shared_ptr<TestStorage> c = NewStorage(8 * kMiB, 85);
  const KeeperId ida = Save(a);
  ASSERT_NO_FATAL_FAILURE(SpillByACopyNobodyHearsFail(*a));
  const KeeperId idc = Save(c);  // saved after the policy ran: left for the rescue
  c->holders = 0;
  // More than is free: the ladder's wait for a's old block hears of the failure, then the
  // engine is asked for memory and spills c.
  void* p = nullptr;
  try {
    p = allocator_->Malloc(60 * kMiB, 0, compute_);
  } catch (const OutOfMemoryError&) {
    // Whether it fits is not the point.
  }
  EXPECT_EQ(StateOf(a), Residency::kFailed);
  if (p != nullptr) allocator_->Free(p);
  engine_->Synchronize();
  EXPECT_EQ(StateOf(c), Residency::kSpilled) << "the rescue's healthy spill was failed too";
  EXPECT_EQ(AcquireAndRead(idc, 8 * kMiB), Pattern(8 * kMiB, 85));
  a.reset();
  c.reset();
  DropAllAndExpectNoLeaks({ida, idc});
}

// One reload's failure fails every reload in flight, healthy ones included (which one failed is
// not known). A healthy one still queued, that no stream waits for yet (a prefetch's, say), must
// keep its block until its copy has run: dropped now, its block is handed out again, and the copy
// must not land on the next owner's bytes. Gates hold the copy stream twice: b's failing copy runs
// when the first opens, a's copy only when the second does, after the next owner wrote.
TEST_F(OffloadCopyFailure, OffloadAReloadFailedWithAnotherKeepsItsCopyOrdered) {
  accesses_follow_streams_ = true;  // the stream-ordered case, as on a GPU: the drop does not wait
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 0;  // each reload asked for by its own Acquire
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 77);
  std::shared_ptr<TestStorage> b = NewStorage(2 * kMiB, 78);
  const KeeperId ida = Save(a);
  const KeeperId idb = Save(b);
  a->holders = b->holders = 0;
  engine_->ForwardEnd();
  engine_->Synchronize();
  ASSERT_EQ(StateOf(b), Residency::kSpilled);

  const StreamRef side = backend_->create_stream(0);
  const StreamRef h2d = engine_->h2d_stream_for_testing(0);
  auto side_hold = backend_->hold_stream(0, side.handle);
  std::unique_ptr<SimBackend::StreamHold> a_copy_hold;
  {
    auto b_copy_hold = backend_->hold_stream(0, h2d.handle);
    WithNextCopyFailing([&] { engine_->Acquire(idb, compute_); });  // b's copy back
    a_copy_hold = backend_->hold_stream(0, h2d.handle);
    engine_->set_skip_consumer_wait_for_testing(true);  // nobody waits for a's copy yet
    engine_->Acquire(ida, side);
    engine_->set_skip_consumer_wait_for_testing(false);
  }
  EXPECT_THROW(engine_->WaitResident(idb), Error);
  ASSERT_EQ(StateOf(a), Residency::kFailed);

  void* const a_block = a->data();
  engine_->RemoveKeeper(ida);
  storages_.erase(std::find(storages_.begin(), storages_.end(), a));
  a.reset();
  // The next owner of a's block, on the stream it was allocated on, writes there.
  void* next = allocator_->Malloc(2 * kMiB, 0, side);
  ASSERT_EQ(next, a_block);
  const std::vector<uint8_t> fill(2 * kMiB, kFill);
  backend_->memcpy_async(0, next, fill.data(), fill.size(), CopyKind::kHostToDevice, side.handle);
  EventHandle written = backend_->create_event(0);
  backend_->record_event(0, written, side.handle);
  side_hold->Open();
  // Unordered, the write lands at once, before a's copy: give it that chance. Ordered after the
  // copy it cannot run yet, and the wait just runs out.
  for (int i = 0; i < 100 && !backend_->query_event(0, written); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  a_copy_hold->Open();
  engine_->Synchronize();
  EXPECT_EQ(ReadOn(side, next, 2 * kMiB), fill)
      << "the failed reload's copy landed after the next owner of its block wrote there";
  backend_->destroy_event(0, written);
  allocator_->Free(next);
  b.reset();
  DropAllAndExpectNoLeaks({idb});
}

// The program's own copy failed on its stream, and a spill's record there is the first call to
// find it: the program's error. It reaches the caller (here the save, which then registers
// nothing), and no spill in flight is blamed for it.
TEST_F(OffloadCopyFailure, OffloadTheProgramsFailedCopyIsNotBlamedOnSpills) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  const StreamRef side = backend_->create_stream(0);
  std::shared_ptr<TestStorage> x = NewStorage(2 * kMiB, 79);
  std::shared_ptr<TestStorage> y = NewStorage(2 * kMiB, 80);
  const ViewInfo view = FloatView(x->nbytes());
  auto hold = backend_->hold_stream(0, side.handle);
  x->holders = 0;
  const KeeperId idx = engine_
                           ->AddKeeper(
                               x.get(), [&] { return x; }, view, side)
                           .value();            // spills at once
  ASSERT_EQ(StateOf(x), Residency::kSpilling);  // its copy waits for the held producer

  // The program's copy on the compute stream fails; make sure it ran, without looking (the
  // compute stream is held until the event after the copy is recorded).
  std::vector<uint8_t> scratch(kMiB);
  void* block = allocator_->Malloc(kMiB, 0, compute_);
  const StreamRef watcher = backend_->create_stream(0);
  EventHandle copied = backend_->create_event(0);
  {
    auto compute_hold = backend_->hold_stream(0, compute_.handle);
    WithNextCopyFailing([&] {
      backend_->memcpy_async(0, scratch.data(), block, kMiB, CopyKind::kDeviceToHost,
                             compute_.handle);
    });
    backend_->record_event(0, copied, compute_.handle);
    backend_->stream_wait_event(0, watcher.handle, copied);
  }
  backend_->synchronize_stream(0, watcher.handle);

  y->holders = 0;
  EXPECT_THROW(Save(y), ProgramStreamError);
  EXPECT_EQ(EngineStat("num_keepers"), 1) << "a failed save counted as registered";
  EXPECT_EQ(EngineStat("num_entries"), 1) << "a failed save left its entry behind";
  EXPECT_FALSE(engine_->Describe(y.get()).has_value());

  hold->Open();
  engine_->Synchronize();
  EXPECT_EQ(StateOf(x), Residency::kSpilled) << "the program's error failed a spill in flight";
  EXPECT_EQ(AcquireAndRead(idx, 2 * kMiB), Pattern(2 * kMiB, 79));
  backend_->destroy_event(0, copied);
  allocator_->Free(block);
  x.reset();
  y.reset();
  DropAllAndExpectNoLeaks({idx});
}

}  // namespace
}  // namespace spillway::testing
