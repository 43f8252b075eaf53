// The offload engine's parts on their own: the policies' plans (pure functions of the
// configuration and the measured numbers) and the entry table's bookkeeping (keepers, set-aside
// entries, the window and the indices by save order), with no device, copy or lock.
#include "offload/policy.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "allocator/config.h"
#include "allocator/errors.h"
#include "offload/entry_table.h"

namespace spillway {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(SpillPlanTest, BudgetThatFitsAsksForNothing) {
  EXPECT_FALSE(PlanBudget(60 * kMiB, 4 * kMiB, 64 * kMiB).has_value());
  EXPECT_FALSE(PlanBudget(64 * kMiB, 0, 64 * kMiB).has_value());
}

TEST(SpillPlanTest, BudgetPassedGivesBackThenSpillsBelowTheBudgetLessASixteenthAndTheIncoming) {
  const std::optional<SpillPlan> plan = PlanBudget(64 * kMiB, 8 * kMiB, 64 * kMiB);
  ASSERT_TRUE(plan.has_value());
  const size_t goal = 64 * kMiB - 4 * kMiB - 8 * kMiB;
  ASSERT_TRUE(plan->give_back_to.has_value());
  EXPECT_EQ(*plan->give_back_to, goal);
  EXPECT_EQ(plan->spills, SpillPlan::Spills::kToTarget);
  EXPECT_EQ(plan->spill_to, goal);
  EXPECT_FALSE(plan->include_window);  // a policy keeps the window
  EXPECT_TRUE(plan->room_for_backward);
}

TEST(SpillPlanTest, IncomingLargerThanTheBudgetSpillsEverythingItMay) {
  const std::optional<SpillPlan> plan = PlanBudget(10 * kMiB, 100 * kMiB, 64 * kMiB);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->spill_to, 0U);
}

TEST(SpillPlanTest, EagerSpillsEveryEligibleSaveAndGivesNothingBack) {
  const SpillPlan plan = PlanEager(/*forward_end=*/false);
  EXPECT_FALSE(plan.give_back_to.has_value());
  EXPECT_EQ(plan.spills, SpillPlan::Spills::kAllEligible);
  EXPECT_FALSE(plan.include_window);
}

TEST(SpillPlanTest, RescueTakesAnySaveButUnderOffOnlyGivesPrefetchesBack) {
  const SpillPlan rescue = PlanRescue(OffloadPolicy::kEager, 50 * kMiB, 20 * kMiB);
  EXPECT_EQ(rescue.give_back_to, 30 * kMiB);
  EXPECT_EQ(rescue.spills, SpillPlan::Spills::kToTarget);
  EXPECT_EQ(rescue.spill_to, 30 * kMiB);
  EXPECT_TRUE(rescue.include_window);
  EXPECT_FALSE(rescue.room_for_backward);
  const SpillPlan off = PlanRescue(OffloadPolicy::kOff, 50 * kMiB, 80 * kMiB);
  EXPECT_EQ(off.give_back_to, 0U);
  EXPECT_EQ(off.spills, SpillPlan::Spills::kNone);
}

TEST(BudgetBytesTest, ExplicitBytesElseAFractionOfTheSmallerOfLimitAndDevice) {
  OffloadConfig config;
  config.budget_bytes = 7 * kMiB;
  EXPECT_EQ(BudgetBytes(config, 100 * kMiB, 0), 7 * kMiB);
  config.budget_bytes = 0;
  config.budget_fraction = 0.5;
  EXPECT_EQ(BudgetBytes(config, 100 * kMiB, 0), 50 * kMiB);
  EXPECT_EQ(BudgetBytes(config, 100 * kMiB, 40 * kMiB), 20 * kMiB);
  EXPECT_EQ(BudgetBytes(config, 100 * kMiB, 400 * kMiB), 50 * kMiB);  // a limit past the device
}

