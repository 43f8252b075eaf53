// Prefetch: reloads ahead of backward's reads, within the window and the budget, given back
// when an allocation needs the room; and a prefetch's allocation is a guess, which never runs the
// out-of-memory ladder.
#include <algorithm>
#include <chrono>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "tests/offload/engine_fixture.h"

namespace spillway::testing {
namespace {

class OffloadPrefetchTest : public OffloadEngineTest {
 protected:
  // Eager, on a roomy device, with a window of 4 MiB: two of the tests' 2 MiB saves ahead.
  void MakeTwoSavesAhead() {
    OffloadConfig config = Policy(OffloadPolicy::kEager);
    config.prefetch_bytes = 4 * kMiB;
    Make(config, 256 * kMiB, std::chrono::microseconds{0});
  }
};

// A prefetch is a guess: under every policy it stops at the budget (80% of the device by
// default), leaving backward's own allocations their headroom, however large the window.
TEST_F(OffloadPrefetchTest, OffloadPrefetchStopsAtTheBudgetUnderEagerToo) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = size_t{1} << 30;  // far more than the device
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::vector<std::shared_ptr<TestStorage>> saved;
  std::vector<KeeperId> ids;
  for (uint32_t i = 0; i < 8; ++i) {  // 64 MiB of saves in all
    saved.push_back(NewStorage(8 * kMiB, i));
    ids.push_back(Save(saved.back()));
    saved.back()->holders = 0;
  }
  engine_->ForwardEnd();
  engine_->Synchronize();
  ASSERT_EQ(AllocStat("allocated_bytes.all.current"), 0);
  engine_->Acquire(ids[7], compute_);  // backward's first read: the rest is prefetched
  engine_->Synchronize();
  const auto budget = static_cast<int64_t>(engine_->budget_bytes(0));
  EXPECT_EQ(budget, static_cast<int64_t>(0.8 * 64 * kMiB));
  EXPECT_LE(AllocStat("allocated_bytes.all.current"), budget);
  EXPECT_GT(AllocStat("allocated_bytes.all.current"), budget - 8 * static_cast<int64_t>(kMiB))
      << "the prefetch stopped short of the budget";
  // The rest comes back on demand, oldest last, intact.
  for (int i = 7; i >= 0; --i) {
    const auto k = static_cast<size_t>(i);
    void* ptr = engine_->Acquire(ids[k], compute_);
    EXPECT_EQ(ReadOn(compute_, ptr, 8 * kMiB), Pattern(8 * kMiB, static_cast<uint32_t>(i))) << i;
    engine_->RemoveKeeper(ids[k]);
    saved[k]->drop_device_memory();  // backward is done with it
  }
}

TEST_F(OffloadPrefetchTest, OffloadPrefetchReloadsAheadInReverseSaveOrder) {
  MakeTwoSavesAhead();
  std::vector<std::shared_ptr<TestStorage>> saved;
  std::vector<KeeperId> ids;
  for (uint32_t i = 0; i < 6; ++i) {
    saved.push_back(NewStorage(2 * kMiB, i));
    ids.push_back(Save(saved.back()));
    saved.back()->holders = 0;
  }
  engine_->ForwardEnd();
  engine_->Synchronize();
  // Backward's first read waits for its own reload and starts the two older ones (4 MiB).
  void* first = engine_->Acquire(ids[5], compute_);
  EXPECT_EQ(ReadOn(compute_, first, 2 * kMiB), Pattern(2 * kMiB, 5));
  EXPECT_NE(StateOf(saved[4]), Residency::kSpilled);
  EXPECT_NE(StateOf(saved[3]), Residency::kSpilled);
  EXPECT_EQ(StateOf(saved[2]), Residency::kSpilled);
  engine_->Synchronize();
  for (int i = 4; i >= 0; --i) {
    void* ptr = engine_->Acquire(ids[static_cast<size_t>(i)], compute_);
    EXPECT_EQ(ReadOn(compute_, ptr, 2 * kMiB), Pattern(2 * kMiB, static_cast<uint32_t>(i)));
    engine_->Synchronize();  // let each prefetch finish before the next ask
  }
  EXPECT_EQ(EngineStat("num_prefetch_hits"), 5);
  EXPECT_EQ(EngineStat("num_stalls"), 1);
}

// A storage saved again later in forward (a mask or a residual every layer saves) is read first at
// that later save's backward: prefetch goes on from there, as from any save made then (it went on
// from the first save, and the saves made between stalled). Each keeper keeps its own save's
// place: an older graph's backward reads its own saves, never a newer graph's.
TEST_F(OffloadPrefetchTest, OffloadAStorageSavedAgainPrefetchesFromTheSaveBeingRead) {
  MakeTwoSavesAhead();
  auto shared = NewStorage(2 * kMiB, 100);
  const KeeperId first = Save(shared);
  std::vector<std::shared_ptr<TestStorage>> saved;
  std::vector<KeeperId> ids;
  for (uint32_t i = 0; i < 4; ++i) {
    saved.push_back(NewStorage(2 * kMiB, i));
    ids.push_back(Save(saved.back()));
    saved.back()->holders = 0;
  }
  const KeeperId again = Save(shared);
  EndForwardSavesOnly({shared});
  ASSERT_EQ(StateOf(shared), Residency::kSpilled);
  // Backward reads the latest save first; the two saves made before it come back meanwhile.
  void* ptr = engine_->Acquire(again, compute_);
  EXPECT_EQ(ReadOn(compute_, ptr, 2 * kMiB), Pattern(2 * kMiB, 100));
  EXPECT_NE(StateOf(saved[3]), Residency::kSpilled);
  EXPECT_NE(StateOf(saved[2]), Residency::kSpilled);
  EXPECT_EQ(StateOf(saved[1]), Residency::kSpilled);
  engine_->RemoveKeeper(again);
  engine_->Synchronize();
  for (int i = 3; i >= 0; --i) {
    const auto k = static_cast<size_t>(i);
    void* p = engine_->Acquire(ids[k], compute_);
    EXPECT_EQ(ReadOn(compute_, p, 2 * kMiB), Pattern(2 * kMiB, static_cast<uint32_t>(i)));
    engine_->RemoveKeeper(ids[k]);
    engine_->Synchronize();
  }
  ptr = engine_->Acquire(first, compute_);
  EXPECT_EQ(ReadOn(compute_, ptr, 2 * kMiB), Pattern(2 * kMiB, 100));
  EXPECT_EQ(EngineStat("num_stalls"), 1);
}

// The older keeper of a storage saved twice reads it at its own save: prefetch goes on from
// there, never from the storage's latest save (the saves between are read after it... in the
// other graph's backward, or later in this one: they are not older than the save being read).
TEST_F(OffloadPrefetchTest, OffloadAnOlderKeeperPrefetchesFromItsOwnSave) {
  MakeTwoSavesAhead();
  auto before = NewStorage(2 * kMiB, 200);  // saved before the first save: older than it
  const KeeperId before_id = Save(before);
  before->holders = 0;
  auto shared = NewStorage(2 * kMiB, 201);
  const KeeperId first = Save(shared);
  auto between = NewStorage(2 * kMiB, 202);
  const KeeperId between_id = Save(between);
  between->holders = 0;
  const KeeperId again = Save(shared);
  EndForwardSavesOnly({shared});
  ASSERT_EQ(StateOf(between), Residency::kSpilled);
  void* ptr = engine_->Acquire(first, compute_);
  EXPECT_EQ(ReadOn(compute_, ptr, 2 * kMiB), Pattern(2 * kMiB, 201));
  EXPECT_EQ(StateOf(between), Residency::kSpilled) << "prefetched from the storage's latest save";
  EXPECT_NE(StateOf(before), Residency::kSpilled) << "the save older than `first` stayed out";
  for (const KeeperId id : {first, again, between_id, before_id}) engine_->RemoveKeeper(id);
}

// A storage saved by two graphs alive at once (a tensor two losses read, say, each with its own
// backward): the older graph's backward reads it at its own save, and prefetch brings it back
// from there (it was listed at the newer save alone, and the older backward stalled on it).
TEST_F(OffloadPrefetchTest, OffloadAStorageTwoLiveGraphsSavedIsPrefetchedForEach) {
  MakeTwoSavesAhead();
  // Graph A saves a0, shared and a1; graph B saves shared again, and b1.
  const std::vector<std::shared_ptr<TestStorage>> storages = {
      NewStorage(2 * kMiB, 301), NewStorage(2 * kMiB, 300), NewStorage(2 * kMiB, 302),
      NewStorage(2 * kMiB, 303)};
  const std::shared_ptr<TestStorage>& shared = storages[1];
  const KeeperId a0 = Save(storages[0]);
  const KeeperId shared_a = Save(shared);
  const KeeperId a1 = Save(storages[2]);
  const KeeperId shared_b = Save(shared);
  const KeeperId b1 = Save(storages[3]);
  for (const auto& s : storages) s->holders = 0;
  engine_->ForwardEnd();
  engine_->Synchronize();
  for (const auto& s : storages) ASSERT_EQ(StateOf(s), Residency::kSpilled);
  // Backward reads a save (acquired on the compute stream) and lets go of it.
  const auto read = [&](KeeperId id, uint32_t seed) {
    EXPECT_EQ(AcquireAndRead(id, 2 * kMiB), Pattern(2 * kMiB, seed));
    engine_->RemoveKeeper(id);
  };
  // A's backward first: its first read stalls and brings back the two saves before it in A.
  read(a1, 302);
  EXPECT_NE(StateOf(shared), Residency::kSpilled) << "not prefetched for the older graph's save";
  EXPECT_NE(StateOf(storages[0]), Residency::kSpilled);
  engine_->Synchronize();
  read(shared_a, 300);
  read(a0, 301);
  EXPECT_EQ(EngineStat("num_stalls"), 1);
  // B's backward: shared stayed on the device for it (acquired: never spilled again by a policy).
  read(b1, 303);
  read(shared_b, 300);
  EXPECT_EQ(EngineStat("host_bytes.current"), 0);
}

// A save whose keepers are gone is read by nobody: prefetch does not bring its storage back
// there (the storage waits, spilled, for the save still kept).
TEST_F(OffloadPrefetchTest, OffloadASaveWhoseKeepersWentIsNoReasonToPrefetch) {
  MakeTwoSavesAhead();
  auto late = NewStorage(2 * kMiB, 310);
  const KeeperId late_first = Save(late);
  auto between = NewStorage(2 * kMiB, 311);
  const KeeperId between_id = Save(between);
  const KeeperId late_again = Save(late);
  late->holders = 0;
  EndForwardSavesOnly({between});
  ASSERT_EQ(StateOf(late), Residency::kSpilled);
  engine_->RemoveKeeper(late_first);  // its graph went without reading it
  // Prefetch from `between` walks the saves older than it: the gone one is the only save there.
  engine_->Acquire(between_id, compute_);
  engine_->Synchronize();
  EXPECT_EQ(StateOf(late), Residency::kSpilled) << "brought back for a save nobody keeps";
  EXPECT_EQ(EngineStat("num_reloads"), 1);
  for (const KeeperId id : {late_again, between_id}) engine_->RemoveKeeper(id);
  // Every save of `late` gone, its entry went with them: a later walk over the saves where it was
  // listed finds nothing of it (a listing left behind would be read after the entry was freed).
  late.reset();
  auto after = NewStorage(2 * kMiB, 312);
  const KeeperId after_id = Save(after);
  EndForwardSavesOnly({after});
  EXPECT_EQ(AcquireAndRead(after_id, 2 * kMiB), Pattern(2 * kMiB, 312));
  EXPECT_EQ(EngineStat("num_reloads"), 2);
  engine_->RemoveKeeper(after_id);
}

// Two views of one storage acquired while its reload runs: one reload, one stall, timed from the
// first acquire (the second counted another stall and restarted the clock).
TEST_F(OffloadPrefetchTest, OffloadTwoViewsAcquiredDuringOneReloadAreOneStall) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 0;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 9);
  const KeeperId whole = Save(a);
  const KeeperId half = Save(a, /*offset=*/kMiB);
  EndForwardSavesOnly({a});
  ASSERT_EQ(StateOf(a), Residency::kSpilled);
  {
    auto hold = backend_->hold_stream(0, engine_->h2d_stream_for_testing(0).handle);
    engine_->Acquire(whole, compute_);
    const auto started = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    engine_->Acquire(half, compute_);
    ASSERT_EQ(StateOf(a), Residency::kReloading);
    // The first stall began before the sleep: its time counts from there.
    while (std::chrono::steady_clock::now() - started < std::chrono::milliseconds(60)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  engine_->Synchronize();
  EXPECT_EQ(EngineStat("num_reloads"), 1);
  EXPECT_EQ(EngineStat("num_stalls"), 1);
  EXPECT_GE(EngineStat("stall_us"), 50'000) << "the stall was timed from the second acquire";
}

// The window `auto` keeps resident follows entries as they come and go (each budget check used to
// sum it again over every entry): at every step it is what that sum gives, the newest entries of
// at least min_bytes whose bytes add up to at most prefetch_bytes.
TEST_F(OffloadPrefetchTest, OffloadPrefetchWindowFollowsSavesDropsAndSettings) {
  OffloadConfig config = Policy(OffloadPolicy::kOff);
  config.min_bytes = kMiB;
  config.prefetch_bytes = 10 * kMiB;
  Make(config, 1024 * kMiB, std::chrono::microseconds{0});
  std::mt19937 rng(7);
  std::vector<std::pair<std::shared_ptr<TestStorage>, KeeperId>> alive;
  const auto expected = [&]() -> const void* {
    const void* oldest = nullptr;
    size_t bytes = 0;
    std::vector<const void*> keys = engine_->EntryKeys();
    std::reverse(keys.begin(), keys.end());  // newest first
    for (const void* key : keys) {
      const size_t n = engine_->Describe(key)->nbytes;
      if (n < kMiB) continue;  // below min_bytes at its save
      if (bytes + n > *config.prefetch_bytes) break;
      bytes += n;
      oldest = key;
    }
    return oldest;
  };
  for (int step = 0; step < 400; ++step) {
    const uint32_t op = rng() % 10;
    if (op < 5 || alive.empty()) {
      const size_t sizes[] = {kMiB / 2, kMiB, 2 * kMiB, 3 * kMiB, 6 * kMiB, 11 * kMiB};
      auto s = NewStorage(sizes[rng() % 6], static_cast<uint32_t>(step));
      alive.emplace_back(s, Save(s));
    } else if (op < 9) {
      const size_t i = rng() % alive.size();
      engine_->RemoveKeeper(alive[i].second);
      alive.erase(alive.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      config.prefetch_bytes = (rng() % 16) * kMiB;
      engine_->SetConfig(config);
    }
    ASSERT_EQ(engine_->window_oldest_for_testing(0), expected()) << "step " << step;
  }
}

// A storage released by force (release()) is never reloaded: its bytes leave the prefetch window,
// which takes in the next older entry (they stayed counted, and pushed it out to be spilled).
TEST_F(OffloadPrefetchTest, OffloadAReleasedEntryLeavesThePrefetchWindow) {
  OffloadConfig config = Policy(OffloadPolicy::kOff);
  config.min_bytes = kMiB;
  config.prefetch_bytes = 8 * kMiB;
  Make(config, 256 * kMiB, std::chrono::microseconds{0});
  std::vector<std::shared_ptr<TestStorage>> saved;
  for (uint32_t i = 0; i < 3; ++i) {
    saved.push_back(NewStorage(4 * kMiB, i));
    Save(saved.back());
  }
  ASSERT_EQ(engine_->window_oldest_for_testing(0), saved[1].get());
  engine_->MarkReleased(saved[2].get(), "released by the test");
  EXPECT_EQ(engine_->window_oldest_for_testing(0), saved[0].get());
}

// Two graphs saved one after the other (F0, F1, then B0): an unpack of the older one prefetches
// its own saves, never the newer graph's, which would sit on the device until B1 (or forever,
// if that graph is dropped). (The regression this session fixed was in the hooks, which started
// backward with a prefetch from the newest save of all; test_autograd.py guards that.)
TEST_F(OffloadPrefetchTest, OffloadPrefetchLeavesANewerGraphSpilled) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 64 * kMiB;  // room for both graphs
  Make(config, 256 * kMiB, std::chrono::microseconds{0});
  std::vector<std::shared_ptr<TestStorage>> saved;
  std::vector<KeeperId> ids;
  for (uint32_t i = 0; i < 6; ++i) {  // 0..2: the first graph, 3..5: the second
    saved.push_back(NewStorage(2 * kMiB, i));
    ids.push_back(Save(saved.back()));
    saved.back()->holders = 0;
  }
  engine_->ForwardEnd();
  engine_->Synchronize();
  engine_->Acquire(ids[2], compute_);  // the first graph's backward begins
  engine_->Synchronize();
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(StateOf(saved[i]), Residency::kResident) << i;
  for (size_t i = 3; i < 6; ++i) EXPECT_EQ(StateOf(saved[i]), Residency::kSpilled) << i;
}

// Regression: the prefetch inside Acquire ran out of memory, and the rescue spilled the very
// entry being acquired (nothing else held it yet), handing the consumer a null pointer.
TEST_F(OffloadPrefetchTest, OffloadPrefetchRescueNeverSpillsTheEntryBeingAcquired) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 64 * kMiB;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  auto older = NewStorage(24 * kMiB, 1);
  auto newer = NewStorage(24 * kMiB, 2);
  Save(older);
  const KeeperId id = Save(newer);
  older->holders = 0;
  engine_->ForwardEnd();  // spills `older`; `newer` is still held by the program
  engine_->Synchronize();
  newer->holders = 0;  // now only its saved view keeps it, and it is resident
  storages_.clear();
  void* filler = allocator_->Malloc(24 * kMiB, 0, compute_);  // no room to prefetch `older`
  void* ptr = engine_->Acquire(id, compute_);
  ASSERT_NE(ptr, nullptr);
  EXPECT_EQ(ptr, newer->data());
  EXPECT_EQ(ReadOn(compute_, ptr, 24 * kMiB), Pattern(24 * kMiB, 2));
  allocator_->Free(filler);
}

// A prefetch is a guess: an allocation that fails otherwise gets its memory back, with no copy to
// the host (the host copy is kept until use), whether the prefetch's copy is still running, done
// but not yet noticed, or settled; under "off" too (backward after an inner "eager" block).
// Regression: the rescue spilled only settled resident entries, so with prefetch on backward ran
// out of memory where reloading at use fitted.
TEST_F(OffloadPrefetchTest, OffloadRescueGivesBackUnusedPrefetches) {
  enum class Copies { kRunning, kDone, kSettled };
  for (const Copies copies : {Copies::kRunning, Copies::kDone, Copies::kSettled}) {
    for (const OffloadPolicy backward_policy : {OffloadPolicy::kEager, OffloadPolicy::kOff}) {
      SCOPED_TRACE(copies == Copies::kRunning ? "prefetch copies running"
                   : copies == Copies::kDone  ? "prefetch copies done"
                                              : "prefetch copies settled");
      SCOPED_TRACE(backward_policy == OffloadPolicy::kOff ? "off in backward" : "eager");
      OffloadConfig config = Policy(OffloadPolicy::kEager);
      config.prefetch_bytes = size_t{1} << 30;  // as far as the budget lets it
      Make(config, 64 * kMiB, std::chrono::microseconds{0});
      std::vector<std::shared_ptr<TestStorage>> saved;
      std::vector<KeeperId> ids;
      for (uint32_t i = 0; i < 6; ++i) {  // 48 MiB in three 20 MiB segments
        saved.push_back(NewStorage(8 * kMiB, i));
        ids.push_back(Save(saved.back()));
        saved.back()->holders = 0;
      }
      storages_.clear();
      engine_->ForwardEnd();
      engine_->Synchronize();
      ASSERT_EQ(EngineStat("num_spills"), 6);
      config.policy = backward_policy;
      engine_->SetConfig(config);

      const StreamRef h2d = engine_->h2d_stream_for_testing(0);
      // Running copies finish only once the rescue waits for them (the consumer's stream waits
      // for the first all along).
      std::unique_ptr<SimBackend::StreamHold> hold =
          backend_->hold_stream(0, h2d.handle, SimBackend::HoldRelease::kWhenHostWaits);
      if (copies != Copies::kRunning) hold.reset();
      void* first = engine_->Acquire(ids[5], compute_);  // the first read prefetches the rest
      saved[5]->holders = 1;                             // the unpacked tensor uses it
      if (copies == Copies::kDone) backend_->synchronize_stream(0, h2d.handle);
      if (copies == Copies::kSettled) engine_->Synchronize();
      ASSERT_EQ(AllocStat("allocated_bytes.all.current"), int64_t{48 * kMiB});
      void* p = nullptr;
      EXPECT_NO_THROW(p = allocator_->Malloc(12 * kMiB, 0, compute_));
      if (hold != nullptr) {
        EXPECT_TRUE(hold->opened_by_wait()) << "the blocks given back did not wait for the copies";
      }
      // The new owner's bytes survive whatever the given-back copies were still to write.
      const std::vector<uint8_t> mine = Pattern(12 * kMiB, 99);
      if (p != nullptr) {
        backend_->memcpy_async(0, p, mine.data(), mine.size(), CopyKind::kHostToDevice,
                               compute_.handle);
      }
      backend_->synchronize_stream(0, h2d.handle);
      EXPECT_EQ(EngineStat("num_spills"), 6) << "the rescue copied a prefetch back to the host";
      EXPECT_EQ(StateOf(saved[0]), Residency::kSpilled) << "the oldest prefetch was not given back";
      if (p != nullptr) {
        EXPECT_EQ(ReadOn(compute_, p, mine.size()), mine);
        allocator_->Free(p);
      }
      // Every save still reads back intact.
      EXPECT_EQ(ReadOn(compute_, first, 8 * kMiB), Pattern(8 * kMiB, 5));
      for (int i = 4; i >= 0; --i) {
        void* ptr = engine_->Acquire(ids[static_cast<size_t>(i)], compute_);
        EXPECT_EQ(ReadOn(compute_, ptr, 8 * kMiB), Pattern(8 * kMiB, static_cast<uint32_t>(i)))
            << i;
      }
      // Acquired, the prefetches hold no host copy any more: only what is still spilled does.
      engine_->Synchronize();
      EXPECT_EQ(EngineStat("host_bytes.current"), 0);
    }
  }
}

// A prefetch that does not fit is given up quietly: its allocation is a guess (the budget here lies
// beyond the device, so only the device stops it). The out-of-memory ladder used to run for it,
// releasing the cache and counting an out-of-memory error nobody had, at every acquire.
TEST_F(OffloadPrefetchTest, APrefetchThatDoesNotFitRunsNoOutOfMemoryLadder) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.budget_bytes = size_t{1} << 30;  // more than the device: no budget stops a prefetch
  config.prefetch_bytes = 64 * kMiB;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::vector<std::shared_ptr<TestStorage>> saved;
  std::vector<KeeperId> ids;
  for (uint32_t i = 0; i < 4; ++i) {  // 12 MiB each: segments of their own size
    saved.push_back(NewStorage(12 * kMiB, i));
    ids.push_back(Save(saved.back()));
    saved.back()->holders = 0;
  }
  engine_->ForwardEnd();
  engine_->Synchronize();
  allocator_->EmptyCache();
  void* filler = allocator_->Malloc(40 * kMiB, 0, compute_);  // room for two reloads, not three
  const int64_t retries = AllocStat("num_alloc_retries");
  void* ptr = engine_->Acquire(ids[3], compute_);
  EXPECT_EQ(ReadOn(compute_, ptr, 12 * kMiB), Pattern(12 * kMiB, 3));
  engine_->Synchronize();
  EXPECT_NE(StateOf(saved[2]), Residency::kSpilled) << "the prefetch that fits was not made";
  EXPECT_EQ(StateOf(saved[1]), Residency::kSpilled);
  EXPECT_EQ(AllocStat("num_ooms"), 0);
  EXPECT_EQ(AllocStat("num_alloc_retries"), retries);
  allocator_->Free(filler);
}

