// The residency state machine, one test per transition, and the keeper rules.
#include <gmock/gmock.h>

#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "tests/offload/engine_fixture.h"

namespace spillway::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;

class OffloadTransitions : public OffloadEngineTest {
 protected:
  void SetUp() override {
    Make(Policy(OffloadPolicy::kEager), size_t{256} << 20, std::chrono::microseconds{0});
  }

  // Who Describe says keeps the storage `key`: each keeper's id, and whether its bytes are lost.
  std::vector<std::pair<KeeperId, bool>> KeepersOf(const void* key) const {
    std::vector<std::pair<KeeperId, bool>> out;
    const std::optional<EntryInfo> info = engine_->Describe(key);
    if (info) {
      for (const KeeperInfo& k : info->keepers) out.emplace_back(k.id, k.lost);
    }
    return out;
  }
};

// The engine's last hold on a storage goes with no engine lock held, whether the storage was
// resident or spilled: from torch 2.10 on that release can take the GIL (under the lock, a
// deadlock with a Python thread waiting for the engine) and run code that comes back to it.
TEST_F(OffloadTransitions, AStoragesLastReleaseRunsOutsideTheEngineLock) {
  class Watched : public AllocatorStorage {
   public:
    Watched(CachingAllocator& allocator, StreamRef stream, std::optional<bool>& released_inside)
        : AllocatorStorage(allocator, kMiB, stream), released_inside_(released_inside) {}
    ~Watched() override { released_inside_ = OffloadEngine::InsideEngineOnThisThread(); }

   private:
    std::optional<bool>& released_inside_;
  };
  for (const bool spill : {false, true}) {
    std::optional<bool> released_inside;
    auto s = std::make_shared<Watched>(*allocator_, compute_, released_inside);
    const auto id = engine_->AddKeeper(
        s.get(), [&] { return s; }, FloatView(kMiB), compute_);
    ASSERT_TRUE(id.has_value());
    if (spill) {
      EndForwardSavesOnly({s});
      ASSERT_EQ(engine_->Describe(s.get())->residency, Residency::kSpilled);
    }
    s.reset();  // the engine's hold is the last
    ASSERT_FALSE(released_inside.has_value());
    engine_->RemoveKeeper(*id);
    ASSERT_TRUE(released_inside.has_value()) << "the storage outlived its last keeper";
    EXPECT_FALSE(*released_inside) << "released under the engine's lock (spilled: " << spill << ")";
  }
}

TEST_F(OffloadTransitions, FullCycleKeepsEveryByte) {
  auto s = NewStorage(4 * kMiB, 7);
  const KeeperId id = Save(s);
  EXPECT_EQ(StateOf(s), Residency::kResident);  // the forward pass still holds it
  s->holders = 0;
  engine_->ForwardEnd();
  const Residency after_spill = StateOf(s);
  EXPECT_TRUE(after_spill == Residency::kSpilling || after_spill == Residency::kSpilled);
  EXPECT_EQ(s->data(), nullptr);
  EXPECT_EQ(AllocStat("allocated_bytes.all.current"), 0);  // device block given back
  engine_->Synchronize();
  EXPECT_EQ(StateOf(s), Residency::kSpilled);
  // Its copy is done: the block is free, not active_pending_free until the next allocation
  // (statistics and snapshots taken after Synchronize counted it as active).
  EXPECT_EQ(AllocStat("active_bytes.all.current"), 0);
  void* ptr = engine_->Acquire(id, compute_);
  EXPECT_EQ(ptr, s->data());
  EXPECT_EQ(ReadOn(compute_, ptr, s->nbytes()), Pattern(4 * kMiB, 7));
  engine_->Synchronize();
  EXPECT_EQ(StateOf(s), Residency::kResident);
  EXPECT_EQ(EngineStat("num_spills"), 1);
  EXPECT_EQ(EngineStat("num_reloads"), 1);
  EXPECT_EQ(EngineStat("bytes_to_host"), int64_t{4 * kMiB});
  EXPECT_EQ(EngineStat("bytes_to_device"), int64_t{4 * kMiB});
  EXPECT_EQ(EngineStat("host_bytes.current"), 0);
  EXPECT_EQ(EngineStat("spilled_bytes.peak"), int64_t{4 * kMiB});
}

