// Where backward went on after it had read down a run of saves, learned from the previous cycle
// (from the engine's first entry to its last entry gone: a training step), for the prefetch.
//
// Prefetch walks the saves older than the one backward reads, newest first: the order one graph's
// backward reads them in. A pipeline's microbatches are several graphs saved one after the other
// and read oldest graph first (GPipe), so that walk runs out at the end of each graph's backward
// and the next graph's first reads wait for the link. This remembers, per run of reads (from a
// read of a save newer than all read before it, to the next such read: one graph's backward), the
// save the next run began at, and hands that to the walk when it runs out in the same run of the
// next cycle. No jump where a forward's save came between the two runs (1F1B: a forward comes
// between two microbatches' backwards, and what a prefetch brought back ahead of it would raise
// that forward's peak), and none to a save whose size is not the one learned there (another
// cycle's shape: an evaluation, another batch size: the engine checks).
//
// A cycle that read nothing (an evaluation's forward with grad on) keeps what the one before
// learned; a cycle never ends while an entry outlives its step (a graph kept), and then nothing
// new is learned.
//
// Positions are seqs counted from the cycle's first save (the engine's seqs are never reused, and a
// training step makes its saves, and the engine its seqs, in the same order each time). A wrong
// guess costs a prefetch, within the same limits as any other (PrefetchPlan), never a result.
//
// Pure: no lock, no I/O; the engine calls it under its lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace spillway {

class BackwardJumps {
 public:
  // A save at `seq` (a new one, or a storage saved again and given a new seq) of `bytes`;
  // `forward`: made by a forward (a backward's own saves, a recomputation's, are not a forward
  // between two runs). The first save with no entry in the engine begins a cycle.
  void OnSave(uint64_t seq, size_t bytes, bool forward);
  // Backward reads the save at `seq`.
  void OnRead(uint64_t seq);
  // The engine holds no entry: the cycle ends, and what it learned serves the next one.
  void OnEmpty();
  // Where the walk of saves older than the read at `seq` goes on once it ran out: a save seq of
  // this cycle and the bytes learned there (for the caller to check against the save it finds);
  // none when nothing was learned for that read.
  struct Jump {
    uint64_t seq = 0;
    size_t bytes = 0;
  };
  std::optional<Jump> After(uint64_t seq) const;

 private:
  static constexpr int32_t kNoRun = -1;
  // One cycle: per position, the bytes saved there (0: no save) and the run of the reads there;
  // per run, the position the next run began at (kNoRun: none, or a forward's save between).
  struct Cycle {
    std::vector<size_t> bytes;
    std::vector<int32_t> run_of;
    std::vector<int64_t> next_run_start;
  };
  std::optional<size_t> Position(uint64_t seq) const;

  Cycle learned_;  // the previous cycle's
  Cycle current_;
  bool in_cycle_ = false;
  uint64_t base_ = 0;  // the seq of the current cycle's first save
  // The current cycle's reads: the newest position read (none yet), and whether a forward saved
  // since the latest read.
  std::optional<size_t> newest_read_;
  bool saved_since_read_ = false;
};

}  // namespace spillway