// Adaptive prefetch (the default: prefetch_bytes unset) reloads beyond the next save up to an
// eighth of what forward spilled, and only while backward stays within forward's footprint:
// backward's peak is forward's, but for the next save. A fixed window as large as the old
// default's brought every save back at backward's first read.
TEST_F(OffloadPrefetchTest, AdaptivePrefetchGoesDeepWithinForwardsFootprint) {
  Make(Policy(OffloadPolicy::kEager), 256 * kMiB, std::chrono::microseconds{0});
  ASSERT_FALSE(engine_->config().prefetch_bytes.has_value()) << "adaptive is the default";
  constexpr uint32_t kSaves = 24;  // 48 MiB spilled: an eighth is three saves
  constexpr size_t kSize = 2 * kMiB;
  std::vector<std::shared_ptr<TestStorage>> saved;
  std::vector<KeeperId> ids;
  for (uint32_t i = 0; i < kSaves; ++i) {
    saved.push_back(NewStorage(kSize, i));
    ids.push_back(Save(saved.back()));
    // Forward holds its last four activations, as layers do their inputs and outputs.
    if (i >= 3) saved[i - 3]->holders = 0;
  }
  for (auto& s : saved) s->holders = 0;
  engine_->ForwardEnd();
  engine_->Synchronize();
  const int64_t forward_peak = AllocStat("allocated_bytes.all.peak");
  ASSERT_LT(forward_peak, static_cast<int64_t>(kSaves / 2 * kSize)) << "forward spilled little";
  allocator_->ResetPeakStats(0);
  for (int i = kSaves - 1; i >= 0; --i) {
    const auto k = static_cast<size_t>(i);
    void* ptr = engine_->Acquire(ids[k], compute_);
    EXPECT_EQ(ReadOn(compute_, ptr, kSize), Pattern(kSize, static_cast<uint32_t>(i))) << i;
    if (i == static_cast<int>(kSaves) - 1) {
      // Deeper than the next save: the footprint has room for more.
      EXPECT_NE(StateOf(saved[k - 1]), Residency::kSpilled);
      EXPECT_NE(StateOf(saved[k - 2]), Residency::kSpilled);
      EXPECT_EQ(StateOf(saved[k - 5]), Residency::kSpilled) << "reloaded past an eighth";
      EXPECT_EQ(StateOf(saved[0]), Residency::kSpilled);
    }
    engine_->Synchronize();
    engine_->RemoveKeeper(ids[k]);
    saved[k]->drop_device_memory();  // backward is done with it
  }
  EXPECT_LE(AllocStat("allocated_bytes.all.peak"), forward_peak + static_cast<int64_t>(kSize))
      << "backward's prefetch raised the peak past forward's and the next save";
  EXPECT_GE(EngineStat("num_prefetch_hits"), static_cast<int64_t>(kSaves) - 2);
}