TEST_F(OffloadTransitions, DropWhileSpillingReturnsHostBufferAfterTheCopy) {
  Make(Policy(OffloadPolicy::kEager), size_t{256} << 20, std::chrono::microseconds{3000});
  auto s = NewStorage(8 * kMiB, 1);
  const KeeperId id = Save(s);
  s->holders = 0;
  engine_->ForwardEnd();
  engine_->RemoveKeeper(id);
  EXPECT_FALSE(engine_->Describe(s.get()).has_value());
  EXPECT_EQ(EngineStat("num_entries"), 0);
  EXPECT_EQ(EngineStat("spilled_bytes.current"), 0);
  EXPECT_EQ(EngineStat("host_bytes.current"), 0);
  engine_->Synchronize();
  storages_.clear();
  s.reset();
  allocator_->ProcessEvents(0);
  EXPECT_EQ(AllocStat("active_bytes.all.current"), 0);
}

TEST_F(OffloadTransitions, DropWhileSpilledFreesHostCopy) {
  auto s = NewStorage(2 * kMiB, 2);
  const KeeperId id = Save(s);
  EndForwardSavesOnly({s});
  ASSERT_EQ(StateOf(s), Residency::kSpilled);
  EXPECT_EQ(EngineStat("host_bytes.current"), int64_t{2 * kMiB});
  engine_->RemoveKeeper(id);
  EXPECT_EQ(EngineStat("host_bytes.current"), 0);
  EXPECT_EQ(EngineStat("spilled_bytes.current"), 0);
}

// A storage freed by its program while saved views remain (a forced release): the host copy
// goes at once, nothing reloads it (a prefetch included), and its unpack fails naming why.
TEST_F(OffloadTransitions, ReleasedStorageIsNeverBroughtBack) {
  auto released = NewStorage(2 * kMiB, 2);
  auto later = NewStorage(2 * kMiB, 3);  // saved after it: unpacked first, prefetching it
  const KeeperId released_id = Save(released);
  const KeeperId later_id = Save(later);
  released->holders = 0;
  EndForwardSavesOnly({later});
  ASSERT_EQ(StateOf(released), Residency::kSpilled);
  engine_->MarkReleased(released.get(), "freed by the test");
  EXPECT_EQ(StateOf(released), Residency::kFailed);
  EXPECT_EQ(EngineStat("host_bytes.current"), int64_t{2 * kMiB}) << "only the other copy is left";
  EXPECT_EQ(EngineStat("spilled_bytes.current"), int64_t{2 * kMiB});
  const int64_t reloads = EngineStat("num_reloads");
  engine_->Acquire(later_id, compute_);  // prefetches what was saved before it
  engine_->Synchronize();
  EXPECT_EQ(EngineStat("num_reloads"), reloads + 1) << "the released storage was reloaded";
  EXPECT_EQ(released->data(), nullptr);
  try {
    engine_->Acquire(released_id, compute_);
    ADD_FAILURE() << "a released storage was handed out";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("freed by the test"), std::string::npos) << e.what();
  }
  engine_->RemoveKeeper(released_id);
  engine_->RemoveKeeper(later_id);
  EXPECT_EQ(EngineStat("host_bytes.current"), 0);
}

