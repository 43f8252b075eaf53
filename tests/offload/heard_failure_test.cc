// A failed copy is heard of by whoever looks at its stream first, and that need not be the
// engine: the allocator (its wait for a block a spill gave back, in the out-of-memory ladder or
// on another thread) or the pinned pool (polling a buffer freed for a copy stream). Each test
// arranges one such path and checks that the engine still fails the entries the copy belonged
// to, before it trusts a copy that read from it, and no entry whose copy came after.
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "allocator/errors.h"
#include "tests/offload/fault_fixture.h"

namespace spillway::testing {
namespace {

class OffloadHeardFailure : public OffloadFaultInjection {};

// A simulated device whose event queries answer "not yet" while `lag` is set: what a query made
// just before a copy runs answers, when a call made just after it hears of the copy's failure.
class LaggingQueriesSimBackend : public SimBackend {
 public:
  using SimBackend::SimBackend;
  bool query_event(int device, EventHandle event) override {
    if (lag.load()) return false;
    return SimBackend::query_event(device, event);
  }
  std::atomic<bool> lag{false};
};

using OffloadHeardLate = WithSimBackend<OffloadHeardFailure, LaggingQueriesSimBackend>;

// A simulated device on which the first failure a query reports, once armed, stalls the thread
// that took it (before that thread can note it) until released; `looks` counts the other
// threads' looks at events made meanwhile that found nothing.
class StallingSimBackend : public SimBackend {
 public:
  using SimBackend::SimBackend;
  bool query_event(int device, EventHandle event) override {
    try {
      const bool done = SimBackend::query_event(device, event);
      CountLook();  // once made: the look found nothing
      return done;
    } catch (const BackendError&) {
      if (armed.exchange(false)) {
        taken = true;
        EXPECT_TRUE(PollUntil([&] { return released.load(); })) << "the test never released";
      }
      throw;
    }
  }
  void synchronize_event(int device, EventHandle event) override {
    SimBackend::synchronize_event(device, event);
    CountLook();
  }
  std::atomic<bool> armed{false}, taken{false}, released{false};
  std::atomic<int> looks{0};

 private:
  void CountLook() {
    if (taken && !released) ++looks;
  }
};

using OffloadHeardMidway = WithSimBackend<OffloadHeardFailure, StallingSimBackend>;

// A simulated device that tells the test when a query took a failure from it (`heard`); the
// caller notes it under its allocator lock, which every later look at the noted errors takes.
// Armed with a stream (`pause_waits_on`), its next wait enqueued there waits until then.
class SignallingSimBackend : public SimBackend {
 public:
  using SimBackend::SimBackend;
  bool query_event(int device, EventHandle event) override {
    try {
      return SimBackend::query_event(device, event);
    } catch (const BackendError&) {
      heard = true;
      throw;
    }
  }
  void stream_wait_event(int device, StreamHandle stream, EventHandle event) override {
    if (pause_waits_on.load() == stream) {
      pause_waits_on = nullptr;
      paused = true;
      EXPECT_TRUE(Await(heard)) << "no query heard of the failure";
    }
    SimBackend::stream_wait_event(device, stream, event);
  }
  // Waits (for up to kPollLimit) for `flag`.
  static bool Await(const std::atomic<bool>& flag) {
    return PollUntil([&] { return flag.load(); });
  }
  std::atomic<bool> heard{false}, paused{false};
  std::atomic<StreamHandle> pause_waits_on{nullptr};
};

class OffloadHeardSignalled : public WithSimBackend<OffloadHeardFailure, SignallingSimBackend> {
 protected:
  // Eager, no prefetch: `a_` saved and spilled by a copy that failed with nobody hearing of it;
  // `c_` made before anyone can (an allocation after the failing copy ran would hear of it
  // first), held by nobody, for the test to save on `side_`, whose hold keeps c's spill (which
  // waits for its producer) in flight until the end.
  void MakeAFailedUnheardAndC(uint32_t seed) {
    OffloadConfig config = Policy(OffloadPolicy::kEager);
    config.prefetch_bytes = 0;
    Make(config, 64 * kMiB, std::chrono::microseconds{0});
    a_ = NewStorage(2 * kMiB, seed);
    c_ = NewStorage(2 * kMiB, seed + 1);
    ida_ = Save(a_);
    ASSERT_NO_FATAL_FAILURE(SpillByACopyNobodyHearsFail(*a_));
    side_ = backend_->create_stream(0);
    side_hold_ = backend_->hold_stream(0, side_.handle);
    c_->holders = 0;
  }

  // Then: a is lost, c's spill goes on once the hold opens and reads back intact (its seed after
  // a's), and nothing leaks. `p`: the allocation that heard of the failure.
  void ExpectOnlyALost(KeeperId idc, uint32_t seed, void* p) {
    EXPECT_EQ(StateOf(a_), Residency::kFailed);
    side_hold_->Open();
    engine_->Synchronize();
    EXPECT_EQ(StateOf(c_), Residency::kSpilled);
    EXPECT_EQ(AcquireAndRead(idc, 2 * kMiB), Pattern(2 * kMiB, seed + 1));
    allocator_->Free(p);
    a_.reset();
    c_.reset();
    DropAllAndExpectNoLeaks({ida_, idc});
  }

