// Each policy's contract and the out-of-memory rescue (prefetch: prefetch_test.cc).
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

// A save given settings of its own (those of the block open on the saving thread) follows them,
// not the configuration another thread's block set since: in both directions, "off" and
// min_bytes.
TEST_F(OffloadPolicyTest, OffloadASaveFollowsItsOwnSettingsOverTheConfiguration) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.min_bytes = 16 * kMiB;  // nothing below would be spilled by the configuration
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  auto own_eager = NewStorage(2 * kMiB, 1);
  auto own_off = NewStorage(2 * kMiB, 2);
  auto own_minimum = NewStorage(2 * kMiB, 3);
  Save(own_eager, 0, SaveSettings{.never_spill = false, .min_bytes = 0});
  Save(own_off, 0, SaveSettings{.never_spill = true, .min_bytes = 0});
  Save(own_minimum, 0, SaveSettings{.never_spill = false, .min_bytes = 4 * kMiB});
  // The configuration says spill all (of any size) now: only the first save may go.
  config.min_bytes = 0;
  engine_->SetConfig(config);
  auto configured = NewStorage(2 * kMiB, 4);
  Save(configured);  // without settings: the configuration's
  EndForwardSavesOnly({own_eager, own_off, own_minimum, configured});
  EXPECT_EQ(StateOf(own_eager), Residency::kSpilled) << "its own min_bytes of 0 was not followed";
  EXPECT_EQ(StateOf(own_off), Residency::kResident) << "a save under its own \"off\" was spilled";
  EXPECT_EQ(StateOf(own_minimum), Residency::kResident) << "its own min_bytes was not followed";
  EXPECT_EQ(StateOf(configured), Residency::kSpilled);
  EXPECT_EQ(EngineStat("skipped.small"), 1);
}

// A save made while a backward runs (a reentrant checkpoint's recomputation) is read in that
// backward: eager keeps it on the device and counts it once; the out-of-memory rescue may still
// spill it (a recomputation that does not fit otherwise), and it comes back intact. A forward's
// save that was spilled and read back before backward saved it again (the region's input) is not
// counted: nothing was kept on the device for it. (As a forward's save, eager spilled the
// recomputed one at once.)
TEST_F(OffloadPolicyTest, OffloadASaveMadeInBackwardStaysOnTheDevice) {
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
  auto input = NewStorage(2 * kMiB, 1);
  const KeeperId input_id = Save(input);
  EndForwardSavesOnly({input});
  ASSERT_EQ(StateOf(input), Residency::kSpilled);
  EXPECT_EQ(AcquireAndRead(input_id, 2 * kMiB), Pattern(2 * kMiB, 1));
  const KeeperId input_again = Save(input, 0, std::nullopt, SavePhase::kBackward);
  auto recomputed = NewStorage(2 * kMiB, 2);
  const KeeperId recomputed_id = Save(recomputed, 0, std::nullopt, SavePhase::kBackward);
  Save(recomputed, 0, std::nullopt, SavePhase::kBackward);  // a second view: counted once
  recomputed->holders = 0;                                  // only its saves keep it
  engine_->RunPolicy();
  engine_->Synchronize();
  EXPECT_EQ(StateOf(recomputed), Residency::kResident) << "eager spilled a save of backward";
  EXPECT_EQ(StateOf(input), Residency::kResident);
  EXPECT_EQ(EngineStat("skipped.backward"), 1);
  // Both, the oldest (the input) first.
  EXPECT_GE(engine_->ReleaseMemory(0, 4 * kMiB), size_t{4 * kMiB});
  EXPECT_EQ(StateOf(recomputed), Residency::kSpilled) << "the rescue could not spill it";
  EXPECT_EQ(AcquireAndRead(recomputed_id, 2 * kMiB), Pattern(2 * kMiB, 2));
  engine_->RemoveKeeper(input_again);
  engine_->RemoveKeeper(input_id);
  EXPECT_EQ(EngineStat("num_entries"), 1);  // the recomputed storage's, still kept
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

// A storage saved early and again late in forward (a mask, a residual every layer reads) is read
// first in backward, at its latest save: auto keeps it with the newest saves, not the oldest it
// spills first (it kept its first save's place, and backward began with a stall).
TEST_F(OffloadPolicyTest, OffloadAutoTakesAStorageSavedAgainAsNew) {
  OffloadConfig config = Policy(OffloadPolicy::kAuto);
  config.budget_bytes = 16 * kMiB;
  config.prefetch_bytes = 8 * kMiB;
  Make(config, 256 * kMiB, std::chrono::microseconds{0});
  auto shared = NewStorage(4 * kMiB, 100);  // in use all forward long
  Save(shared);
  std::vector<std::shared_ptr<TestStorage>> layers;
  for (uint32_t i = 0; i < 4; ++i) {
    layers.push_back(NewStorage(4 * kMiB, i));
    Save(layers.back());
    layers.back()->holders = 0;
  }
  Save(shared);
  shared->holders = 0;
  layers.push_back(NewStorage(4 * kMiB, 4));
  Save(layers.back());  // over the budget: the oldest outside the window go
  layers.back()->holders = 0;
  engine_->ForwardEnd();
  EXPECT_EQ(StateOf(shared), Residency::kResident);
  EXPECT_EQ(StateOf(layers[4]), Residency::kResident);
  EXPECT_NE(StateOf(layers[0]), Residency::kResident);
  EXPECT_NE(StateOf(layers[1]), Residency::kResident);
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
  EndForwardSavesOnly({a, b});
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
  EndForwardSavesOnly({c});
  EXPECT_EQ(StateOf(c), Residency::kSpilled);
  EXPECT_EQ(ReadOn(compute_, engine_->Acquire(idc, compute_), 2 * kMiB), Pattern(2 * kMiB, 33));
  EXPECT_EQ(ReadOn(compute_, engine_->Acquire(idb, compute_), 2 * kMiB), Pattern(2 * kMiB, 32));
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
