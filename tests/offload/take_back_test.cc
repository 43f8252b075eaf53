// A spill whose copy to the host has not finished when backward wants its storage is taken back:
// the device block it gave up, which the allocator cannot reuse before that copy has read it,
// becomes the storage's memory again. No copy to the device, no wait for the queue of copies to
// the host, the same bytes; the copy runs on into a host buffer nobody needs, and nothing of the
// storage depends on it any more.
#include <chrono>
#include <limits>
#include <memory>
#include <vector>

#include "tests/offload/fault_fixture.h"

namespace spillway::testing {
namespace {

class OffloadTakeBack : public OffloadFaultInjection {};

TEST_F(OffloadTakeBack, ASpillStillCopyingIsTakenBackNotCopiedBack) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> s = NewStorage(8 * kMiB, 11);
  void* const block = s->data();
  const int64_t block_bytes = AllocStat("allocated_bytes.all.current");
  const KeeperId id = Save(s);
  s->holders = 0;
  {
    // The copy to the host cannot finish: backward starts while it is still queued.
    auto hold = backend_->hold_stream(0, engine_->d2h_stream_for_testing(0).handle);
    engine_->ForwardEnd();
    ASSERT_EQ(StateOf(s), Residency::kSpilling);
    ASSERT_EQ(s->data(), nullptr);
    ASSERT_EQ(AllocStat("allocated_bytes.all.current"), 0);

    void* const ptr = engine_->Acquire(id, compute_);
    EXPECT_EQ(ptr, block) << "the storage was given other memory: its bytes were copied back";
    EXPECT_EQ(StateOf(s), Residency::kResident);
    // Read on the compute stream, which waits for nothing of the held copy.
    EXPECT_EQ(ReadOn(compute_, ptr, s->nbytes()), Pattern(8 * kMiB, 11));
    EXPECT_EQ(EngineStat("num_taken_back"), 1);
    EXPECT_EQ(EngineStat("bytes_taken_back"), int64_t{8 * kMiB});
    EXPECT_EQ(EngineStat("num_reloads"), 0);
    EXPECT_EQ(EngineStat("bytes_to_device"), 0);
    EXPECT_EQ(EngineStat("num_stalls"), 0);
    EXPECT_EQ(EngineStat("spilled_bytes.current"), 0);
    EXPECT_EQ(EngineStat("host_bytes.current"), 0);
    EXPECT_EQ(AllocStat("allocated_bytes.all.current"), block_bytes);

    // Dropped while the copy still reads it: the block waits for that copy again, so the next
    // request of its size gets other memory.
    engine_->RemoveKeeper(id);
    storages_.clear();
    s.reset();
    void* const next = allocator_->Malloc(8 * kMiB, 0, compute_);
    EXPECT_NE(next, block) << "the block was reused while the copy to the host still read it";
    allocator_->Free(next);
  }
  engine_->Synchronize();
  allocator_->ProcessEvents(0);
  EXPECT_EQ(AllocStat("allocated_bytes.all.current"), 0);
  EXPECT_EQ(AllocStat("active_bytes.all.current"), 0);
  EXPECT_EQ(EngineStat("num_entries"), 0);
}

// The copy to the host fails after its storage was taken back: the device bytes are the good
// ones, and nobody loses anything (without the take-back, backward's read of it fails).
TEST_F(OffloadTakeBack, ATakenBackStorageLosesNothingWhenItsSpillsCopyFails) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 91);
  std::shared_ptr<TestStorage> b = NewStorage(2 * kMiB, 92);
  const KeeperId ida = Save(a);
  const KeeperId idb = Save(b);
  a->holders = 0;  // b stays on the device
  {
    auto hold = backend_->hold_stream(0, engine_->d2h_stream_for_testing(0).handle);
    WithNextCopyFailing([&] { engine_->ForwardEnd(); });  // a's copy to the host
    ASSERT_EQ(StateOf(a), Residency::kSpilling);
    engine_->Acquire(ida, compute_);
    ASSERT_EQ(StateOf(a), Residency::kResident);
  }
  EXPECT_NO_THROW(engine_->Synchronize());
  EXPECT_EQ(StateOf(a), Residency::kResident);
  EXPECT_EQ(Read(a), Pattern(2 * kMiB, 91));
  EXPECT_EQ(ReadOn(compute_, engine_->Acquire(ida, compute_), 2 * kMiB), Pattern(2 * kMiB, 91));
  EXPECT_EQ(Read(b), Pattern(2 * kMiB, 92));
  a.reset();
  b.reset();
  DropAllAndExpectNoLeaks({ida, idb});
}