  void TearDown() override {
    side_hold_.reset();  // a test that stopped early left c's spill held: the engine waits for it
    OffloadHeardFailure::TearDown();
  }

  std::shared_ptr<TestStorage> a_, c_;
  KeeperId ida_ = 0;
  StreamRef side_;
  std::unique_ptr<SimBackend::StreamHold> side_hold_;
};

// Another thread's allocator call has taken a spill's failure from the copy stream and not noted
// it yet when the engine looks at that copy: the stream has nothing more to tell the engine, and
// the failure is on its way. The engine must wait for it rather than trust the copy (the entry
// passed for spilled, and its reload brought back bytes that never left the device).
TEST_F(OffloadHeardMidway, OffloadAFailureAnotherThreadIsStillFindingFailsTheSpill) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 100);
  const KeeperId ida = Save(a);
  SpillByACopyNobodyHearsFail(*a);  // a's old block waits in the allocator on the failed copy
  sim_->armed = true;
  std::thread finder([&] { allocator_->ProcessEvents(0); });  // polls that block's event
  if (!PollUntil([&] { return sim_->taken.load(); })) {
    sim_->released = true;  // lets the finder go, should it take the failure late
    finder.join();
    FAIL() << "no query took the failure";
  }
  // Released once the engine has looked at a's copy, and found nothing: the failure is the
  // finder's, still to be noted.
  std::thread releaser([&] {
    EXPECT_TRUE(PollUntil([&] { return sim_->looks.load() > 0; }))
        << "the engine never looked at a's copy";
    sim_->released = true;
  });
  engine_->Synchronize();  // looks at a's copy: finds nothing; the failure is the finder's
  releaser.join();
  finder.join();
  EXPECT_EQ(StateOf(a), Residency::kFailed) << "a copy whose failure was being found was trusted";
  ExpectLost(ida);
  a.reset();
  DropAllAndExpectNoLeaks({ida});
}

// A spilling entry is dropped: its own look at the copy finds it not run yet, and the pinned
// pool's record for the buffer it gives back, just after, hears that the copy failed. The entry's
// bytes leave the spilled ones once (they left twice, and the statistic went below what the
// other entry keeps spilled).
TEST_F(OffloadHeardLate, OffloadADropThatHearsItsSpillFailedCountsItOnce) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> b = NewStorage(2 * kMiB, 98);
  const KeeperId idb = Save(b);
  EndForwardSavesOnly({b});
  ASSERT_EQ(StateOf(b), Residency::kSpilled);
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 99);
  const KeeperId ida = Save(a);
  SpillByACopyNobodyHearsFail(*a);
  ASSERT_EQ(EngineStat("spilled_bytes.current"), static_cast<int64_t>(4 * kMiB));
  sim_->lag = true;
  a.reset();
  engine_->RemoveKeeper(ida);
  sim_->lag = false;
  EXPECT_EQ(EngineStat("spilled_bytes.current"), static_cast<int64_t>(2 * kMiB));
  EXPECT_EQ(StateOf(b), Residency::kSpilled);
  EXPECT_EQ(AcquireAndRead(idb, 2 * kMiB), Pattern(2 * kMiB, 98));
  b.reset();
  DropAllAndExpectNoLeaks({idb});
}

