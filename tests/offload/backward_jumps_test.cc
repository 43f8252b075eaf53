// BackwardJumps (offload/backward_jumps.h): where the prefetch's walk goes on when it runs out,
// learned from the cycle before. On its own, then in the engine's prefetch.
#include "offload/backward_jumps.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <vector>

#include "tests/offload/engine_fixture.h"

namespace spillway {
namespace {

constexpr size_t kBytes = 1024;

// Saves at `first`, `first + 1`, ... (`count` of them) of kBytes each, made by a forward.
void SaveRange(BackwardJumps& jumps, uint64_t first, uint64_t count) {
  for (uint64_t seq = first; seq < first + count; ++seq) jumps.OnSave(seq, kBytes, true);
}

void Read(BackwardJumps& jumps, std::initializer_list<uint64_t> seqs) {
  for (const uint64_t seq : seqs) jumps.OnRead(seq);
}

// Two graphs of three saves each (GPipe), saves `base`..`base + 5`, read oldest graph first, each
// graph's saves newest first; then the engine empties.
void GPipeCycle(BackwardJumps& jumps, uint64_t base) {
  SaveRange(jumps, base, 6);
  Read(jumps, {base + 2, base + 1, base, base + 5, base + 4, base + 3});
  jumps.OnEmpty();
}

TEST(BackwardJumpsTest, TheNextCycleJumpsFromTheOlderGraphToTheNewerGraphsFirstRead) {
  BackwardJumps jumps;
  GPipeCycle(jumps, 10);
  SaveRange(jumps, 100, 6);  // the next step: the same saves at other seqs
  for (const uint64_t read : {100, 101, 102}) {
    const std::optional<BackwardJumps::Jump> jump = jumps.After(read);
    ASSERT_TRUE(jump.has_value()) << read;
    EXPECT_EQ(jump->seq, 105u);
    EXPECT_EQ(jump->bytes, kBytes);
  }
  for (const uint64_t read : {103, 104, 105}) EXPECT_FALSE(jumps.After(read)) << "the last graph";
}

TEST(BackwardJumpsTest, NothingIsLearnedBeforeACycleEnded) {
  BackwardJumps jumps;
  SaveRange(jumps, 10, 6);
  Read(jumps, {12, 11, 10, 15, 14, 13});
  EXPECT_FALSE(jumps.After(10));
}

TEST(BackwardJumpsTest, OneGraphsReadsBackAndForthAreOneRun) {
  // Within a graph's backward a layer reads its saves in its own order, all older than the
  // graph's first read: no jump, even from a read followed by a newer one.
  BackwardJumps jumps;
  SaveRange(jumps, 0, 6);
  Read(jumps, {5, 3, 4, 1, 2, 0});
  jumps.OnEmpty();
  SaveRange(jumps, 6, 6);
  for (uint64_t read = 6; read < 12; ++read) EXPECT_FALSE(jumps.After(read)) << read;
}

TEST(BackwardJumpsTest, AGraphsFirstReadsClimbingASaveOrTwoJumpToTheReadAfter) {
  // A loss reads its saves in save order (cross_entropy's input, target, then its own output):
  // each of those reads is a run of its own, whose jump is to the read that came after it.
  // The graph's bulk run still jumps to the next graph.
  BackwardJumps jumps;
  SaveRange(jumps, 0, 8);  // 0..3: the first graph (2, 3: its loss's), 4..7: the second
  Read(jumps, {2, 3, 1, 0, 6, 7, 5, 4});
  jumps.OnEmpty();
  SaveRange(jumps, 8, 8);
  EXPECT_EQ(jumps.After(10).value().seq, 11u);
  for (const uint64_t read : {8, 9, 11}) EXPECT_EQ(jumps.After(read).value().seq, 14u) << read;
  EXPECT_EQ(jumps.After(14).value().seq, 15u);
  for (const uint64_t read : {12, 13, 15}) EXPECT_FALSE(jumps.After(read)) << read;
}

TEST(BackwardJumpsTest, ACycleThatReadNothingKeepsWhatWasLearned) {
  BackwardJumps jumps;
  GPipeCycle(jumps, 0);
  SaveRange(jumps, 6, 6);  // an evaluation's forward with grad on: saves, never read
  jumps.OnEmpty();
  SaveRange(jumps, 12, 6);
  EXPECT_EQ(jumps.After(12).value().seq, 17u);
}

TEST(BackwardJumpsTest, NoJumpAcrossAForwardsSave) {
  // 1F1B: a forward runs between two microbatches' backwards; a prefetch of the next backward's
  // first save would sit on the device through it. A backward's own save (a recomputation) is
  // no forward.
  for (const bool forward : {true, false}) {
    BackwardJumps jumps;
    SaveRange(jumps, 0, 6);
    Read(jumps, {2, 1, 0});
    jumps.OnSave(6, kBytes, forward);
    Read(jumps, {5, 4, 3, 6});
    jumps.OnEmpty();
    SaveRange(jumps, 7, 7);
    EXPECT_EQ(jumps.After(7).has_value(), !forward) << forward;
  }
}

TEST(BackwardJumpsTest, TheLatestCycleIsTheOneLearned) {
  BackwardJumps jumps;
  GPipeCycle(jumps, 0);
  SaveRange(jumps, 6, 6);
  Read(jumps, {11, 10, 9, 8, 7, 6});  // this step read newest graph first: one run
  jumps.OnEmpty();
  SaveRange(jumps, 12, 6);
  EXPECT_FALSE(jumps.After(12));
}

TEST(BackwardJumpsTest, TheBytesLearnedAreTheSavesAtTheTarget) {
  BackwardJumps jumps;
  jumps.OnSave(0, 1, true);
  jumps.OnSave(1, 2, true);
  Read(jumps, {0, 1});
  jumps.OnEmpty();
  jumps.OnSave(2, 1, true);
  const std::optional<BackwardJumps::Jump> jump = jumps.After(2);
  ASSERT_TRUE(jump.has_value());
  EXPECT_EQ(jump->seq, 3u);
  EXPECT_EQ(jump->bytes, 2u);
}

TEST(BackwardJumpsTest, ReadsOutsideTheCycleAreNoRun) {
  BackwardJumps jumps;
  jumps.OnRead(5);  // no cycle yet
  SaveRange(jumps, 10, 3);
  Read(jumps, {9, 2, 12, 11, 10, 500});  // before the cycle's first save, and never saved
  jumps.OnEmpty();
  SaveRange(jumps, 20, 3);
  for (const uint64_t read : {19, 20, 21, 22, 520}) EXPECT_FALSE(jumps.After(read)) << read;
}

}  // namespace
}  // namespace spillway