// A storage released by force, given memory again (resized) and saved again: the new save reads
// that memory, and its unpack gets those bytes; the old save's unpack still fails, naming why.
// Joined to the failed entry, the new save failed at unpack too.
TEST_F(OffloadTransitions, ANewSaveOfAReleasedStorageGivenMemoryAgainIsItsOwn) {
  auto s = NewStorage(2 * kMiB, 4);
  const KeeperId old_id = Save(s);
  engine_->MarkReleased(s.get(), "freed by the test");
  s->drop_device_memory();
  s->allocate_device_memory(compute_);
  const std::vector<uint8_t> rewritten = Pattern(2 * kMiB, 5);
  backend_->memcpy_async(0, s->data(), rewritten.data(), rewritten.size(), CopyKind::kHostToDevice,
                         compute_.handle);
  const KeeperId new_id = Save(s);
  EXPECT_EQ(StateOf(s), Residency::kResident);
  EXPECT_EQ(engine_->DescribeKeeper(old_id).value().residency, Residency::kFailed);
  // Both saves keep the storage: the old one, lost, among its keepers too.
  EXPECT_THAT(KeepersOf(s.get()), ElementsAre(Pair(old_id, true), Pair(new_id, false)));
  EXPECT_EQ(engine_->EntryKeys(), std::vector<const void*>{s.get()});
  EXPECT_EQ(EngineStat("num_entries"), 2);
  s->holders = 0;
  engine_->ForwardEnd();  // eager: the new save spills, and comes back intact
  engine_->Synchronize();
  EXPECT_EQ(StateOf(s), Residency::kSpilled);
  EXPECT_EQ(ReadOn(compute_, engine_->Acquire(new_id, compute_), rewritten.size()), rewritten);
  try {
    engine_->Acquire(old_id, compute_);
    ADD_FAILURE() << "the released save was handed out";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("freed by the test"), std::string::npos) << e.what();
  }
  engine_->RemoveKeeper(old_id);
  EXPECT_EQ(EngineStat("num_entries"), 1);
  ASSERT_TRUE(engine_->Describe(s.get()).has_value()) << "the old save's drop took the new entry";
  EXPECT_THAT(KeepersOf(s.get()), ElementsAre(Pair(new_id, false)));
  engine_->RemoveKeeper(new_id);
  EXPECT_EQ(EngineStat("num_entries"), 0);
  EXPECT_FALSE(engine_->Describe(s.get()).has_value());
  // Every save gone, the key is free: another storage at that address (one made after the first
  // was freed) is saved as itself. (Dropping the set-aside entry read its key after freeing it,
  // left its storage's key behind with no entry, and this save read a freed entry.)
  auto other = NewStorage(2 * kMiB, 6);
  const auto bind_other = [&] { return other; };
  const KeeperId other_id =
      engine_->AddKeeper(s.get(), bind_other, FloatView(2 * kMiB), compute_).value();
  EXPECT_EQ(engine_->StorageOf(other_id), other) << "bound to the storage set aside before";
  engine_->RemoveKeeper(other_id);
  EXPECT_EQ(EngineStat("num_entries"), 0);
}

// Released and saved again twice: two failed entries set aside under one key, dropped out of
// order; while any is left, a new save of the key binds the storage they keep (a second binding
// would count the first as a holder), whatever binding the caller offers.
TEST_F(OffloadTransitions, EntriesSetAsideUnderOneKeyKeepItsOneBinding) {
  auto s = NewStorage(2 * kMiB, 7);
  const auto release_and_refill = [&] {
    engine_->MarkReleased(s.get(), "freed by the test");
    s->drop_device_memory();
    s->allocate_device_memory(compute_);
  };
  const KeeperId first = Save(s);
  release_and_refill();
  const KeeperId second = Save(s);  // sets `first`'s entry aside
  release_and_refill();
  const KeeperId third = Save(s);  // sets `second`'s aside too
  EXPECT_EQ(EngineStat("num_entries"), 3);
  EXPECT_EQ(engine_->DescribeKeeper(first).value().residency, Residency::kFailed);
  EXPECT_EQ(engine_->DescribeKeeper(second).value().residency, Residency::kFailed);
  engine_->RemoveKeeper(first);  // the older of the two set aside goes first
  EXPECT_EQ(engine_->DescribeKeeper(second).value().residency, Residency::kFailed);
  engine_->RemoveKeeper(third);  // no current entry now; `second`'s stays aside
  EXPECT_EQ(EngineStat("num_entries"), 1);
  // It alone keeps the storage now: asked who keeps it, the engine says so.
  ASSERT_TRUE(engine_->Describe(s.get()).has_value()) << "a storage kept by a lost save is unseen";
  EXPECT_EQ(engine_->Describe(s.get())->residency, Residency::kFailed);
  EXPECT_THAT(KeepersOf(s.get()), ElementsAre(Pair(second, true)));
  EXPECT_EQ(engine_->EntryKeys(), std::vector<const void*>{s.get()});
  auto stranger = NewStorage(2 * kMiB, 8);
  const auto offer_stranger = [&] { return stranger; };
  const KeeperId fourth =
      engine_->AddKeeper(s.get(), offer_stranger, FloatView(2 * kMiB), compute_).value();
  EXPECT_EQ(engine_->StorageOf(fourth), s) << "a second binding of the storage set aside";
  EXPECT_THAT(KeepersOf(s.get()), ElementsAre(Pair(second, true), Pair(fourth, false)));
  EXPECT_EQ(engine_->Describe(s.get())->residency, Residency::kResident);
  EndForwardSavesOnly({s});
  EXPECT_EQ(StateOf(s), Residency::kSpilled) << "the new save is not spilled as its own";
  engine_->RemoveKeeper(second);
  engine_->RemoveKeeper(fourth);
  EXPECT_EQ(EngineStat("num_entries"), 0);
  EXPECT_EQ(EngineStat("host_bytes.current"), 0);
}