// Under `auto` with adaptive prefetch no window of the newest saves stays resident: the budget
// holds however small it is against the saves (a 256 MiB window, the old default, kept them all).
TEST_F(OffloadPrefetchTest, AdaptivePrefetchLeavesAutoItsBudget) {
  OffloadConfig config = Policy(OffloadPolicy::kAuto);
  config.budget_bytes = 8 * kMiB;
  Make(config, 256 * kMiB, std::chrono::microseconds{0});
  std::vector<std::shared_ptr<TestStorage>> saved;
  std::vector<KeeperId> ids;
  for (uint32_t i = 0; i < 10; ++i) {  // 20 MiB of saves
    saved.push_back(NewStorage(2 * kMiB, i));
    ids.push_back(Save(saved.back()));
    saved.back()->holders = 0;
  }
  engine_->ForwardEnd();
  engine_->Synchronize();
  EXPECT_LE(AllocStat("allocated_bytes.all.peak"), static_cast<int64_t>(8 * kMiB));
  for (int i = 9; i >= 0; --i) {
    const auto k = static_cast<size_t>(i);
    void* ptr = engine_->Acquire(ids[k], compute_);
    EXPECT_EQ(ReadOn(compute_, ptr, 2 * kMiB), Pattern(2 * kMiB, static_cast<uint32_t>(i))) << i;
    engine_->RemoveKeeper(ids[k]);
    saved[k]->drop_device_memory();
  }
  EXPECT_LE(AllocStat("allocated_bytes.all.peak"), static_cast<int64_t>(8 * kMiB));
}