TEST(ForwardFootprintTest, ASaveAfterAReadStartsAnotherForward) {
  ForwardFootprint f;
  f.OnSave(100 * kMiB);
  f.OnSpilledBytes(80 * kMiB);
  EXPECT_FALSE(f.OnSave(90 * kMiB));  // the high stays
  f.room_taken = 5 * kMiB;
  EXPECT_EQ(f.saving_high, 100 * kMiB);
  EXPECT_EQ(f.spilled_high, 80 * kMiB);
  f.OnRead();
  f.OnSpilledBytes(10 * kMiB);  // backward's numbers do not lower the forward's
  EXPECT_EQ(f.spilled_high, 80 * kMiB);
  EXPECT_TRUE(f.OnSave(30 * kMiB));  // a new forward: a smaller one is its own
  EXPECT_EQ(f.saving_high, 30 * kMiB);
  EXPECT_EQ(f.spilled_high, 0U);
  EXPECT_EQ(f.room_taken, 0U);
  EXPECT_FALSE(f.read_since_save);
}

// One whole run of a forward for `q`: `saves` saves, `spilled` bytes of them spilled, `deferred`
// the first one deferred (0: none) and `taken_back` bytes taken back by its backward; then the
// next forward begins.
void RunForward(ForwardSpillQuota& q, int saves, size_t spilled, size_t taken_back = 0,
                size_t deferred = 0) {
  for (int i = 0; i < saves; ++i) q.OnSave();
  q.OnSpill(spilled);
  if (deferred > 0) q.OnDeferred(deferred);
  q.OnTakenBack(taken_back);
  q.OnForwardStart();
}

TEST(ForwardSpillQuotaTest, NoBoundUntilSomethingIsTakenBack) {
  ForwardSpillQuota q;
  RunForward(q, 1, 500 * kMiB);
  EXPECT_FALSE(q.limit().has_value());
  EXPECT_TRUE(q.Admits(size_t{1} << 40));
  EXPECT_FALSE(q.KeepsDeferred());
}

TEST(ForwardSpillQuotaTest, OneRunTakenBackAloneSetsNoBound) {
  ForwardSpillQuota q;
  // A first step's take-backs, then none: never bound.
  RunForward(q, 3, 100 * kMiB, 30 * kMiB);
  EXPECT_FALSE(q.limit().has_value());
  RunForward(q, 3, 100 * kMiB);
  EXPECT_FALSE(q.limit().has_value());
  // Taken back again, then once more: bound from then on.
  RunForward(q, 3, 100 * kMiB, 10 * kMiB);
  EXPECT_FALSE(q.limit().has_value()) << "the run before took nothing back";
  // Another forward (two saves) between two runs taken back is no run of the same forward.
  RunForward(q, 2, 100 * kMiB, 10 * kMiB);
  EXPECT_FALSE(q.limit().has_value());
}

TEST(ForwardSpillQuotaTest, WhatTheLastRunsGotAcrossThenGrowing) {
  ForwardSpillQuota q;
  // Taken back in two runs running: the more of what they got across (the smaller bound held
  // more than needed in the run that got more across).
  RunForward(q, 3, 100 * kMiB, 40 * kMiB);
  ASSERT_FALSE(q.limit().has_value());
  RunForward(q, 3, 100 * kMiB, 30 * kMiB);
  ASSERT_EQ(q.limit(), 70 * kMiB);
  EXPECT_TRUE(q.Admits(70 * kMiB));
  q.OnSpill(64 * kMiB);
  EXPECT_FALSE(q.Admits(8 * kMiB));
  EXPECT_TRUE(q.Admits(6 * kMiB));
  q.OnDeferred(8 * kMiB);
  EXPECT_FALSE(q.Admits(1)) << "a save after a deferred one is deferred too";
  q.OnDeferred(2 * kMiB);  // the first deferred save counts
  q.OnSave();
  q.OnSave();
  EXPECT_FALSE(q.KeepsDeferred()) << "two saves: not the forward it was learned on (yet)";
  q.OnSave();
  EXPECT_TRUE(q.KeepsDeferred());
  // Deferred saves and nothing taken back: an eighth more (8.75 MiB), at least the first one.
  q.OnForwardStart();
  EXPECT_EQ(q.limit(), 70 * kMiB + 70 * kMiB / 8);
  RunForward(q, 3, 0, 0, 16 * kMiB);
  EXPECT_EQ(q.limit(), 70 * kMiB + 70 * kMiB / 8 + 16 * kMiB);
  // Nothing deferred, nothing taken back: the bound stays.
  RunForward(q, 3, 10 * kMiB);
  EXPECT_EQ(q.limit(), 70 * kMiB + 70 * kMiB / 8 + 16 * kMiB);
  // All taken back (bound: once is enough): nothing spilled before deferring, then a save at a
  // time.
  RunForward(q, 3, 4 * kMiB, 4 * kMiB);
  EXPECT_EQ(q.limit(), 0U);
  EXPECT_FALSE(q.Admits(1));
  RunForward(q, 3, 0, 0, 3 * kMiB);
  EXPECT_EQ(q.limit(), 3 * kMiB);
}

