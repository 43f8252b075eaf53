// Eager's bound on a forward (ForwardSpillQuota): the saves backward took back, their copies to
// the host still running when it wanted them, freed no memory; after two runs of a forward that
// had saves taken back, the next spills only what they got across, oldest first, and keeps its
// newest saves beyond it.
// Through the engine: the bound's own arithmetic is in policy_test.cc.
#include <chrono>
#include <memory>
#include <vector>

#include "tests/offload/forward_runs_fixture.h"

namespace spillway::testing {
namespace {

class OffloadLinkQuota : public OffloadForwardRuns {
 protected:
  void SetUp() override {
    // No prefetch: a read's prefetch would take back the older saves too (while the copies to
    // the host are held), and each test says which saves backward takes back.
    OffloadConfig config = Policy(OffloadPolicy::kEager);
    config.prefetch_bytes = 0;
    Make(config, 128 * kMiB, std::chrono::microseconds{0});
  }

  // One forward: `count` saves of 4 MiB, none held by the program after its last save, then
  // forward's end (eager spills what it may). Oldest first. `hold_copies_out`: the copies to the
  // host do not run until the hold goes (backward starts before they are done).
  Saves Forward(int count, uint32_t seed,
                std::unique_ptr<SimBackend::StreamHold>* hold_copies_out = nullptr) {
    Saves saves;
    for (int i = 0; i < count; ++i) saves.push_back(SaveNew(seed + static_cast<uint32_t>(i)));
    for (const auto& s : saves) s->holders = 0;
    if (hold_copies_out != nullptr) {
      *hold_copies_out = backend_->hold_stream(0, engine_->d2h_stream_for_testing(0).handle);
    }
    engine_->ForwardEnd();
    return saves;
  }

  // Two runs of a forward of `count` saves whose backward takes every one back (their copies to
  // the host held until it is over): the next run of it spills nothing.
  void ForwardAllTakenBackTwice(int count, uint32_t seed) {
    for (uint32_t run = 0; run < 2; ++run) {
      const int64_t before = EngineStat("bytes_taken_back");
      std::unique_ptr<SimBackend::StreamHold> hold;
      Saves saves = Forward(count, seed + 100 * run, &hold);
      Backward(saves, seed + 100 * run);
      hold.reset();
      engine_->Synchronize();
      ASSERT_EQ(EngineStat("bytes_taken_back") - before, int64_t{count} * int64_t{4 * kMiB});
    }
  }
};

TEST_F(OffloadLinkQuota, TheNextForwardKeepsWhatBackwardTookBackInTwoRunsRunning) {
  // A forward spills its four saves; backward starts while their copies are still queued, and
  // takes the two newest back (8 MiB that the link did not carry in time).
  const auto run_taking_back_two = [&](uint32_t seed) {
    const int64_t before = EngineStat("bytes_taken_back");
    std::unique_ptr<SimBackend::StreamHold> hold;
    Saves saves = Forward(4, seed, &hold);
    const int spilled = Spilled(saves);
    Backward(saves, seed, 2);
    hold.reset();
    engine_->Synchronize();
    Backward(saves, seed);  // copied across before they were read: reloaded
    EXPECT_EQ(EngineStat("bytes_taken_back") - before, int64_t{8 * kMiB}) << seed;
    return spilled;
  };
  ASSERT_EQ(run_taking_back_two(10), 4);
  // Once is no bound (a first step's copies wait for the pinned memory it makes): the next run
  // spills every save too.
  ASSERT_EQ(run_taking_back_two(50), 4);
  ASSERT_EQ(EngineStat("skipped.link"), 0);

  // Taken back in two runs running: its two oldest saves go (8 MiB, what those runs got
  // across), the two newest stay for backward.
  Saves second = Forward(4, 20);
  EXPECT_NE(StateOf(second[0]), Residency::kResident);
  EXPECT_NE(StateOf(second[1]), Residency::kResident);
  EXPECT_EQ(StateOf(second[2]), Residency::kResident) << "spilled past the link's bound";
  EXPECT_EQ(StateOf(second[3]), Residency::kResident) << "spilled past the link's bound";
  EXPECT_EQ(EngineStat("skipped.link"), 2);
  engine_->Synchronize();
  Backward(second, 20);
  EXPECT_EQ(EngineStat("bytes_taken_back"), int64_t{16 * kMiB}) << "nothing more taken back";

  // Nothing taken back, saves kept: the bound grows by a save (4 MiB, more than an eighth).
  Saves third = Forward(4, 30);
  EXPECT_EQ(Spilled(third), 3);
  EXPECT_EQ(StateOf(third[3]), Residency::kResident);
  engine_->Synchronize();
  Backward(third, 30);

  // Another forward (three saves) is not the one the bound was learned on: at its end it spills
  // what the bound deferred.
  Saves other = Forward(3, 40);
  EXPECT_EQ(Spilled(other), 3);
  engine_->Synchronize();
  Backward(other, 40);
  DropAllAndExpectNoLeaks({});
}

TEST_F(OffloadLinkQuota, TheOutOfMemoryRescueSpillsWhatTheBoundKept) {
  ForwardAllTakenBackTwice(2, 50);  // the next run of the forward keeps both saves
  Saves second = Forward(2, 60);
  ASSERT_EQ(Spilled(second), 0);
  ASSERT_EQ(EngineStat("skipped.link"), 2);
  EXPECT_GE(engine_->ReleaseMemory(0, 8 * kMiB), size_t{8 * kMiB});
  EXPECT_EQ(Spilled(second), 2);
  Backward(second, 60);
  DropAllAndExpectNoLeaks({});
}

// Under the environment hook nothing ends a forward, so the saves the bound deferred wait, on the
// device, for backward. A save backward makes (a reentrant checkpoint's recomputation) begins no
// forward: as a forward's save after a read, it made the deferred ones another forward's, and
// eager spilled them just before backward read them.
TEST_F(OffloadLinkQuota, ASaveMadeInBackwardBeginsNoForward) {
  ForwardAllTakenBackTwice(2, 50);  // the next run of the forward keeps both saves
  Saves second;
  for (uint32_t i = 0; i < 2; ++i) second.push_back(SaveNew(60 + i));
  for (const auto& s : second) s->holders = 0;
  engine_->RunPolicy();  // no ForwardEnd: no offload() block under the environment hook
  ASSERT_EQ(Spilled(second), 0);
  const KeeperId newest = ids_.at(second[1].get());
  EXPECT_EQ(AcquireAndRead(newest, 4 * kMiB), Pattern(4 * kMiB, 61));
  auto recomputed = NewStorage(4 * kMiB, 70);
  const KeeperId recomputed_id = Save(recomputed, 0, std::nullopt, SavePhase::kBackward);
  engine_->Synchronize();
  EXPECT_EQ(StateOf(second[0]), Residency::kResident) << "a backward's save began a forward";
  engine_->RemoveKeeper(recomputed_id);
  recomputed.reset();
  Backward(second, 60);
  DropAllAndExpectNoLeaks({});
}

TEST_F(OffloadLinkQuota, AnotherPolicyForgetsTheBound) {
  ForwardAllTakenBackTwice(2, 70);
  AnotherPolicyInBetween(OffloadPolicy::kOff);
  Saves second = Forward(2, 80);
  EXPECT_EQ(Spilled(second), 2);
  EXPECT_EQ(EngineStat("skipped.link"), 0);
  engine_->Synchronize();
  Backward(second, 80);
  DropAllAndExpectNoLeaks({});
}

}  // namespace
}  // namespace spillway::testing