TEST_F(OffloadTransitions, TrimHostMemoryGivesBackChunksNoSpillUses) {
  auto kept = NewStorage(2 * kMiB, 1);
  auto dropped = NewStorage(2 * kMiB, 2);
  Save(kept);
  const KeeperId dropped_id = Save(dropped);
  kept->holders = 0;
  EndForwardSavesOnly({dropped});
  engine_->RemoveKeeper(dropped_id);
  EXPECT_GT(EngineStat("host_reserved_bytes"), 0);
  engine_->TrimHostMemory();
  EXPECT_GT(EngineStat("host_reserved_bytes"), 0) << "the chunk holding a spilled copy went back";
  EXPECT_EQ(EngineStat("host_bytes.current"), int64_t{2 * kMiB});
  EXPECT_EQ(StateOf(kept), Residency::kSpilled);
  kept.reset();
  dropped.reset();
  Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});  // a fresh engine
  auto only = NewStorage(2 * kMiB, 3);
  const KeeperId only_id = Save(only);
  EndForwardSavesOnly({only});
  engine_->RemoveKeeper(only_id);
  EXPECT_GT(EngineStat("host_reserved_bytes"), 0) << "the pool caches its chunk";
  engine_->TrimHostMemory();
  EXPECT_EQ(EngineStat("host_reserved_bytes"), 0);
}

// A reload that finished while nobody looked (its saves outlive backward, as under retain_graph:
// no later call of the entry's) is a resident entry: the out-of-memory rescue may spill it again,
// and trimming the host pool sees its host copy gone. It stayed "reloading" for both.
TEST_F(OffloadTransitions, AReloadThatFinishedUnseenIsResidentToTheRescueAndTheTrim) {
  auto s = NewStorage(8 * kMiB, 4);
  const KeeperId id = Save(s);
  EndForwardSavesOnly({s});
  engine_->Acquire(id, compute_);  // backward reads it; the reload's copy is issued
  backend_->synchronize_stream(0, engine_->h2d_stream_for_testing(0).handle);  // and done
  engine_->TrimHostMemory();
  EXPECT_EQ(EngineStat("host_reserved_bytes"), 0) << "the finished reload kept its host copy";
  EXPECT_GT(engine_->ReleaseMemory(0, 8 * kMiB), 0u);
  engine_->Synchronize();
  EXPECT_EQ(StateOf(s), Residency::kSpilled);
  EXPECT_EQ(ReadOn(compute_, engine_->Acquire(id, compute_), 8 * kMiB), Pattern(8 * kMiB, 4));
}

TEST_F(OffloadTransitions, DropWhileReloadingLeaksNothing) {
  Make(Policy(OffloadPolicy::kEager), size_t{256} << 20, std::chrono::microseconds{3000});
  auto s = NewStorage(4 * kMiB, 3);
  const KeeperId id = Save(s);
  EndForwardSavesOnly({s});
  engine_->Acquire(id, compute_);
  EXPECT_EQ(StateOf(s), Residency::kReloading);
  engine_->RemoveKeeper(id);
  EXPECT_EQ(EngineStat("host_bytes.current"), 0);
  storages_.clear();
  s.reset();  // the storage goes, and its reloaded block with it
  engine_->Synchronize();
  backend_->synchronize_stream(0, compute_.handle);
  allocator_->ProcessEvents(0);
  EXPECT_EQ(AllocStat("allocated_bytes.all.current"), 0);
}