TEST(ForwardSpillQuotaTest, AnotherForwardHasItsOwnBoundAndResetForgets) {
  ForwardSpillQuota q;
  RunForward(q, 4, 40 * kMiB, 20 * kMiB);
  RunForward(q, 4, 40 * kMiB, 20 * kMiB);
  ASSERT_EQ(q.limit(), 20 * kMiB);
  // Two saves: another forward, which spilled what it deferred at its end.
  q.OnSave();
  q.OnSave();
  EXPECT_FALSE(q.KeepsDeferred());
  // With nothing taken back it has no bound; with some in two runs, its own.
  q.OnSpill(20 * kMiB);
  q.OnForwardStart();
  EXPECT_FALSE(q.limit().has_value());
  RunForward(q, 1, 20 * kMiB, 5 * kMiB);
  RunForward(q, 1, 20 * kMiB, 8 * kMiB);
  ASSERT_EQ(q.limit(), 15 * kMiB);
  q.Reset();
  EXPECT_FALSE(q.limit().has_value());
  EXPECT_FALSE(q.KeepsDeferred());
}

TEST(ForwardSpillAheadTest, NothingAheadUntilAForwardEndedAboveTheTarget) {
  ForwardSpillAhead a;
  EXPECT_FALSE(a.Admits(1)) << "the first forward spills nothing ahead";
  EXPECT_TRUE(a.Done());
  a.OnSave(10 * kMiB, 0);
  a.OnSave(80 * kMiB, 0);
  a.OnForwardStart(100 * kMiB, 10 * kMiB, 0);
  EXPECT_EQ(a.ahead(), 0u) << "below the target";
  EXPECT_TRUE(a.Done());
}

TEST(ForwardSpillAheadTest, WhatTheLastForwardAddedAboveTheTargetWithNothingSpilled) {
  ForwardSpillAhead a;
  // From 20 MiB at its first save, it rose to 110 with nothing spilled (60 allocated, 50
  // spilled): 90 MiB. Begun at 20 again, the next run reaches 110, 30 above a target of 80.
  a.OnSave(20 * kMiB, 0);
  a.OnSave(60 * kMiB, 50 * kMiB);
  a.OnSave(70 * kMiB, 10 * kMiB);
  a.OnForwardStart(80 * kMiB, 20 * kMiB, 0);
  ASSERT_EQ(a.ahead(), 30 * kMiB);
  a.OnSave(20 * kMiB, 0);
  EXPECT_TRUE(a.Admits(30 * kMiB));
  a.OnSpill(24 * kMiB);
  EXPECT_FALSE(a.Admits(8 * kMiB));
  EXPECT_TRUE(a.Admits(6 * kMiB));
  EXPECT_FALSE(a.Done());
  a.OnStopped();
  EXPECT_FALSE(a.Admits(1)) << "oldest first: after one that did not fit, none";
  EXPECT_TRUE(a.Done());
  // It rose by 70 only (a smaller forward); the next begins with 15 MiB more held (gradients
  // kept for accumulation): 105, 25 above the target.
  a.OnSave(30 * kMiB, 60 * kMiB);
  a.OnForwardStart(80 * kMiB, 35 * kMiB, 0);
  EXPECT_EQ(a.ahead(), 25 * kMiB);
  a.OnSpill(25 * kMiB);
  EXPECT_TRUE(a.Done());
}