// The allocator can be the first to hear of a spill's failure (its event for the block the spill
// gave back), inside the out-of-memory ladder, which then asks the engine for memory before the
// failure is passed on: the engine gives back a prefetch that read from that spill. It must hear
// of the failure before it trusts the copy, or the entry passes for spilled with a host buffer
// that was never filled, and a later reload returns whatever it held.
TEST_F(OffloadHeardFailure, OffloadAFailureTheLadderHeardFailsThePrefetchThatReadIt) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 12 * kMiB;  // a, when backward acquires b
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  // The storage is read back while its spill still copies; here the allocator cannot give the
  // spill's block back (TakeBack refused), so the reload reads what that copy writes.
  engine_->set_take_back_for_testing(false);
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
TEST_F(OffloadHeardFailure, OffloadAFailureAnotherThreadIsPassingOnFailsTheReloadThatReadIt) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 0;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  // The storage is read back while its spill still copies; here the allocator cannot give the
  // spill's block back (TakeBack refused), so the reload reads what that copy writes.
  engine_->set_take_back_for_testing(false);
  std::shared_ptr<TestStorage> x = NewStorage(12 * kMiB, 86);  // saved first: refreshed first
  std::shared_ptr<TestStorage> a = NewStorage(12 * kMiB, 87);
  const KeeperId idx = Save(x);
  const KeeperId ida = Save(a);
  EndForwardSavesOnly({x});
  ASSERT_EQ(StateOf(x), Residency::kSpilled);
  const StreamRef h2d = engine_->h2d_stream_for_testing(0);  // takes the engine's lock: not later
  auto h2d_hold = backend_->hold_stream(0, h2d.handle);
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
  EXPECT_TRUE(AwaitHostWaiter(h2d)) << "the engine never waited";
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
// already: told again, the engine must not fail the new spill, which came after it. (Either
// guard spares it here: the failure acted on once, and the spill enqueued after the failure was
// found. The first alone matters for a failure another device's allocator found.)
TEST_F(OffloadHeardSignalled, OffloadAFailureToldTwiceIsActedOnOnce) {
  ASSERT_NO_FATAL_FAILURE(MakeAFailedUnheardAndC(88));
  // The save of c holds the engine's lock while its storage is made, until an allocation has
  // heard of the failure; that allocation then waits for the lock to pass it on. The save's
  // policy run takes the failure first, and spills c.
  KeeperId idc = 0;
  std::atomic<bool> making{false};
  std::thread saver([&] {
    idc = engine_
              ->AddKeeper(
                  c_.get(),
                  [&] {
                    making = true;
                    EXPECT_TRUE(SignallingSimBackend::Await(sim_->heard));
                    return c_;
                  },
                  FloatView(c_->nbytes()), side_)
              .value();
  });
  EXPECT_TRUE(SignallingSimBackend::Await(making));  // not ASSERT: the saver must be joined
  void* p = allocator_->Malloc(kMiB, 0, compute_);   // polls a's old block: hears of the failure
  saver.join();
  ASSERT_NE(StateOf(c_), Residency::kFailed) << "a failure heard before c's spill failed it";
  ExpectOnlyALost(idc, 88, p);
}

// The allocator hears of a failed spill while the engine is issuing a later one: after the
// engine last asked for failures, before the copy is enqueued. It passes the failure on once the
// engine's lock is free, with the later copy in flight; that copy came after the failure was
// found, so it is not the failed one and its entry keeps its bytes (it was failed, and the
// storage passed for lost).
TEST_F(OffloadHeardSignalled, OffloadAFailureFoundBeforeACopyWasEnqueuedSparesIt) {
  ASSERT_NO_FATAL_FAILURE(MakeAFailedUnheardAndC(93));
  // c's spill, issued under the engine's lock, waits (for its producer) on the copy-out stream:
  // there it pauses until an allocation has heard of a's failure.
  sim_->pause_waits_on = engine_->d2h_stream_for_testing(0).handle;
  KeeperId idc = 0;
  std::thread saver([&] {
    idc = engine_
              ->AddKeeper(
                  c_.get(), [&] { return c_; }, FloatView(c_->nbytes()), side_)
              .value();
  });
  EXPECT_TRUE(SignallingSimBackend::Await(sim_->paused));  // the saver must be joined
  void* p = allocator_->Malloc(kMiB, 0, compute_);  // hears of a's failure; passes it on after
  saver.join();
  ASSERT_EQ(StateOf(c_), Residency::kSpilling) << "a failure found before c's spill failed it";
  ExpectOnlyALost(idc, 93, p);
}

// The pinned pool polls the buffers that wait for each copy stream, and each stream's failure is
// heard once: a spill's allocation hears of both at once (the pool's core polls every stream's
// queue). Neither is the spill's, nor its caller's: nothing escapes, the allocation is asked
// again, and the spill is made and comes back whole.
TEST_F(OffloadHeardFailure, OffloadASpillWhosePoolHearsTwoFailuresGoesOn) {
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
  EndForwardSavesOnly({a});
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
  engine_->Synchronize();
  EXPECT_EQ(EngineStat("skipped.copy_error"), copy_errors) << "c's spill was skipped";
  EXPECT_EQ(StateOf(c), Residency::kSpilled);
  EXPECT_EQ(AcquireAndRead(idc, 2 * kMiB), Pattern(2 * kMiB, 93));
  // The pool has heard everything now: the next save spills and comes back whole.
  std::shared_ptr<TestStorage> d = NewStorage(2 * kMiB, 94);
  const KeeperId idd = Save(d);
  EndForwardSavesOnly({d});
  EXPECT_EQ(StateOf(d), Residency::kSpilled);
  EXPECT_EQ(AcquireAndRead(idd, 2 * kMiB), Pattern(2 * kMiB, 94));
  c.reset();
  d.reset();
  DropAllAndExpectNoLeaks({idc, idd});
}

// The pinned pool polls the buffers freed for a copy stream, and can be the first to hear of a
// failed copy there: it knows which stream that was. A spill's failure, heard so, fails the
// spills in flight, not a healthy reload in flight on the other stream.
TEST_F(OffloadHeardFailure, OffloadASpillsFailureThePoolHearsSparesReloads) {
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
  EndForwardSavesOnly({a});
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
TEST_F(OffloadHeardFailure, OffloadAFailureTheLadderHeardSparesTheRescuesOwnSpills) {
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

}  // namespace
}  // namespace spillway::testing