namespace spillway::testing {
namespace {

// GPipe (torch's ScheduleGPipe): two graphs saved one after the other, each read newest save
// first, the older graph first, in step after step. The walk from the older graph's last reads
// runs out; from the second step on it goes on at the newer graph's first read of the step
// before (BackwardJumps), so that read finds its save reloading or back rather than waiting for
// the whole copy. Not where the newer graph's first save is not of the size learned there (another
// shape of step): that guess is not made. Returns, per step, whether the newer graph's first save
// was still on the host once the older graph's backward had read its last save.
class OffloadPrefetchJumpTest : public OffloadEngineTest {
 protected:
  std::vector<bool> NewerGraphLeftSpilled(const std::vector<size_t>& newest_sizes) {
    Make(Policy(OffloadPolicy::kEager), 256 * kMiB, std::chrono::microseconds{0});
    std::vector<bool> left;
    for (const size_t newest : newest_sizes) {
      std::vector<std::shared_ptr<TestStorage>> saved;
      std::vector<KeeperId> ids;
      for (uint32_t i = 0; i < 6; ++i) {  // 0..2: the older graph, 3..5: the newer
        saved.push_back(NewStorage(i == 5 ? newest : 2 * kMiB, i));
        ids.push_back(Save(saved.back()));
        saved.back()->holders = 0;
      }
      engine_->ForwardEnd();
      engine_->Synchronize();
      for (const size_t i : {2, 1, 0, 5, 4, 3}) {
        const auto seed = static_cast<uint32_t>(i);
        EXPECT_EQ(AcquireAndRead(ids[i], saved[i]->nbytes()), Pattern(saved[i]->nbytes(), seed));
        if (i == 0) left.push_back(StateOf(saved[5]) == Residency::kSpilled);
        engine_->RemoveKeeper(ids[i]);
        saved[i]->drop_device_memory();  // backward is done with it
      }
      engine_->Synchronize();
      EXPECT_EQ(EngineStat("num_entries"), 0);  // the step ended: the engine is empty
    }
    return left;
  }
};

TEST_F(OffloadPrefetchJumpTest, OffloadAPipelinesNextGraphIsPrefetchedFromTheSecondStepOn) {
  EXPECT_EQ(NewerGraphLeftSpilled({2 * kMiB, 2 * kMiB, 2 * kMiB}),
            (std::vector<bool>{true, false, false}));
}

TEST_F(OffloadPrefetchJumpTest, OffloadNoJumpToASaveOfAnotherSize) {
  EXPECT_EQ(NewerGraphLeftSpilled({2 * kMiB, 4 * kMiB, 4 * kMiB}),
            (std::vector<bool>{true, true, false}));
}

}  // namespace
}  // namespace spillway::testing