TEST(ForwardSpillAheadTest, AllocationsPastTheBudgetAboveTheSavesAreKept) {
  ForwardSpillAhead a;
  a.OnSave(0, 0);
  a.OnSave(100 * kMiB, 0);
  // The loss's allocations went 20 MiB above the highest save.
  a.OnBudgetReached(110 * kMiB, 10 * kMiB);
  a.OnForwardStart(80 * kMiB, 0, 0);
  ASSERT_EQ(a.ahead(), 40 * kMiB);
  // Spilled ahead, the next forward reaches the budget no more: the excess stays.
  a.OnSave(0, 0);
  a.OnSave(70 * kMiB, 30 * kMiB);
  a.OnForwardStart(80 * kMiB, 0, 0);
  EXPECT_EQ(a.ahead(), 40 * kMiB);
  // It reached it at a save: no excess any more.
  a.OnSave(0, 0);
  a.OnSave(70 * kMiB, 30 * kMiB);
  a.OnBudgetReached(85 * kMiB, 10 * kMiB);
  a.OnForwardStart(80 * kMiB, 0, 0);
  EXPECT_EQ(a.ahead(), 20 * kMiB);
  a.Reset();
  a.OnSave(0, 0);
  a.OnSave(70 * kMiB, 0);
  a.OnForwardStart(60 * kMiB, 0, 0);
  EXPECT_EQ(a.ahead(), 10 * kMiB) << "what it learned before the reset is gone";
}

ForwardFootprint Footprint(size_t saving_high, size_t spilled_high, size_t room_taken = 0) {
  ForwardFootprint f;
  f.saving_high = saving_high;
  f.spilled_high = spilled_high;
  f.room_taken = room_taken;
  return f;
}

TEST(PrefetchPlanTest, AdaptiveTakesTheNextSaveAlwaysThenAnEighthOfWhatForwardSpilled) {
  const PrefetchPlan plan(std::nullopt, 1000 * kMiB, Footprint(160 * kMiB, 64 * kMiB));
  EXPECT_TRUE(PrefetchPlan::Continues(std::nullopt, 500 * kMiB));  // no fixed window
  EXPECT_TRUE(plan.Admits(0, 150 * kMiB, 32 * kMiB));         // the next save, past the depth too
  EXPECT_TRUE(plan.Admits(4 * kMiB, 100 * kMiB, 4 * kMiB));   // 8 of 8 MiB deep
  EXPECT_FALSE(plan.Admits(4 * kMiB, 100 * kMiB, 5 * kMiB));  // 9 MiB: past an eighth
}

TEST(PrefetchPlanTest, AdaptiveStaysWithinForwardsFootprintLessASixteenthAndTheRoomTaken) {
  // Ceiling: 160 - 10 (a sixteenth) - 6 (given back to backward) = 144 MiB.
  const PrefetchPlan plan(std::nullopt, 1000 * kMiB, Footprint(160 * kMiB, 800 * kMiB, 6 * kMiB));
  EXPECT_TRUE(plan.Admits(1, 140 * kMiB, 4 * kMiB));
  EXPECT_FALSE(plan.Admits(1, 140 * kMiB, 4 * kMiB + 1));
}

TEST(PrefetchPlanTest, NeverPastTheBudgetNotEvenTheNextSave) {
  const PrefetchPlan adaptive(std::nullopt, 64 * kMiB, Footprint(160 * kMiB, 800 * kMiB));
  EXPECT_FALSE(adaptive.Admits(0, 60 * kMiB, 8 * kMiB));
  const PrefetchPlan fixed(size_t{256} * kMiB, 64 * kMiB, Footprint(0, 0));
  EXPECT_FALSE(fixed.Admits(0, 60 * kMiB, 8 * kMiB));
  EXPECT_TRUE(fixed.Admits(0, 56 * kMiB, 8 * kMiB));
}

