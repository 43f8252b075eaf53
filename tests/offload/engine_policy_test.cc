// Each policy's contract, the out-of-memory rescue and prefetch.
#include <algorithm>
#include <chrono>
#include <random>
#include <thread>

#include "tests/counting_sim_backend.h"
#include "tests/offload/engine_fixture.h"

namespace spillway::testing {
namespace {

using OffloadPolicyTest = OffloadEngineTest;

TEST_F(OffloadPolicyTest, OffloadOffNeverSpills) {
  Make(Policy(OffloadPolicy::kOff), 64 * kMiB, std::chrono::microseconds{0});
  auto s = NewStorage(4 * kMiB, 1);
  Save(s);
  s->holders = 0;
  engine_->ForwardEnd();
  EXPECT_EQ(StateOf(s), Residency::kResident);
  EXPECT_EQ(engine_->ReleaseMemory(0, 4 * kMiB), 0u);
}

// Each save follows the block it was saved in: an "off" block nested in an "eager" one keeps its
// saves on the device after the outer policy comes back, rescue included; the outer block's own
// saves are spilled as before.
TEST_F(OffloadPolicyTest, OffloadSavesMadeUnderOffStayWhenEagerComesBack) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  auto outer = NewStorage(2 * kMiB, 1);
  Save(outer);
  engine_->SetConfig(Policy(OffloadPolicy::kOff));
  auto inner = NewStorage(2 * kMiB, 2);
  Save(inner);
  engine_->SetConfig(Policy(OffloadPolicy::kEager));
  outer->holders = 0;
  inner->holders = 0;
  engine_->ForwardEnd();
  EXPECT_NE(StateOf(outer), Residency::kResident);
  EXPECT_EQ(StateOf(inner), Residency::kResident) << "a save made under \"off\" was spilled";
  EXPECT_EQ(engine_->ReleaseMemory(0, 64 * kMiB), 0u) << "the rescue spilled it";
  EXPECT_EQ(StateOf(inner), Residency::kResident);
}

TEST_F(OffloadPolicyTest, OffloadEagerSpillsEveryEligibleEntryByForwardEnd) {
  Make(Policy(OffloadPolicy::kEager, kMiB), 256 * kMiB, std::chrono::microseconds{0});
  std::vector<std::shared_ptr<TestStorage>> saved;
  for (uint32_t i = 0; i < 8; ++i) {
    saved.push_back(NewStorage(2 * kMiB, i));
    Save(saved.back());
  }
  auto small = NewStorage(64 * kKiB, 99);  // below offload_min_kb
  Save(small);
  auto held = saved[3];  // still used by the program
  for (auto& s : saved) s->holders = 0;
  small->holders = 0;
  held->holders = 1;
  engine_->ForwardEnd();
  for (auto& s : saved) {
    if (s == held) {
      EXPECT_EQ(StateOf(s), Residency::kResident);
    } else {
      EXPECT_NE(StateOf(s), Residency::kResident);
    }
  }
  EXPECT_EQ(StateOf(small), Residency::kResident);
  EXPECT_EQ(EngineStat("skipped.small"), 1);
  EXPECT_EQ(EngineStat("num_spills"), 7);
}

TEST_F(OffloadPolicyTest, OffloadEagerSpillsAsSoonAsTheNextSave) {
  Make(Policy(OffloadPolicy::kEager), 256 * kMiB, std::chrono::microseconds{0});
  auto first = NewStorage(2 * kMiB, 1);
  Save(first);
  first->holders = 0;
  auto second = NewStorage(2 * kMiB, 2);
  Save(second);  // the policy runs at each save
  EXPECT_NE(StateOf(first), Residency::kResident);
  EXPECT_EQ(StateOf(second), Residency::kResident);
}

TEST_F(OffloadPolicyTest, OffloadAutoKeepsAllocatedUnderBudget) {
  OffloadConfig config = Policy(OffloadPolicy::kAuto);
  config.budget_bytes = 24 * kMiB;
  config.prefetch_bytes = 4 * kMiB;
  Make(config, 256 * kMiB, std::chrono::microseconds{0});
  allocator_->ResetPeakStats(0);
  std::vector<std::shared_ptr<TestStorage>> layer_outputs;
  for (uint32_t i = 0; i < 20; ++i) {
    auto s = NewStorage(4 * kMiB, i);
    Save(s);
    if (!layer_outputs.empty()) layer_outputs.back()->holders = 0;  // previous layer done
    layer_outputs.push_back(s);
    storages_.clear();
  }
  // The spill makes room before each allocation, so allocated bytes never pass the budget.
  EXPECT_LE(AllocStat("allocated_bytes.all.peak"), int64_t{24 * kMiB});
  EXPECT_GT(EngineStat("num_spills"), 10);
  // Oldest saved go first; the newest stay resident.
  EXPECT_NE(StateOf(layer_outputs.front()), Residency::kResident);
  EXPECT_EQ(StateOf(layer_outputs.back()), Residency::kResident);
}

TEST_F(OffloadPolicyTest, OffloadAutoDoesNothingUnderBudget) {
  OffloadConfig config = Policy(OffloadPolicy::kAuto);
  config.budget_bytes = 200 * kMiB;
  Make(config, 256 * kMiB, std::chrono::microseconds{0});
  for (uint32_t i = 0; i < 10; ++i) {
    auto s = NewStorage(4 * kMiB, i);
    Save(s);
    s->holders = 0;
  }
  engine_->ForwardEnd();
  EXPECT_EQ(EngineStat("num_spills"), 0);
}

TEST_F(OffloadPolicyTest, OffloadBudgetDefaultsToFractionOfTheLimit) {
  OffloadConfig config = Policy(OffloadPolicy::kAuto);
  config.budget_fraction = 0.5;
  AllocatorConfig allocator_config;
  allocator_config.memory_limit_bytes = 100 * kMiB;
  Make(config, 256 * kMiB, std::chrono::microseconds{0}, allocator_config);
  EXPECT_EQ(engine_->budget_bytes(0), 50 * kMiB);
}

// A limit beyond the device (memory_limit_mb larger than it has) is no base for the budget: it
// is a fraction of the device, and `auto` spills at it, not only when memory runs out (user
// review: budget 3.2 GiB on a 64 MiB device, peak 62 MiB held by the out-of-memory rescue alone).
TEST_F(OffloadPolicyTest, OffloadBudgetOfALimitBeyondTheDeviceIsAFractionOfTheDevice) {
  OffloadConfig config = Policy(OffloadPolicy::kAuto);
  config.budget_fraction = 0.5;
  config.prefetch_bytes = 4 * kMiB;
  AllocatorConfig allocator_config;
  allocator_config.memory_limit_bytes = 4096 * kMiB;
  Make(config, 64 * kMiB, std::chrono::microseconds{0}, allocator_config);
  EXPECT_EQ(engine_->budget_bytes(0), 32 * kMiB);
  allocator_->ResetPeakStats(0);
  for (uint32_t i = 0; i < 12; ++i) {
    auto s = NewStorage(4 * kMiB, i);
    Save(s);
    s->holders = 0;
    storages_.clear();
  }
  EXPECT_LE(AllocStat("allocated_bytes.all.peak"), int64_t{32 * kMiB});
  EXPECT_EQ(AllocStat("num_alloc_retries"), 0) << "only the out-of-memory rescue spilled";
}

TEST_F(OffloadPolicyTest, OffloadOomRescueTurnsAFailingAllocationIntoSuccess) {
  OffloadConfig config = Policy(OffloadPolicy::kAuto);
  config.budget_bytes = 1024 * kMiB;  // the budget never triggers: only the rescue can help
  Make(config, 64 * kMiB, std::chrono::microseconds{2000});
  std::vector<std::shared_ptr<TestStorage>> saved;
  for (uint32_t i = 0; i < 5; ++i) {
    saved.push_back(NewStorage(10 * kMiB, i));
    Save(saved.back());
    saved.back()->holders = 0;
  }
  storages_.clear();
  void* p = allocator_->Malloc(30 * kMiB, 0, compute_);  // 50 of 64 MiB are held by saved entries
  EXPECT_NE(p, nullptr);
  EXPECT_GE(EngineStat("num_spills"), 2);
  allocator_->Free(p);
  // Every spilled entry still comes back intact.
  for (uint32_t i = 0; i < saved.size(); ++i) {
    const auto info = engine_->Describe(saved[i].get());
    const KeeperId id = info->keepers.at(0).id;
    void* ptr = engine_->Acquire(id, compute_);
    EXPECT_EQ(ReadOn(compute_, ptr, 10 * kMiB), Pattern(10 * kMiB, i)) << i;
  }
}

// The rescue spills for what the request needs, not for PyTorch's 20 MiB segment: one 2 MiB
// entry for a 2 MiB request on a full device.
TEST_F(OffloadPolicyTest, OffloadOomRescueSpillsOnlyWhatTheRequestNeeds) {
  OffloadConfig config = Policy(OffloadPolicy::kAuto);
  config.budget_bytes = 1024 * kMiB;  // the budget never triggers: only the rescue can help
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::vector<std::shared_ptr<TestStorage>> saved;
  for (uint32_t i = 0; i < 32; ++i) {  // three 20 MiB segments and two 2 MiB ones: full
    saved.push_back(NewStorage(2 * kMiB, i));
    Save(saved.back());
    saved.back()->holders = 0;
  }
  storages_.clear();
  ASSERT_EQ(AllocStat("reserved_bytes.all.current"), int64_t{64 * kMiB});
  void* p = allocator_->Malloc(2 * kMiB, 0, compute_);
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(EngineStat("num_spills"), 1);
  allocator_->Free(p);
}

TEST_F(OffloadPolicyTest, OffloadWithoutRescueTheSameAllocationFails) {
  Make(Policy(OffloadPolicy::kOff), 64 * kMiB, std::chrono::microseconds{0});
  for (uint32_t i = 0; i < 5; ++i) {
    auto s = NewStorage(10 * kMiB, i);
    Save(s);
    s->holders = 0;
  }
  EXPECT_THROW(allocator_->Malloc(30 * kMiB, 0, compute_), OutOfMemoryError);
}

// A prefetch is a guess: under every policy it stops at the budget (80% of the device by
// default), leaving backward's own allocations their headroom, however large the window.
TEST_F(OffloadPolicyTest, OffloadPrefetchStopsAtTheBudgetUnderEagerToo) {
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

TEST_F(OffloadPolicyTest, OffloadPrefetchReloadsAheadInReverseSaveOrder) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 4 * kMiB;
  Make(config, 256 * kMiB, std::chrono::microseconds{0});
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

// Two views of one storage acquired while its reload runs: one reload, one stall, timed from the
// first acquire (the second counted another stall and restarted the clock).
TEST_F(OffloadPolicyTest, OffloadTwoViewsAcquiredDuringOneReloadAreOneStall) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 0;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 9);
  const KeeperId whole = Save(a);
  const KeeperId half = Save(a, /*offset=*/kMiB);
  a->holders = 0;
  engine_->ForwardEnd();
  engine_->Synchronize();
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

// A request larger than the device fits nowhere: `auto` spills nothing for it (its budget check
// spilled every save, for nothing, before the out-of-memory error), as a batch-size search that
// probes sizes too large would make it at every probe. The error is the same.
TEST_F(OffloadPolicyTest, OffloadAutoSpillsNothingForARequestLargerThanTheDevice) {
  OffloadConfig config = Policy(OffloadPolicy::kAuto);
  config.budget_bytes = 16 * kMiB;
  config.prefetch_bytes = 0;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::vector<std::shared_ptr<TestStorage>> saved;
  std::vector<KeeperId> ids;
  for (uint32_t i = 0; i < 3; ++i) {
    saved.push_back(NewStorage(4 * kMiB, 40 + i));
    ids.push_back(Save(saved.back()));
    saved.back()->holders = 0;
  }
  EXPECT_THROW(allocator_->Malloc(128 * kMiB, 0, compute_), OutOfMemoryError);
  EXPECT_EQ(EngineStat("num_spills"), 0) << "saves were spilled for a request that fits nowhere";
  for (uint32_t i = 0; i < 3; ++i) EXPECT_EQ(StateOf(saved[i]), Residency::kResident);
}

// With no pinned buffer of a size to be had (here the host limit), `auto` tries no entry as large
// in that pass, and counts each entry kept for it once (the skip counts grew by the number of
// candidates at each allocation). A smaller entry that fits is still spilled.
TEST_F(OffloadPolicyTest, OffloadAutoWithoutHostMemoryCountsEachRefusalOnce) {
  OffloadConfig config = Policy(OffloadPolicy::kAuto);
  config.budget_bytes = 8 * kMiB;
  config.prefetch_bytes = 0;
  config.host_limit_bytes = kMiB;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::vector<std::shared_ptr<TestStorage>> saved;
  std::vector<KeeperId> ids;
  for (uint32_t i = 0; i < 4; ++i) {
    saved.push_back(NewStorage(4 * kMiB, i));
    ids.push_back(Save(saved.back()));
    saved.back()->holders = 0;
  }
  std::shared_ptr<TestStorage> small = NewStorage(kMiB / 2, 9);
  const KeeperId small_id = Save(small);
  small->holders = 0;
  for (int i = 0; i < 10; ++i) allocator_->Free(allocator_->Malloc(4 * kMiB, 0, compute_));
  EXPECT_EQ(EngineStat("skipped.host_limit"), 4) << "one per storage kept, not per allocation";
  EXPECT_EQ(EngineStat("num_spills"), 1);
  for (uint32_t i = 0; i < 4; ++i) EXPECT_EQ(StateOf(saved[i]), Residency::kResident);
  EXPECT_NE(StateOf(small), Residency::kResident);
  EXPECT_EQ(ReadOn(compute_, engine_->Acquire(small_id, compute_), kMiB / 2), Pattern(kMiB / 2, 9));
}

// Under eager, a save refused for want of host memory is spilled once memory comes back (it was
// refused for good, and stayed on the device for the rest of its life).
TEST_F(OffloadPolicyTest, OffloadEagerSpillsWhatHostMemoryRefusedOnceItComesBack) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 0;
  config.host_limit_bytes = 4 * kMiB;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(4 * kMiB, 1);
  std::shared_ptr<TestStorage> b = NewStorage(4 * kMiB, 2);
  const KeeperId ida = Save(a);
  const KeeperId idb = Save(b);
  a->holders = b->holders = 0;
  engine_->ForwardEnd();
  engine_->Synchronize();
  ASSERT_EQ(StateOf(a), Residency::kSpilled);
  ASSERT_EQ(StateOf(b), Residency::kResident) << "the host limit did not hold b back";
  EXPECT_EQ(EngineStat("skipped.host_limit"), 1);
  a.reset();
  engine_->RemoveKeeper(ida);  // its host copy goes back
  engine_->ForwardEnd();
  engine_->Synchronize();
  EXPECT_EQ(StateOf(b), Residency::kSpilled);
  EXPECT_EQ(ReadOn(compute_, engine_->Acquire(idb, compute_), 4 * kMiB), Pattern(4 * kMiB, 2));
}

