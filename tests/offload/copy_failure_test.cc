// A failed copy belongs to the entries whose bytes passed through it, whoever finds it: the copy
// streams report a failure once, to the first call that looks, which may be a call made for
// another entry, for the allocator, or on another stream altogether. Each test arranges one such
// path with held streams and checks that the right entries fail (their Acquire says so rather
// than return bytes that never arrived) and no other entry does.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "allocator/errors.h"
#include "tests/offload/fault_fixture.h"

namespace spillway::testing {
namespace {

class OffloadCopyFailure : public OffloadFaultInjection {};

// The reload of an entry whose copy to the host has not run yet reads the host buffer after that
// copy. Here that copy fails: the reload's own copy succeeds (it moves whatever the buffer held),
// and the failure is found on the other stream (by Synchronize's wait for that spill's copy). The
// entry must fail, not pass for resident.
TEST_F(OffloadCopyFailure, OffloadAReloadFailsWhenTheSpillItReadsFromDid) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  // The storage is read back while its spill still copies; here the allocator cannot give the
  // spill's block back (TakeBack refused), so the reload reads what that copy writes.
  engine_->set_take_back_for_testing(false);
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
  // The storage is read back while its spill still copies; here the allocator cannot give the
  // spill's block back (TakeBack refused), so the reload reads what that copy writes.
  engine_->set_take_back_for_testing(false);
  std::shared_ptr<TestStorage> a = NewStorage(12 * kMiB, 73);
  const KeeperId ida = Save(a);
  void* filler = allocator_->Malloc(52 * kMiB, 0, compute_);
  ASSERT_EQ(backend_->bytes_in_use(0), 64 * kMiB);
  a->holders = 0;
  // a's copy to the host waits behind this hold until the host waits for it: Acquire's own look
  // at the copy finds it not run, and the allocator's wait for the block opens the hold and finds
  // the failure.
  auto hold = backend_->hold_stream(0, engine_->d2h_stream_for_testing(0).handle,
                                    SimBackend::HoldRelease::kWhenHostWaits);
  WithNextCopyFailing([&] { engine_->ForwardEnd(); });  // a's copy to the host
  ASSERT_EQ(StateOf(a), Residency::kSpilling);
  // Should nothing wait on the host (a regression), the test fails rather than hangs.
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    PollUntil([&] { return done.load(); });
    hold->Open();
  });
  ExpectLostAt([&] { engine_->Acquire(ida, compute_); }, /*times=*/1);
  EXPECT_TRUE(hold->opened_by_wait()) << "the allocator did not wait for the block";
  done = true;
  watchdog.join();
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
  EndForwardSavesOnly({a, b});  // c stays on the device
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

// A simulated device that runs `before_upload` (while set) before it enqueues each host-to-device
// copy: a test orders a copy's failure and the call that hears of it there, deterministically.
class DrainBeforeUploadsBackend : public SimBackend {
 public:
  using SimBackend::SimBackend;
  void memcpy_async(int device, void* dst, const void* src, size_t bytes, CopyKind kind,
                    StreamHandle stream) override {
    if (kind == CopyKind::kHostToDevice && before_upload) before_upload(device, stream);
    SimBackend::memcpy_async(device, dst, src, bytes, kind, stream);
  }
  std::function<void(int, StreamHandle)> before_upload;
};

using OffloadPrefetchHearsAFailure = WithSimBackend<OffloadCopyFailure, DrainBeforeUploadsBackend>;

// The entry being acquired has its copy fail while its own Acquire prefetches an older entry, and
// the prefetch's copy call on the same stream hears of the failure. Acquire must say the bytes
// are lost rather than return the block the failed copy never wrote.
TEST_F(OffloadPrefetchHearsAFailure, OffloadAnAcquireWhosePrefetchFindsItsCopyFailedSaysSo) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.budget_bytes = 64 * kMiB;  // the prefetch is not held back by a budget
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(12 * kMiB, 81);
  std::shared_ptr<TestStorage> b = NewStorage(12 * kMiB, 82);
  const KeeperId ida = Save(a);
  const KeeperId idb = Save(b);
  EndForwardSavesOnly({a, b});
  ASSERT_EQ(StateOf(a), Residency::kSpilled);
  ASSERT_EQ(StateOf(b), Residency::kSpilled);
  // Cached: the two 12 MiB segments the spills freed. The program takes one back; b's reload
  // takes the other; a's prefetch gets a segment of its own in the 16 MiB left unreserved.
  void* program = allocator_->Malloc(12 * kMiB, 0, compute_);
  void* for_b = allocator_->Malloc(12 * kMiB, 0, compute_);
  void* rest = allocator_->Malloc(24 * kMiB, 0, compute_);
  allocator_->Free(for_b);
  ASSERT_EQ(AllocStat("reserved_bytes.all.current"), static_cast<int64_t>(48 * kMiB));

  // b's reload is the first upload: held behind the gate, so that nothing (its own event record,
  // say, which would make the copy again) hears of its failure early. The prefetch's upload is the
  // second: the failing copy runs first, and this upload hears of it.
  auto gate = backend_->hold_stream(0, engine_->h2d_stream_for_testing(0).handle);
  int uploads = 0;
  sim_->before_upload = [&](int device, StreamHandle stream) {
    if (++uploads != 2) return;
    gate->Open();
    sim_->SimBackend::synchronize_stream(device, stream);
  };
  ExpectLostAt([&] { WithNextCopyFailing([&] { engine_->Acquire(idb, compute_); }); },
               /*times=*/1);
  sim_->before_upload = nullptr;
  gate->Open();
  // b's, then the prefetch's that heard of the failure, then the prefetch's made again.
  EXPECT_EQ(uploads, 3) << "the prefetch did not run as arranged";
  EXPECT_EQ(StateOf(b), Residency::kFailed);
  EXPECT_TRUE(engine_->Describe(a.get())->prefetched) << "the prefetch did not run as arranged";
  EXPECT_EQ(AcquireAndRead(ida, 12 * kMiB), Pattern(12 * kMiB, 81));
  ExpectLost(idb);
  allocator_->Free(program);
  allocator_->Free(rest);
  a.reset();
  b.reset();
  DropAllAndExpectNoLeaks({ida, idb});
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
  EndForwardSavesOnly({a, b});
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
  PollUntil([&] { return backend_->query_event(0, written); }, std::chrono::milliseconds(100));
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