TEST(PrefetchPlanTest, AFixedWindowGoesOnUntilItsBytesAreTakenWhateverForwardDid) {
  const PrefetchPlan plan(size_t{16} * kMiB, 1000 * kMiB, Footprint(0, 0));
  EXPECT_TRUE(PrefetchPlan::Continues(size_t{16} * kMiB, 15 * kMiB));
  EXPECT_FALSE(PrefetchPlan::Continues(size_t{16} * kMiB, 16 * kMiB));
  EXPECT_TRUE(plan.Admits(8 * kMiB, 500 * kMiB, 8 * kMiB));  // no footprint bound
  EXPECT_EQ(WindowLimit(OffloadConfig{}), 0U);               // adaptive keeps no window
}

// -- The entry table.

class EntryTableTest : public ::testing::Test {
 protected:
  // An entry of `mib` MiB on device 0, keyed by its own slot (the table reads no storage).
  Entry& Add(size_t mib, bool sized = true, bool candidate = true) {
    auto entry = std::make_unique<Entry>();
    keys_.push_back(std::make_unique<int>(0));
    entry->key = keys_.back().get();
    entry->nbytes = mib * kMiB;
    return table_.Insert(std::move(entry), sized, candidate);
  }
  std::vector<uint64_t> Candidates(uint64_t before) {
    std::vector<uint64_t> seqs;
    table_.VisitSpillCandidates(
        before, [](const Entry& e) { return !e.acquired; },
        [&](Entry& e) {
          seqs.push_back(e.seq);
          return true;
        });
    return seqs;
  }

  EntryTable table_{1};
  std::vector<std::unique_ptr<int>> keys_;
};

TEST_F(EntryTableTest, TheLastKeeperLeavingHandsTheEntryBackForErasing) {
  Entry& e = Add(1);
  const KeeperId a = table_.AddKeeper(e, ViewInfo{});
  const KeeperId b = table_.AddKeeper(e, ViewInfo{});
  EXPECT_EQ(table_.KeeperOf(a).entry, &e);
  EXPECT_EQ(table_.RemoveKeeper(a), nullptr);
  EXPECT_EQ(table_.RemoveKeeper(b), &e);
  EXPECT_THROW(table_.KeeperOf(b), InvalidArgumentError);
  EXPECT_THROW(table_.RemoveKeeper(b), InvalidArgumentError);
  const void* key = e.key;
  std::unique_ptr<Entry> gone = table_.Erase(e);
  EXPECT_EQ(table_.Current(key), nullptr);
  EXPECT_TRUE(table_.InSaveOrder().empty());
}

TEST_F(EntryTableTest, ASetAsideEntryLivesBesideTheStoragesNewEntryUntilErased) {
  Entry& failed = Add(1);
  const void* key = failed.key;
  table_.SetAsideCurrent(key);
  EXPECT_EQ(table_.Current(key), nullptr);
  ASSERT_NE(table_.SetAside(key), nullptr);
  auto fresh = std::make_unique<Entry>();
  fresh->key = key;
  fresh->nbytes = kMiB;
  Entry& current = table_.Insert(std::move(fresh), true, true);
  EXPECT_EQ(table_.Current(key), &current);
  EXPECT_EQ(table_.Keys(), std::vector<const void*>{key});  // one storage, listed once
  table_.Erase(failed);
  EXPECT_EQ(table_.SetAside(key), nullptr);
  EXPECT_EQ(table_.Current(key), &current);
}