// A host limit set after the device's pinned pool exists applies to it (the pool took its limit
// when made, and kept it): spills that would pass it are refused, and lifting it lets them go.
TEST_F(OffloadPolicyTest, OffloadAHostLimitSetLaterAppliesToTheDevicesPool) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 0;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(2 * kMiB, 31);
  const KeeperId ida = Save(a);
  a->holders = 0;
  engine_->ForwardEnd();  // the device's pool is made, with no limit
  engine_->Synchronize();
  ASSERT_EQ(StateOf(a), Residency::kSpilled);
  EXPECT_EQ(ReadOn(compute_, engine_->Acquire(ida, compute_), 2 * kMiB), Pattern(2 * kMiB, 31));
  engine_->Synchronize();
  engine_->TrimHostMemory();  // nothing pinned stays behind for the spill below
  config.host_limit_bytes = kMiB;
  engine_->SetConfig(config);
  std::shared_ptr<TestStorage> b = NewStorage(2 * kMiB, 32);
  const KeeperId idb = Save(b);
  b->holders = 0;
  engine_->ForwardEnd();
  EXPECT_EQ(StateOf(b), Residency::kResident) << "a spill passed the host limit set later";
  EXPECT_EQ(EngineStat("skipped.host_limit"), 1);
  config.host_limit_bytes = 0;
  engine_->SetConfig(config);
  std::shared_ptr<TestStorage> c = NewStorage(2 * kMiB, 33);
  const KeeperId idc = Save(c);
  c->holders = 0;
  engine_->ForwardEnd();
  engine_->Synchronize();
  EXPECT_EQ(StateOf(c), Residency::kSpilled);
  EXPECT_EQ(ReadOn(compute_, engine_->Acquire(idc, compute_), 2 * kMiB), Pattern(2 * kMiB, 33));
  EXPECT_EQ(ReadOn(compute_, engine_->Acquire(idb, compute_), 2 * kMiB), Pattern(2 * kMiB, 32));
}