// Backward's prefetch takes back the older saves still copying too: the newest reads first, the
// rest are resident before they are read, and nothing crossed back.
TEST_F(OffloadTakeBack, PrefetchTakesBackTheOlderSavesStillCopying) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 8 * kMiB;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::vector<std::shared_ptr<TestStorage>> saved;
  std::vector<KeeperId> ids;
  for (uint32_t i = 0; i < 3; ++i) {
    saved.push_back(NewStorage(2 * kMiB, 100 + i));
    ids.push_back(Save(saved.back()));
  }
  // Forward is over only now (eager spills at the next save what forward no longer holds).
  for (const auto& s : saved) s->holders = 0;
  {
    auto hold = backend_->hold_stream(0, engine_->d2h_stream_for_testing(0).handle);
    engine_->ForwardEnd();
    for (const auto& s : saved) ASSERT_EQ(StateOf(s), Residency::kSpilling);
    engine_->Acquire(ids[2], compute_);  // backward reads the newest first
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(StateOf(saved[i]), Residency::kResident) << "save " << i;
      EXPECT_TRUE(engine_->Describe(saved[i].get())->prefetched) << "save " << i;
    }
    EXPECT_EQ(EngineStat("num_taken_back"), 3);
  }
  // The rescue may spill a prefetch taken back (it has no host copy to fall back on): spilled,
  // it is a prefetch no more.
  EXPECT_GT(engine_->ReleaseMemory(0, 2 * kMiB), 0u);
  EXPECT_NE(StateOf(saved[0]), Residency::kResident) << "the oldest prefetch goes first";
  EXPECT_FALSE(engine_->Describe(saved[0].get())->prefetched);
  for (size_t i = 2; i-- > 0;) {
    EXPECT_EQ(AcquireAndRead(ids[i], 2 * kMiB), Pattern(2 * kMiB, 100 + i)) << "save " << i;
  }
  EXPECT_EQ(EngineStat("num_prefetch_hits"), 2);  // save 0 spilled again, and prefetched again
  EXPECT_EQ(EngineStat("bytes_to_host"), int64_t{8 * kMiB});
  saved.clear();
  DropAllAndExpectNoLeaks(ids);
}

// On a device where every access follows streams, the allocator may free a spill's block before
// the copy is done, for a stream that waits for it (under a soft limit), and the memory may be
// another storage's, spilled in turn and pending at the same address, by the time backward wants
// the first storage: what is pending there is not the first spill's, and it is reloaded.
TEST_F(OffloadTakeBack, AnotherStoragesBlockAtTheSameAddressIsNotTakenBack) {
  accesses_follow_streams_ = true;
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  constexpr size_t kBytes = 12 * kMiB;  // a segment of its own: reused only whole
  std::shared_ptr<TestStorage> a = NewStorage(kBytes, 21);
  void* const block = a->data();
  const KeeperId ida = Save(a);
  a->holders = 0;
  auto hold = backend_->hold_stream(0, engine_->d2h_stream_for_testing(0).handle);
  engine_->ForwardEnd();
  ASSERT_EQ(StateOf(a), Residency::kSpilling);
  // Past the soft limit a new segment is not taken: the compute stream waits for a's copy, and
  // a's block, freed early, serves x.
  allocator_->SetWatermark(0, static_cast<size_t>(AllocStat("reserved_bytes.all.current")));
  auto x = std::make_shared<TestStorage>(*allocator_, kBytes, compute_);
  storages_.push_back(x);
  ASSERT_EQ(x->data(), block) << "the test needs x in a's memory";
  const std::vector<uint8_t> x_bytes = Pattern(kBytes, 22);
  backend_->memcpy_async(0, x->data(), x_bytes.data(), kBytes, CopyKind::kHostToDevice,
                         compute_.handle);
  const KeeperId idx = Save(x);
  x->holders = 0;
  engine_->ForwardEnd();
  ASSERT_EQ(StateOf(x), Residency::kSpilling);
  // a's reload takes new memory (under the limit it would take x's block, freed early in turn).
  allocator_->SetWatermark(0, std::numeric_limits<size_t>::max());

  void* const ptr = engine_->Acquire(ida, compute_);
  EXPECT_NE(ptr, block) << "x's block, pending at a's old address, was taken back for a";
  EXPECT_EQ(EngineStat("num_taken_back"), 0);
  hold->Open();
  EXPECT_EQ(ReadOn(compute_, ptr, kBytes), Pattern(kBytes, 21));
  EXPECT_EQ(AcquireAndRead(idx, kBytes), x_bytes);
  a.reset();
  x.reset();
  DropAllAndExpectNoLeaks({ida, idx});
}

// A spill whose copy has finished is not taken back (its block may be another storage's by
// now): it is reloaded, as before.
TEST_F(OffloadTakeBack, ASpillWhoseCopyFinishedIsReloaded) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> s = NewStorage(4 * kMiB, 12);
  const KeeperId id = Save(s);
  EndForwardSavesOnly({s});
  ASSERT_EQ(StateOf(s), Residency::kSpilled);
  EXPECT_EQ(AcquireAndRead(id, 4 * kMiB), Pattern(4 * kMiB, 12));
  EXPECT_EQ(EngineStat("num_taken_back"), 0);
  EXPECT_EQ(EngineStat("num_reloads"), 1);
  EXPECT_EQ(EngineStat("bytes_to_device"), int64_t{4 * kMiB});
  s.reset();
  DropAllAndExpectNoLeaks({id});
}

}  // namespace
}  // namespace spillway::testing
