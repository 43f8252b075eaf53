// The engine's lock is a plain mutex that no call it makes takes again: a reload's or a
// prefetch's device memory is allocated with it released. What that must keep: other threads go
// on meanwhile, one storage is reloaded once however many reads race for it, an entry whose last
// keeper goes during its allocation outlives that allocation, then goes, and a storage the
// program releases by force during its reload's allocation is not brought back.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/offload/engine_fixture.h"

namespace spillway::testing {
namespace {

// A storage whose next allocation first runs `before_allocating` (once) on the allocating thread.
class HookedStorage : public AllocatorStorage {
 public:
  using AllocatorStorage::AllocatorStorage;
  void* allocate_device_memory(StreamRef stream) override {
    if (std::function<void()> hook = std::exchange(before_allocating, {})) hook();
    return AllocatorStorage::allocate_device_memory(stream);
  }
  std::function<void()> before_allocating;
};

// Holds an allocation until opened, and says when it got there.
class Gate {
 public:
  std::function<void()> Hook() {
    return [this] {
      entered_.set_value();
      open_future_.wait();
    };
  }
  bool AwaitEntered() { return entered_future_.wait_for(std::chrono::seconds(30)) == ready; }
  void Open() { open_.set_value(); }

 private:
  static constexpr std::future_status ready = std::future_status::ready;
  std::promise<void> entered_;
  std::shared_future<void> entered_future_ = entered_.get_future().share();
  std::promise<void> open_;
  std::shared_future<void> open_future_ = open_.get_future().share();
};

class OffloadEngineLocking : public OffloadEngineTest {
 protected:
  void SetUp() override {
    Make(Policy(OffloadPolicy::kEager), size_t{256} << 20, std::chrono::microseconds{0});
  }