TEST_F(EntryTableTest, TheWindowHoldsTheNewestEntriesThatFitAndFollowsThemAsTheyGo) {
  table_.SetWindowLimit(4 * kMiB);
  Entry& a = Add(2);
  Entry& b = Add(2);
  Entry& c = Add(2);
  EXPECT_EQ(table_.WindowStart(0), b.seq);  // b and c: 4 MiB
  EXPECT_EQ(table_.WindowOldestKey(0), b.key);
  table_.LeaveWindow(c);  // released: a comes in
  EXPECT_EQ(table_.WindowStart(0), a.seq);
  table_.SetWindowLimit(0);  // adaptive: no window
  EXPECT_EQ(table_.WindowStart(0), table_.next_seq());
  EXPECT_EQ(table_.WindowOldestKey(0), nullptr);
}

TEST_F(EntryTableTest, SpillCandidatesAreVisitedOldestFirstAndPrunedOnceTheyMayNotSpill) {
  Entry& a = Add(1);
  Entry& b = Add(1);
  Add(1, /*sized=*/true, /*candidate=*/false);
  Entry& d = Add(1);
  EXPECT_EQ(Candidates(table_.next_seq()), (std::vector<uint64_t>{a.seq, b.seq, d.seq}));
  EXPECT_EQ(Candidates(d.seq), (std::vector<uint64_t>{a.seq, b.seq}));
  b.acquired = true;
  EXPECT_EQ(Candidates(table_.next_seq()), (std::vector<uint64_t>{a.seq, d.seq}));
  b.acquired = false;  // pruned for good: a policy never spills it again
  EXPECT_EQ(Candidates(table_.next_seq()), (std::vector<uint64_t>{a.seq, d.seq}));
  // A new save moves the entry to the newest place.
  table_.Resequence(a);
  EXPECT_EQ(Candidates(table_.next_seq()), (std::vector<uint64_t>{d.seq, a.seq}));
}

TEST_F(EntryTableTest, OffloadedListingsGoWithTheirSavesKeepers) {
  Entry& e = Add(1);
  const KeeperId first = table_.AddKeeper(e, ViewInfo{});
  const uint64_t first_save = e.seq;
  Add(1);
  table_.Resequence(e);  // saved again, by another graph
  const KeeperId second = table_.AddKeeper(e, ViewInfo{});
  table_.ListOffloaded(e);  // spilled: listed at both saves
  uint64_t cursor = table_.next_seq();
  EXPECT_EQ(table_.OffloadedBefore(&cursor), &e);
  EXPECT_EQ(cursor, e.seq);
  EXPECT_EQ(table_.OffloadedBefore(&cursor), &e);
  EXPECT_EQ(cursor, first_save);
  EXPECT_EQ(table_.OffloadedBefore(&cursor), nullptr);
  EXPECT_EQ(table_.RemoveKeeper(first), nullptr);  // its save is read by nobody now
  cursor = table_.next_seq();
  EXPECT_EQ(table_.OffloadedBefore(&cursor), &e);
  EXPECT_EQ(table_.OffloadedBefore(&cursor), nullptr);
  EXPECT_EQ(table_.RemoveKeeper(second), &e);
}

// The save a prefetch jumps to (BackwardJumps) is found by its save's seq: an entry's latest save,
// or an older save of a storage saved again, while that save's listing is offloaded.
TEST_F(EntryTableTest, SavedAtFindsTheEntryOfASave) {
  Entry& e = Add(1);
  const KeeperId first = table_.AddKeeper(e, ViewInfo{});
  const uint64_t first_save = e.seq;
  Entry& other = Add(1);
  EXPECT_EQ(table_.SavedAt(first_save), &e);
  EXPECT_EQ(table_.SavedAt(other.seq), &other);
  table_.Resequence(e);  // saved again, by another graph
  const KeeperId second = table_.AddKeeper(e, ViewInfo{});
  EXPECT_EQ(table_.SavedAt(e.seq), &e);
  EXPECT_EQ(table_.SavedAt(first_save), nullptr) << "not offloaded: not listed there";
  table_.ListOffloaded(e);
  EXPECT_EQ(table_.SavedAt(first_save), &e);
  EXPECT_EQ(table_.SavedAt(table_.next_seq()), nullptr);
  table_.RemoveKeeper(first);
  table_.RemoveKeeper(second);
}

}  // namespace
}  // namespace spillway
