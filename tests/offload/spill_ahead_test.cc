// `auto` spills ahead (ForwardSpillAhead): the next run of a forward that went above the budget
// spills that much of its oldest saves as it makes them, so that their copies run during the
// forward rather than at its peak. Through the engine: the arithmetic is in policy_test.cc.
#include <chrono>

#include "tests/offload/forward_runs_fixture.h"

namespace spillway::testing {
namespace {

class OffloadSpillAhead : public OffloadForwardRuns {
 protected:
  // A budget of 24 MiB: the target auto spills down to is 22.5 MiB.
  void SetUp() override {
    OffloadConfig config = Policy(OffloadPolicy::kAuto);
    config.budget_bytes = 24 * kMiB;
    config.prefetch_bytes = 0;  // backward reloads at its reads: only forward's spills count
    Make(config, 128 * kMiB, std::chrono::microseconds{0});
  }

  // One forward of `count` saves of 4 MiB, oldest first, each let go of by the program once
  // saved. `after_second`: how many saves were off the device right after the second one (long
  // before the budget: 8 MiB allocated). `loss_bytes`: allocated (not saved) after the last
  // save, then freed, as a loss would be.
  struct Run {
    Saves saves;
    int after_second = 0;
  };
  Run Forward(int count, uint32_t seed, size_t loss_bytes = 0) {
    Run run;
    for (int i = 0; i < count; ++i) {
      run.saves.push_back(SaveNew(seed + static_cast<uint32_t>(i)));
      run.saves.back()->holders = 0;
      if (i == 1) run.after_second = Spilled(run.saves);
    }
    if (loss_bytes > 0) allocator_->Free(allocator_->Malloc(loss_bytes, 0, compute_));
    engine_->ForwardEnd();
    return run;
  }
};

TEST_F(OffloadSpillAhead, TheNextRunSpillsAsItSavesWhatTheLastHeldAboveTheBudget) {
  // 40 MiB of saves: the budget spills at the forward's peak, nothing before.
  Run first = Forward(10, 10);
  EXPECT_EQ(first.after_second, 0);
  const int64_t first_spills = EngineStat("num_spills");
  ASSERT_GT(first_spills, 0);
  engine_->Synchronize();
  Backward(first.saves, 10);

  // It held 40 MiB with nothing spilled, 17.5 above the target: the next run spills its four
  // oldest saves (16 MiB) as it makes them, and the budget asks for nothing.
  allocator_->ResetPeakStats(0);
  Run second = Forward(10, 20);
  EXPECT_EQ(second.after_second, 1) << "the oldest save went at the second";
  EXPECT_EQ(Spilled(second.saves), 4);
  EXPECT_EQ(EngineStat("num_spills") - first_spills, 4);
  EXPECT_LE(AllocStat("allocated_bytes.all.peak"), int64_t{24 * kMiB});
  engine_->Synchronize();
  Backward(second.saves, 20);

  // A smaller forward (24 MiB) next still spills what the last one needed ahead; the one after
  // it learns from it (1.5 MiB above the target: not a save's worth) and spills nothing.
  Run third = Forward(6, 30);
  EXPECT_EQ(Spilled(third.saves), 4);
  engine_->Synchronize();
  Backward(third.saves, 30);
  Run fourth = Forward(6, 40);
  EXPECT_EQ(Spilled(fourth.saves), 0);
  Backward(fourth.saves, 40);
  DropAllAndExpectNoLeaks({});
}

TEST_F(OffloadSpillAhead, WhatALossAllocatedAboveTheSavesIsSpilledAheadFromThenOn) {
  // 20 MiB of saves and an 8 MiB loss: 28 MiB, 5.5 above the target, reached at the loss.
  Run first = Forward(5, 50, 8 * kMiB);
  EXPECT_EQ(first.after_second, 0);
  engine_->Synchronize();
  Backward(first.saves, 50);
  // The next run spills one save ahead, and its loss fits; so does the one after, which reached
  // the budget no more (its saves alone are under the target) but keeps what the loss needs.
  for (uint32_t seed : {60u, 70u}) {
    const int64_t spills = EngineStat("num_spills");
    Run run = Forward(5, seed, 8 * kMiB);
    EXPECT_EQ(run.after_second, 1) << seed;
    EXPECT_EQ(EngineStat("num_spills") - spills, 1) << seed;
    engine_->Synchronize();
    Backward(run.saves, seed);
  }
  DropAllAndExpectNoLeaks({});
}

TEST_F(OffloadSpillAhead, WhatIsHeldBeforeAForwardCounts) {
  // 24 MiB of saves, at the budget: nothing spilled, and 20 MiB more held at its last save than
  // at its first.
  Run first = Forward(6, 100);
  ASSERT_EQ(Spilled(first.saves), 0);
  Backward(first.saves, 100);
  // 8 MiB held from before the next run (an accumulated gradient): it reaches 32 MiB, 9.5 above
  // the target, and spills its two oldest saves ahead.
  void* held = allocator_->Malloc(8 * kMiB, 0, compute_);
  const int64_t spills = EngineStat("num_spills");
  Run second = Forward(6, 110);
  EXPECT_EQ(second.after_second, 1);
  EXPECT_EQ(EngineStat("num_spills") - spills, 2);
  engine_->Synchronize();
  Backward(second.saves, 110);
  allocator_->Free(held);
  DropAllAndExpectNoLeaks({});
}

TEST_F(OffloadSpillAhead, AReloadReachingTheBudgetCountsItsBytesOnce) {
  // 32 MiB of saves: the budget spills the oldest at the forward's peak.
  Run first = Forward(8, 120);
  engine_->Synchronize();
  int spilled = Spilled(first.saves);
  ASSERT_GT(spilled, 0);
  // Backward reads the resident saves, then holds 26 MiB of gradients: each reload of a spilled
  // save reaches the budget. With nothing spilled the device would hold the gradients and the
  // saves not yet read, the one reloading among them once (it is spilled until its copy is
  // issued, and it is the allocation coming): counted twice, the next run would spill a save
  // more ahead.
  Backward(first.saves, 120, static_cast<size_t>(spilled));
  void* gradients = allocator_->Malloc(26 * kMiB, 0, compute_);
  Backward(first.saves, 120);
  allocator_->Free(gradients);
  // It rose 28 MiB above its first save's 4, and its reloads went above its highest save (32)
  // by 26 + 4 x spilled - 32: the next run, from 4 again, spills ahead what that reaches above
  // the target (22.5 MiB), a 4 MiB save at a time.
  const size_t reached = 26 + 4 * static_cast<size_t>(spilled);
  const size_t high = (4 + 28 + (reached > 32 ? reached - 32 : 0)) * kMiB;
  const size_t target = 24 * kMiB - 24 * kMiB / 16;
  const int expected = high > target ? static_cast<int>((high - target) / (4 * kMiB)) : 0;
  Run second = Forward(8, 130);
  EXPECT_EQ(Spilled(second.saves), expected) << spilled;
  engine_->Synchronize();
  Backward(second.saves, 130);
  DropAllAndExpectNoLeaks({});
}

TEST_F(OffloadSpillAhead, AnotherPolicyForgetsIt) {
  Run first = Forward(10, 80);
  engine_->Synchronize();
  Backward(first.saves, 80);
  AnotherPolicyInBetween(OffloadPolicy::kEager);
  Run second = Forward(10, 90);
  EXPECT_EQ(second.after_second, 0);
  engine_->Synchronize();
  Backward(second.saves, 90);
  DropAllAndExpectNoLeaks({});
}

}  // namespace
}  // namespace spillway::testing