// Under `auto`, an allocation that would pass the budget gets back prefetches nobody read yet,
// oldest first, before anything is spilled: backward's own allocations landed on top of them and
// passed the budget (the newest saves, kept resident, were no candidates either).
TEST_F(OffloadPrefetchTest, AutoGivesBackUnreadPrefetchesToHoldItsBudget) {
  OffloadConfig config = Policy(OffloadPolicy::kAuto);
  config.budget_bytes = 10 * kMiB;
  config.prefetch_bytes = 8 * kMiB;  // the newest 8 MiB stay resident: nothing else to spill
  Make(config, 256 * kMiB, std::chrono::microseconds{0});
  std::vector<std::shared_ptr<TestStorage>> saved;
  std::vector<KeeperId> ids;
  for (uint32_t i = 0; i < 8; ++i) {
    saved.push_back(NewStorage(2 * kMiB, i));
    ids.push_back(Save(saved.back()));
    saved.back()->holders = 0;
  }
  engine_->ForwardEnd();
  engine_->Synchronize();
  ASSERT_EQ(StateOf(saved[2]), Residency::kSpilled);
  // Backward reads the newest save and is done with it; the next read prefetches into the room.
  engine_->Acquire(ids[7], compute_);
  engine_->RemoveKeeper(ids[7]);
  saved[7]->drop_device_memory();
  void* ptr = engine_->Acquire(ids[6], compute_);
  engine_->Synchronize();
  std::vector<size_t> prefetched;
  for (size_t k = 0; k < 6; ++k) {
    if (engine_->Describe(saved[k].get())->prefetched) prefetched.push_back(k);
  }
  ASSERT_FALSE(prefetched.empty()) << "the setup prefetched nothing";
  // Backward's gradient: past the budget unless the unread prefetches go.
  auto gradient = std::make_shared<TestStorage>(*allocator_, 2 * kMiB, compute_);
  EXPECT_LE(AllocStat("allocated_bytes.all.current"), static_cast<int64_t>(10 * kMiB));
  for (const size_t k : prefetched) {
    EXPECT_EQ(StateOf(saved[k]), Residency::kSpilled) << "prefetch " << k << " was kept";
  }
  EXPECT_EQ(ReadOn(compute_, ptr, 2 * kMiB), Pattern(2 * kMiB, 6));
  for (int i = 5; i >= 0; --i) {
    const auto k = static_cast<size_t>(i);
    void* p = engine_->Acquire(ids[k], compute_);
    EXPECT_EQ(ReadOn(compute_, p, 2 * kMiB), Pattern(2 * kMiB, static_cast<uint32_t>(i))) << i;
  }
}

}  // namespace
}  // namespace spillway::testing
