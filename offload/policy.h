// The offload policies as plans: pure functions of the configuration and of what the engine
// measured, which return what to do; the engine carries a plan out (OffloadEngine::Carry,
// OffloadEngine::Prefetch), re-reading the allocator's numbers as it goes, since each spill or
// reload changes them by the size of a block, which only the allocator knows.
//
// No state beyond the per-device footprint the engine keeps, no I/O, no lock: tested on their own
// (tests/offload/policy_test.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <optional>

#include "allocator/config.h"

namespace spillway {

// Per device, what an adaptive prefetch knows of the latest forward. The engine tells it of each
// save, read, change of spilled bytes and prefetch given back.
struct ForwardFootprint {
  // The most bytes allocated at a save of the latest forward: backward is kept within it.
  size_t saving_high = 0;
  // The most bytes spilled at once since the latest forward began: an adaptive prefetch reloads
  // at most an eighth of it ahead (beyond the next save).
  size_t spilled_high = 0;
  // Bytes of prefetches `auto` gave back under its budget since the latest forward began: room
  // backward's own allocations needed, which an adaptive prefetch leaves to them.
  size_t room_taken = 0;
  // A save was read since the last save: the next save starts another forward, whose footprint
  // is its own (a larger one before, an evaluation's or another batch size's, says nothing).
  bool read_since_save = false;

  // A save, with `allocated` bytes allocated on the device (the saved bytes among them). True
  // when it begins another forward (the first save after a read).
  bool OnSave(size_t allocated);
  void OnRead() { read_since_save = true; }
  void OnSpilledBytes(size_t spilled_now);
};

// Per device: how many bytes `eager` spills in one forward, learned from the run of that forward
// before. A spill that backward took back (its copy to the host still running when backward
// wanted the storage: OffloadEngine::TakeBack) freed no memory at all: its block stayed pending,
// handed to no other allocation, until backward took it; meanwhile it took the link's time, and
// after its read its free waited for that copy again. Eager spills each save as soon as it may,
// oldest first, so what backward takes back is the newest: the part of the forward the link did
// not carry before backward. The next run of the forward spills, oldest first, only what the last
// one got across (its spills less those taken back) and defers the rest to its end, where it keeps
// them on the device if the forward is the one the bound was learned on (as many saves: the same
// graph, its sizes free to vary), and spills them otherwise (another forward, which the bound says
// nothing of). Where the bound deferred saves and nothing was taken back, it grows by an eighth
// (at least the first save deferred) per forward: a longer forward, a freer link. No timing: what
// was taken back is the allocator's own account, in the order of its allocations and frees, of
// what crossed in time, which holds where the host runs ahead of the device (CUDA) as where it
// does not. None until something was taken back in two runs of the forward running (the more of
// what they got across): a first step's copies wait for the pinned buffers it makes, and a stall
// of one step (a collection, an evaluation's) says nothing of the link; bounded on one such step,
// eager kept on the device for several steps what it could have spilled (measured on the
// simulated device: 2-6.5 of 24 MiB taken back in the first step, nothing in the next ones, and
// up to 4 MiB more held at backward's peak while the bound grew back).
class ForwardSpillQuota {
 public:
  void OnSave() { ++saves_; }
  // Whether a save of this forward of `bytes` may be spilled now; once one was deferred, every
  // later one is (the newer saves are no less likely to be taken back).
  bool Admits(size_t bytes) const {
    return !limit_.has_value() || (first_deferred_ == 0 && spilled_ + bytes <= *limit_);
  }
  void OnSpill(size_t bytes) { spilled_ += bytes; }
  void OnDeferred(size_t bytes) {
    if (first_deferred_ == 0) first_deferred_ = bytes;
  }
  // At the forward's end: whether its deferred saves stay on the device (it is the forward the
  // bound was learned on), or go.
  bool KeepsDeferred() const { return limit_.has_value() && saves_ == learned_saves_; }
  void OnTakenBack(size_t bytes) { taken_back_ += bytes; }
  // Another forward begins: the bound for it, from the one that ended.
  void OnForwardStart();
  // Forgets what was learned (another policy ran: its forwards say nothing of eager's).
  void Reset() { *this = ForwardSpillQuota(); }
  // The bytes this forward may spill before deferring; none: no bound.
  std::optional<size_t> limit() const { return limit_; }