TEST_F(OffloadTransitions, ReloadRequestedWhileSpillingWaitsForTheCopy) {
  Make(Policy(OffloadPolicy::kEager), size_t{256} << 20, std::chrono::microseconds{3000});
  auto s = NewStorage(8 * kMiB, 4);
  const KeeperId id = Save(s);
  s->holders = 0;
  engine_->ForwardEnd();
  ASSERT_EQ(StateOf(s), Residency::kSpilling);  // the D2H copy is still queued
  void* ptr = engine_->Acquire(id, compute_);
  EXPECT_EQ(ReadOn(compute_, ptr, s->nbytes()), Pattern(8 * kMiB, 4));
}

TEST_F(OffloadTransitions, OneEntryAndOneCopyPerStorageHoweverManyViews) {
  auto s = NewStorage(4 * kMiB, 5);
  const KeeperId base = Save(s, 0);
  const KeeperId view = Save(s, 1024);
  const auto info = engine_->Describe(s.get());
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->keepers.size(), 2u);
  EXPECT_EQ(info->keepers[1].view.offset, 1024);
  EXPECT_EQ(EngineStat("num_entries"), 1);
  EndForwardSavesOnly({s});
  EXPECT_EQ(EngineStat("num_spills"), 1);
  EXPECT_EQ(EngineStat("bytes_to_host"), int64_t{4 * kMiB});
  void* a = engine_->Acquire(view, compute_);
  void* b = engine_->Acquire(base, compute_);
  EXPECT_EQ(a, b);
  EXPECT_EQ(EngineStat("num_reloads"), 1);
  engine_->RemoveKeeper(base);
  EXPECT_TRUE(engine_->Describe(s.get()).has_value());  // the view still keeps it
  engine_->RemoveKeeper(view);
  EXPECT_FALSE(engine_->Describe(s.get()).has_value());
}

TEST_F(OffloadTransitions, ExternalHolderPreventsSpill) {
  auto s = NewStorage(4 * kMiB, 6);
  Save(s);
  engine_->ForwardEnd();
  EXPECT_EQ(StateOf(s), Residency::kResident);
  EXPECT_EQ(engine_->Describe(s.get())->external_holders, 1);
  EXPECT_EQ(EngineStat("num_spills"), 0);
  s->holders = 0;  // the forward pass let go: eligible now
  engine_->RunPolicy();
  EXPECT_NE(StateOf(s), Residency::kResident);
}

TEST_F(OffloadTransitions, ForeignAndEmptyStoragesAreSkippedWithAReason) {
  class Foreign : public TestStorage {
   public:
    using TestStorage::TestStorage;
    void* data() const override { return const_cast<int*>(&local_); }

   private:
    int local_ = 0;
  };
  auto foreign = std::make_shared<Foreign>(*allocator_, 4096, compute_);
  EXPECT_FALSE(engine_
                   ->AddKeeper(
                       foreign.get(), [&] { return foreign; }, ViewInfo{}, compute_)
                   .has_value());
  EXPECT_EQ(EngineStat("skipped.not_spillway"), 1);
  auto empty = std::make_shared<TestStorage>(*allocator_, 0, compute_);
  EXPECT_FALSE(engine_
                   ->AddKeeper(
                       empty.get(), [&] { return empty; }, ViewInfo{}, compute_)
                   .has_value());
  EXPECT_EQ(EngineStat("skipped.empty"), 1);
  EXPECT_EQ(EngineStat("num_entries"), 0);
}

TEST_F(OffloadTransitions, UnknownKeeperIsAClearError) {
  EXPECT_THROW(engine_->Acquire(12345, compute_), InvalidArgumentError);
  EXPECT_THROW(engine_->RemoveKeeper(12345), InvalidArgumentError);
}