  // A storage of `nbytes` filled from `seed`, saved, then spilled (the program let go of it).
  std::shared_ptr<HookedStorage> Spilled(size_t nbytes, uint32_t seed, KeeperId* id) {
    auto s = std::make_shared<HookedStorage>(*allocator_, nbytes, compute_);
    const std::vector<uint8_t> bytes = Pattern(nbytes, seed);
    backend_->memcpy_async(0, s->data(), bytes.data(), nbytes, CopyKind::kHostToDevice,
                           compute_.handle);
    backend_->synchronize_stream(0, compute_.handle);
    const std::optional<KeeperId> saved = engine_->AddKeeper(
        s.get(), [s] { return s; }, FloatView(nbytes), compute_);
    *id = saved.value();
    EndForwardSavesOnly({s});
    EXPECT_EQ(engine_->Describe(s.get())->residency, Residency::kSpilled);
    return s;
  }
};

TEST_F(OffloadEngineLocking, AReloadAllocatesWithTheEngineFreeForOtherThreads) {
  KeeperId id = 0;
  auto s = Spilled(2 * kMiB, 1, &id);
  // While the reload allocates, another thread asks the engine something. Under the engine's
  // lock it would wait until Acquire returned: the allocation gives it kPollLimit, then goes on.
  std::atomic<bool> answered{false};
  std::thread asker;
  bool answered_during_allocation = false;
  s->before_allocating = [&] {
    asker = std::thread([&] {
      engine_->stats();
      answered = true;
    });
    answered_during_allocation = PollUntil([&] { return answered.load(); });
  };
  const std::vector<uint8_t> read = AcquireAndRead(id, 2 * kMiB);
  asker.join();
  EXPECT_TRUE(answered_during_allocation) << "the engine's lock was held over the allocation";
  EXPECT_EQ(read, Pattern(2 * kMiB, 1));
}

TEST_F(OffloadEngineLocking, TwoReadsOfOneStorageRacingReloadItOnce) {
  KeeperId first = 0;
  auto s = Spilled(4 * kMiB, 2, &first);
  // A second view of the same storage (another save of it), read on another thread while the
  // first read's reload allocates: it waits for that reload rather than make one of its own.
  const std::optional<KeeperId> second = engine_->AddKeeper(
      s.get(), [s] { return s; }, FloatView(4 * kMiB), compute_);
  ASSERT_TRUE(second.has_value());
  Gate gate;
  s->before_allocating = gate.Hook();
  void* first_ptr = nullptr;
  std::thread reader([&] { first_ptr = engine_->Acquire(first, compute_); });
  ASSERT_TRUE(gate.AwaitEntered());
  void* second_ptr = nullptr;
  std::thread racer([&] { second_ptr = engine_->Acquire(*second, compute_); });
  // (No wait for the racer to reach its own wait: reached later, it finds the storage back.)
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  gate.Open();
  reader.join();
  racer.join();
  ASSERT_NE(first_ptr, nullptr);
  EXPECT_EQ(first_ptr, second_ptr);
  EXPECT_EQ(engine_->Describe(s.get())->reload_count, 1);
  EXPECT_EQ(ReadOn(compute_, first_ptr, 4 * kMiB), Pattern(4 * kMiB, 2));
  EXPECT_EQ(EngineStat("num_reloads"), 1);
}

TEST_F(OffloadEngineLocking, AnEntryWhoseLastKeeperGoesWhileItsPrefetchAllocatesGoesAfter) {
  KeeperId older = 0;
  auto a = Spilled(2 * kMiB, 3, &older);
  KeeperId newer = 0;
  auto b = Spilled(2 * kMiB, 4, &newer);
  // Reading b prefetches a (the save before it); a's last keeper goes while that allocates.
  Gate gate;
  a->before_allocating = gate.Hook();
  std::thread reader([&] { engine_->Acquire(newer, compute_); });
  ASSERT_TRUE(gate.AwaitEntered());
  std::atomic<bool> removed{false};
  std::thread remover([&] {
    engine_->RemoveKeeper(older);
    removed = true;
  });
  // Under the engine's lock the removal would wait for the read, which waits for the gate.
  const bool removed_during_allocation = PollUntil([&] { return removed.load(); });
  gate.Open();
  reader.join();
  remover.join();
  EXPECT_TRUE(removed_during_allocation) << "RemoveKeeper waited for another thread's allocation";
  EXPECT_FALSE(engine_->Describe(a.get()).has_value());
  EXPECT_EQ(a->data(), nullptr) << "the prefetch's memory outlived its entry";
  EXPECT_EQ(EngineStat("num_entries"), 1);
  engine_->Synchronize();
  // Only b's block is allocated, and a's host copy went with its entry.
  EXPECT_EQ(AllocStat("allocated_bytes.all.current"), static_cast<int64_t>(2 * kMiB));
  EXPECT_EQ(EngineStat("host_bytes.current"), 0);
}

// spillway.release(force=True) on one thread (MarkReleased) while another thread's read of the
// same storage allocates its reload: the read fails naming the release, the memory it allocated
// goes back, and the host copy went with the release; the engine goes on.
TEST_F(OffloadEngineLocking, AStorageReleasedByForceDuringItsReloadsAllocationIsNotBroughtBack) {
  KeeperId id = 0;
  auto s = Spilled(2 * kMiB, 5, &id);
  const int64_t allocated_before = AllocStat("allocated_bytes.all.current");
  ASSERT_GT(EngineStat("host_bytes.current"), 0);
  Gate gate;
  s->before_allocating = gate.Hook();
  std::string failure;
  std::thread reader([&] {
    try {
      engine_->Acquire(id, compute_);
    } catch (const Error& e) {
      failure = e.what();
    }
  });
  ASSERT_TRUE(gate.AwaitEntered());
  std::atomic<bool> released{false};
  std::thread releaser([&] {
    engine_->MarkReleased(s.get(), "released by force while its reload allocated");
    released = true;
  });
  const bool released_during_allocation = PollUntil([&] { return released.load(); });
  gate.Open();
  reader.join();
  releaser.join();
  EXPECT_TRUE(released_during_allocation) << "MarkReleased waited for another thread's allocation";
  EXPECT_NE(failure.find("released by force while its reload allocated"), std::string::npos)
      << "the read did not fail naming the release: \"" << failure << "\"";
  EXPECT_EQ(s->data(), nullptr) << "the reload's memory stayed with a released storage";
  EXPECT_EQ(AllocStat("allocated_bytes.all.current"), allocated_before);
  engine_->Synchronize();
  EXPECT_EQ(EngineStat("host_bytes.current"), 0) << "the host copy outlived the release";
  EXPECT_EQ(engine_->Describe(s.get())->residency, Residency::kFailed);
  // The engine goes on: another storage spills and comes back whole.
  KeeperId other = 0;
  auto t = Spilled(2 * kMiB, 6, &other);
  EXPECT_EQ(AcquireAndRead(other, 2 * kMiB), Pattern(2 * kMiB, 6));
}

}  // namespace
}  // namespace spillway::testing