// The window `auto` keeps resident follows entries as they come and go (each budget check used to
// sum it again over every entry): at every step it is what that sum gives, the newest entries of
// at least min_bytes whose bytes add up to at most prefetch_bytes.
TEST_F(OffloadPolicyTest, OffloadPrefetchWindowFollowsSavesDropsAndSettings) {
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
      if (bytes + n > config.prefetch_bytes) break;
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
TEST_F(OffloadPolicyTest, OffloadAReleasedEntryLeavesThePrefetchWindow) {
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
TEST_F(OffloadPolicyTest, OffloadPrefetchLeavesANewerGraphSpilled) {
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

}  // namespace
}  // namespace spillway::testing

namespace spillway::testing {
namespace {

// Regression: the prefetch inside Acquire ran out of memory, and the rescue spilled the very
// entry being acquired (nothing else held it yet), handing the consumer a null pointer.
TEST_F(OffloadPolicyTest, OffloadPrefetchRescueNeverSpillsTheEntryBeingAcquired) {
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
TEST_F(OffloadPolicyTest, OffloadRescueGivesBackUnusedPrefetches) {
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
      std::unique_ptr<SimBackend::StreamHold> hold = backend_->hold_stream(0, h2d.handle);
      if (copies != Copies::kRunning) hold.reset();
      void* first = engine_->Acquire(ids[5], compute_);  // the first read prefetches the rest
      saved[5]->holders = 1;                             // the unpacked tensor uses it
      if (copies == Copies::kDone) backend_->synchronize_stream(0, h2d.handle);
      if (copies == Copies::kSettled) engine_->Synchronize();
      ASSERT_EQ(AllocStat("allocated_bytes.all.current"), int64_t{48 * kMiB});
      // Running copies finish only while the rescue waits for them.
      std::thread opener([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        hold.reset();
      });
      void* p = nullptr;
      EXPECT_NO_THROW(p = allocator_->Malloc(12 * kMiB, 0, compute_));
      // The new owner's bytes survive whatever the given-back copies were still to write.
      const std::vector<uint8_t> mine = Pattern(12 * kMiB, 99);
      if (p != nullptr) {
        backend_->memcpy_async(0, p, mine.data(), mine.size(), CopyKind::kHostToDevice,
                               compute_.handle);
      }
      opener.join();
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

// A refused configuration leaves the allocator as it was: no callback into an engine that never
// came to be (the out-of-memory ladder below would call one), and the engine's settings unchanged.
TEST_F(OffloadPolicyTest, OffloadAConfigurationOutOfRangeIsRefused) {
  OffloadConfig bad;
  bad.budget_fraction = 2.0;
  try {
    OffloadEngine engine(*allocator_, bad);
    ADD_FAILURE() << "accepted budget_fraction 2";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("OffloadConfig.budget_fraction = 2"), std::string::npos)
        << e.what();
  }
  const OffloadConfig before = engine_->config();
  EXPECT_THROW(engine_->SetConfig(bad), InvalidArgumentError);
  EXPECT_EQ(engine_->config(), before);
  engine_.reset();  // the only engine that came to be goes; none may be called now
  // A request the device could hold, were it not full: the ladder asks whoever registered.
  void* full = allocator_->Malloc(size_t{200} << 20, 0, compute_);
  EXPECT_THROW(allocator_->Malloc(size_t{100} << 20, 0, compute_), OutOfMemoryError);
  allocator_->Free(full);
}

// One process per GPU is the common case: an auto budget must not ask the other devices for their
// memory (on CUDA the question creates a context on each).
TEST(OffloadBudget, OffloadAutoAsksOnlyTheDevicesInUse) {
  auto backend = CountingSimBackend::Make(3, 64 * kMiB);
  CachingAllocator allocator(backend, AllocatorConfig{});
  OffloadConfig config;
  config.policy = OffloadPolicy::kAuto;
  config.budget_fraction = 0.5;
  OffloadEngine engine(allocator, config);
  EXPECT_TRUE(backend->mem_info_calls.empty());
  void* p = allocator.Malloc(4 * kMiB, 2, backend->default_stream(2));
  EXPECT_EQ(backend->mem_info_calls.size(), 1u);
  EXPECT_EQ(backend->mem_info_calls.count(2), 1u);
  EXPECT_EQ(engine.budget_bytes(2), 32 * kMiB);
  engine.ForwardEnd();  // the budget check of every device: only device 2 holds memory
  EXPECT_EQ(backend->mem_info_calls.size(), 1u);
  EXPECT_EQ(backend->mem_info_calls.count(2), 1u);
  allocator.Free(p);
}

}  // namespace
}  // namespace spillway::testing