// A process driving two devices, each with its own saves.
class OffloadTwoDevices : public ::testing::Test {
 protected:
  void Make(const OffloadConfig& config) {
    SimBackend::Options options;
    options.devices = 2;
    options.capacity_bytes = size_t{64} << 20;
    backend_ = std::make_shared<SimBackend>(options);
    allocator_.emplace(backend_, AllocatorConfig{});
    engine_.emplace(*allocator_, config);
  }
  ~OffloadTwoDevices() override {
    for (const KeeperId id : ids_) engine_->RemoveKeeper(id);
  }
  StreamRef On(int device) const { return backend_->default_stream(device); }
  // A 2 MiB storage on `device`, saved there (its program holds it no more).
  std::shared_ptr<AllocatorStorage> Save(int device) {
    auto s = std::make_shared<AllocatorStorage>(*allocator_, 2 * kMiB, On(device), 0, device);
    ids_.push_back(engine_
                       ->AddKeeper(
                           s.get(), [&] { return s; }, FloatView(s->nbytes()), On(device))
                       .value());
    ids_of_[s.get()] = ids_.back();
    return s;
  }
  void Acquire(const std::shared_ptr<AllocatorStorage>& s, int device) {
    engine_->Acquire(ids_of_.at(s.get()), On(device));
  }
  bool Prefetched(const std::shared_ptr<AllocatorStorage>& s) const {
    return engine_->Describe(s.get())->prefetched;
  }
  Residency StateOf(const std::shared_ptr<AllocatorStorage>& s) const {
    return engine_->Describe(s.get())->residency;
  }

  std::shared_ptr<SimBackend> backend_;
  std::optional<CachingAllocator> allocator_;
  std::optional<OffloadEngine> engine_;
  std::vector<KeeperId> ids_;
  std::map<const void*, KeeperId> ids_of_;
};

// Backward on device 1 prefetches device 1's older saves and passes over device 0's (device 1's
// stream is none of theirs: trying it stopped the prefetch).
TEST_F(OffloadTwoDevices, PrefetchStaysOnTheConsumersDevice) {
  Make(Policy(OffloadPolicy::kEager));
  auto older1 = Save(1);
  auto newer0 = Save(0);
  auto newest1 = Save(1);
  engine_->ForwardEnd();
  engine_->Synchronize();
  ASSERT_EQ(StateOf(newer0), Residency::kSpilled);

  Acquire(newest1, 1);
  EXPECT_TRUE(Prefetched(older1));
  EXPECT_EQ(StateOf(newer0), Residency::kSpilled);
  engine_->Synchronize();
  EXPECT_EQ(StateOf(older1), Residency::kResident);
}

// prefetch_bytes holds per device: a prefetch on device 0 that nobody acquired yet leaves device
// 1's backward its own prefetch (one sum over both devices stopped it).
TEST_F(OffloadTwoDevices, PrefetchBytesCountPerDevice) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 2 * kMiB;  // one save ahead
  Make(config);
  auto older0 = Save(0);
  auto newer0 = Save(0);
  auto older1 = Save(1);
  auto newer1 = Save(1);
  engine_->ForwardEnd();
  engine_->Synchronize();
  ASSERT_EQ(StateOf(older1), Residency::kSpilled);

  Acquire(newer0, 0);
  ASSERT_TRUE(Prefetched(older0));
  Acquire(newer1, 1);
  EXPECT_TRUE(Prefetched(older1)) << "device 0's prefetch held device 1's back";
  engine_->Synchronize();
}

// Each device's spilled bytes follow its own entries (a report plots them per device); together
// they are the engine's spilled_bytes.
TEST_F(OffloadTwoDevices, SpilledBytesCountPerDevice) {
  Make(Policy(OffloadPolicy::kEager));
  auto a0 = Save(0);
  auto b0 = Save(0);
  auto a1 = Save(1);
  engine_->ForwardEnd();
  engine_->Synchronize();
  EXPECT_EQ(engine_->spilled_bytes(0), 4 * kMiB);
  EXPECT_EQ(engine_->spilled_bytes(1), 2 * kMiB);
  EXPECT_EQ(engine_->stats().spilled_bytes.current, int64_t{6 * kMiB});
  Acquire(a1, 1);
  engine_->Synchronize();
  EXPECT_EQ(engine_->spilled_bytes(0), 4 * kMiB);
  EXPECT_EQ(engine_->spilled_bytes(1), 0u);
  EXPECT_THROW(engine_->spilled_bytes(2), InvalidArgumentError);
  EXPECT_THROW(engine_->spilled_bytes(-1), InvalidArgumentError);
}

}  // namespace
}  // namespace spillway::testing