 private:
  std::optional<size_t> limit_;
  // No bound yet and the run before had saves taken back: what it got across.
  std::optional<size_t> unbound_across_;
  size_t learned_saves_ = 0;   // the saves of the forward the bound was learned on
  size_t saves_ = 0;           // saves since this forward began
  size_t spilled_ = 0;         // its saves eager spilled
  size_t taken_back_ = 0;      // its saves taken back (by its backward)
  size_t first_deferred_ = 0;  // the first save deferred (0: none)
};

// Per device: how many bytes `auto` spills as a forward saves them, before its budget asks.
// A spill made when an allocation reaches the budget frees its block only once its copy to the
// host has read it (nothing may reuse the block before): spills made at the forward's peak free
// nothing there, the device holds more than the budget while their copies run (the allocator
// waits for them, or takes more memory), and the copies cross after the forward, where backward
// waits for the link. The same saves spilled as the forward makes them, oldest first (the ones
// the budget takes first, read last in backward), copy while the forward computes and have freed
// their blocks by its peak.
// How many: what the device would hold with nothing spilled (allocated plus spilled bytes) rose
// to in the run of the forward before, above what it held at that forward's first save, is how
// much this one adds to what it holds at its own (weights' gradients, optimizer states, an
// accumulated gradient may come and go between forwards: the growth is the forward's own); what
// that reaches above the budget's target (BudgetTarget) is spilled ahead. The rise is the one at
// its saves, plus how far the allocations that reached the budget (the loss's, backward's) went
// above them; a forward that spills ahead reaches the budget no more, so that excess is kept from
// the last forward that did, and the part at the saves is learned anew each time (a smaller
// forward spills less). The budget still holds where a forward grew: it spills the rest as
// before. No timing.
class ForwardSpillAhead {
 public:
  // What the device would hold with nothing spilled, `allocated` and `spilled` bytes, at a save
  // (OnSave) or at an allocation past the budget, counted in `allocated` (OnBudgetReached).
  void OnSave(size_t allocated, size_t spilled);
  void OnBudgetReached(size_t allocated, size_t spilled) {
    reached_high_ = std::max(reached_high_, allocated + spilled);
  }
  // Whether a save of this forward of `bytes` is spilled now: until its spills reach the bytes
  // to spill ahead; once one did not fit, no later one does (oldest first, as the budget would).
  bool Admits(size_t bytes) const { return !stopped_ && spilled_ + bytes <= ahead_; }
  // A save of this forward spilled (ahead, or by the budget: both count).
  void OnSpill(size_t bytes) { spilled_ += bytes; }
  void OnStopped() { stopped_ = true; }
  // Nothing more to spill ahead in this forward.
  bool Done() const { return stopped_ || spilled_ >= ahead_; }
  // Another forward begins (before its first save is told) on a device whose budget's target is
  // `target`: the bytes it spills ahead, from the forward that ended.
  void OnForwardStart(size_t target, size_t allocated, size_t spilled);
  // Forgets what was learned (another policy ran: its forwards say nothing of auto's).
  void Reset() { *this = ForwardSpillAhead(); }
  size_t ahead() const { return ahead_; }

 private:
  // This forward's, with nothing spilled: held at its first save, the most at a save, and the
  // most at an allocation past the budget (0: none).
  std::optional<size_t> first_;
  size_t save_high_ = 0;
  size_t reached_high_ = 0;
  size_t excess_ = 0;   // how far the allocations past the budget went above the saves
  size_t ahead_ = 0;    // bytes of this forward's saves to spill as they come
  size_t spilled_ = 0;  // of this forward's saves, spilled so far
  bool stopped_ = false;
};

// What a policy asks of the engine. First, unread prefetches are given back (no copy: their host
// copies are kept) until allocated bytes reach `give_back_to`; then eligible saves are spilled,
// oldest first.
struct SpillPlan {
  enum class Spills {
    kNone,         // none
    kAllEligible,  // every save a policy may spill that nothing but its keepers holds
    kToTarget,     // until allocated bytes reach `spill_to`
  };
  std::optional<size_t> give_back_to;  // none: no prefetch is given back
  Spills spills = Spills::kNone;
  size_t spill_to = 0;
  // Which saves: those outside the prefetch window a policy may spill (false), or any save, the
  // ones a policy keeps included (true: the out-of-memory rescue).
  bool include_window = false;
  // The prefetches given back made room that backward's own allocations needed (`auto`'s budget):
  // an adaptive prefetch leaves it to them for the rest of that backward, rather than refill it
  // at the next read and give it back at the next allocation (a copy each way for nothing; seen
  // as more bytes reloaded than spilled). Not the rescue's: that allocation fails otherwise.
  bool room_for_backward = false;
  // Eager's at the end of a forward: the saves its bound deferred are kept or spilled there
  // (ForwardSpillQuota::KeepsDeferred); after a save they wait.
  bool forward_end = false;
};

// `eager`, after a save or at the end of forward: every eligible save, on every device, within
// each device's bound on its forward (ForwardSpillQuota).
SpillPlan PlanEager(bool forward_end);
// `auto` on one device, with `allocated` bytes allocated and `incoming` about to be: nothing when
// that fits in `budget`, else down to the budget less a sixteenth (so that the next allocations
// do not ask again) less what is coming. Prefetches nobody read go first: one costs no copy now,
// where a spill costs one each way.
std::optional<SpillPlan> PlanBudget(size_t allocated, size_t incoming, size_t budget);
// The allocated bytes `auto` spills down to on a device of `budget`: a sixteenth below it.
size_t BudgetTarget(size_t budget);
// The out-of-memory rescue: `bytes` below `allocated`, prefetches first, then (except under
// "off") any eligible save.
SpillPlan PlanRescue(OffloadPolicy policy, size_t allocated, size_t bytes);

// The budget of a device: `budget_bytes` if set, else its fraction of the memory limit, or of
// the device where that is smaller (a limit may name more than the device has).
size_t BudgetBytes(const OffloadConfig& config, size_t device_total, size_t memory_limit);

// The bytes of the prefetch window `auto` keeps resident (its newest saves): the fixed
// prefetch_bytes, or none when prefetch is adaptive (backward's first reads come back on demand,
// and the reloads after them overlap).
size_t WindowLimit(const OffloadConfig& config);

// How far backward reloads ahead of a read on one device: saves older than the one read, newest
// first, while Admits says so.
class PrefetchPlan {
 public:
  // `window`: fixed bytes (OffloadConfig::prefetch_bytes), or none: adaptive.
  PrefetchPlan(std::optional<size_t> window, size_t budget, const ForwardFootprint& footprint);
  // Whether to look at another save, with `prefetched` bytes prefetched and not read yet: a
  // fixed window goes on until its bytes are taken. (Static: the engine asks it before it knows
  // the budget, which it asks the allocator only once there is a save to bring back.)
  static bool Continues(std::optional<size_t> window, size_t prefetched) {
    return !window.has_value() || prefetched < *window;
  }
  // Whether to reload one more save of `bytes`, with `allocated` bytes allocated now. Never past
  // the budget (under "eager" too: the configured fraction of the device), so that backward's own
  // allocations keep their headroom: a prefetch is a guess, and reloads that fill the device make
  // backward run out of memory, or spill them again. Adaptive: the next save always (a read it
  // overlaps with), then older ones up to an eighth of what forward spilled (backward's start
  // holds what forward's end did: reloading more there brought the peak back), and only while
  // backward stays within the most that forward held (and the budget), less a sixteenth and the
  // room `auto` gave back to backward's own allocations, which land on top. No timing decides
  // it: on CUDA the host runs ahead of the device, so when backward asks for a save says nothing
  // of when the device reads it.
  bool Admits(size_t prefetched, size_t allocated, size_t bytes) const;

 private:
  std::optional<size_t> window_;
  size_t budget_;
  size_t ceiling_;  // adaptive: allocated bytes a prefetch beyond the next save stays within
  size_t depth_;    // adaptive: prefetched bytes beyond the next save
};

}  // namespace spillway
