// OffloadEngine: carrying out the policies' plans (offload/policy.h): spills after saves and under
// the budget, prefetch, the out-of-memory rescue.
#include <algorithm>
#include <cstddef>
#include <limits>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"
#include "allocator/format.h"
#include "allocator/history.h"
#include "allocator/speculative.h"
#include "offload/engine.h"
#include "offload/engine_internal.h"

namespace spillway {

void OffloadEngine::Prefetch(EngineLock& lock, int device, uint64_t before_seq,
                             StreamRef consumer) {
  // Under "off" too: saves spilled by an inner block come back ahead of use all the same.
  if (config_.prefetch_bytes == 0) return;
  // Per device: each has its own memory, budget and copy stream.
  DeviceState& state = State(device);
  size_t& prefetched = state.prefetched_bytes;
  const std::optional<size_t> window = config_.prefetch_bytes;
  // Made at the first save there is to bring back: the budget is asked of the allocator, and
  // most reads find nothing to prefetch.
  std::optional<PrefetchPlan> plan;
  uint64_t cursor = before_seq;  // newest first, from just below `before_seq`
  bool jumped = false;
  while (PrefetchPlan::Continues(window, prefetched)) {
    Entry* const candidate = table_.OffloadedBefore(&cursor);
    if (candidate == nullptr) {
      // Run out: where backward went on after this run of reads in the last cycle, once, if the
      // save there is this device's and of the size learned (the same step's shape).
      if (jumped) break;
      jumped = true;
      const std::optional<BackwardJumps::Jump> jump = jumps_.After(before_seq);
      if (!jump.has_value()) break;
      const Entry* const target = table_.SavedAt(jump->seq);
      if (target == nullptr || target->device != device || target->nbytes != jump->bytes) break;
      cursor = jump->seq + 1;  // from that save itself
      continue;
    }
    Entry& e = *candidate;
    // Saves on other devices (a process driving several GPUs): `consumer` is no stream of theirs.
    if (e.device != device) continue;
    // Another thread allocates for its reload (this loop's, or a read of it): its own to finish.
    if (e.allocating) continue;
    Refresh(e);
    if (e.state != Residency::kSpilled && e.state != Residency::kSpilling) {
      table_.UnlistOffloaded(cursor);  // reloaded on demand, or failed
      continue;
    }
    if (!plan.has_value()) plan.emplace(window, BudgetLocked(device), state.footprint);
    if (!plan->Admits(prefetched, AllocatedBytes(device), e.nbytes)) break;
    try {
      // Allocated with the lock released; the entry may go meanwhile (its last keeper, on
      // another thread): gone, it is not this prefetch's any more.
      if (!Reload(lock, e, consumer, /*prefetch=*/true)) continue;
    } catch (const ProgramStreamError&) {
      throw;  // the program's own failed copy, not the prefetch's: never swallowed
    } catch (const std::exception&) {
      break;  // prefetch is best effort; Acquire will retry and report
    }
    table_.UnlistOffloaded(cursor);
    e.prefetched = true;
    prefetched += e.nbytes;
  }
}

void OffloadEngine::ForwardEnd() {
  EngineLock lock(mutex_, this);
  RunPolicyLocked(/*forward_end=*/true);
}

void OffloadEngine::RunPolicy() {
  EngineLock lock(mutex_, this);
  RunPolicyLocked();
}

void OffloadEngine::RunPolicyLocked(bool forward_end) {
  copies_.ForEachStarted([&](int device) { TakeHeardFailures(device); });
  if (config_.policy == OffloadPolicy::kEager) {
    Carry(PlanEager(forward_end), kAllDevices);
  } else if (config_.policy == OffloadPolicy::kAuto) {
    for (int d = 0; d < static_cast<int>(devices_.size()); ++d) {
      SpillAhead(d);
      SpillToBudget(d, 0);
    }
  }
}

void OffloadEngine::SpillAhead(int device) {
  DeviceState& state = State(device);
  ForwardSpillAhead& ahead = state.ahead;
  if (ahead.Done()) return;
  SpillPass pass;
  // As the budget would, oldest first, outside the prefetch window; only this forward's saves
  // (what an older one left is not what the bytes were learned on).
  table_.VisitSpillCandidates(table_.WindowStart(device), PolicyMaySpill, [&](Entry& e) {
    if (e.device != device || e.forward != state.forward || !Eligible(e)) return true;
    if (!ahead.Admits(e.nbytes)) {
      ahead.OnStopped();
      return false;
    }
    SpillInPass(e, pass);  // counted in `ahead` there
    return !ahead.Done();
  });
}

void OffloadEngine::SpillToBudget(int device, size_t incoming_bytes) {
  // Nothing allocated, nothing to spill; and the budget of a device nobody uses is not asked for
  // (on CUDA that would create a context on it).
  const size_t allocated = AllocatedBytes(device);
  if (allocated + incoming_bytes == 0) return;
  if (const auto plan = PlanBudget(allocated, incoming_bytes, BudgetLocked(device))) {
    // (A reload's allocation is the one coming: its bytes are spilled no more.)
    DeviceState& state = State(device);
    const auto spilled = static_cast<size_t>(state.spilled_bytes);
    state.ahead.OnBudgetReached(allocated + incoming_bytes,
                                spilled - std::min(spilled, state.reloading_bytes));
    Carry(*plan, device);
  }
}

size_t OffloadEngine::Carry(const SpillPlan& plan, int device) {
  size_t released = 0;
  if (plan.give_back_to.has_value()) {
    const size_t given_back = GiveBackPrefetches(device, *plan.give_back_to);
    released += given_back;
    if (plan.room_for_backward) State(device).footprint.room_taken += given_back;
  }
  SpillPass pass;
  switch (plan.spills) {
    case SpillPlan::Spills::kNone:
      break;
    case SpillPlan::Spills::kAllEligible:
      // What stays a candidate is what the program still holds: a few tensors, not the graph.
      // (A refusal for good, a resized storage, drops the entry from the candidates; one for
      // now, no pinned memory or a copy that could not be issued, leaves it for the next pass.)
      table_.VisitSpillCandidates(table_.next_seq(), PolicyMaySpill, [&](Entry& e) {
        if (!Eligible(e)) return true;
        DeviceState& state = State(e.device);
        ForwardSpillQuota& quota = state.quota;
        const bool this_forward = e.forward == state.forward;
        if (this_forward && !quota.Admits(e.nbytes)) {
          // Past what the link carried before backward in the run of this forward before:
          // deferred, as is every later save of this forward (with one device saving, nothing
          // is left to visit after a save), to the forward's end, where they stay for backward
          // if this is that forward (each counted; the out-of-memory rescue may still spill
          // them), and go if it is another.
          quota.OnDeferred(e.nbytes);
          if (!plan.forward_end) return saving_devices_ > 1;
          if (quota.KeepsDeferred()) {
            CountSkipOf(e, kSkipLink);
            return true;
          }
        }
        SpillInPass(e, pass);
        if (this_forward && e.state != Residency::kResident) quota.OnSpill(e.nbytes);
        return true;
      });
      break;
    case SpillPlan::Spills::kToTarget:
      if (AllocatedBytes(device) <= plan.spill_to) break;
      if (plan.include_window) {
        // The rescue (an allocation would fail otherwise): any eligible entry, oldest first, the
        // ones a policy would keep included. Rare enough to visit every entry.
        for (const auto& [seq, entry] : table_.InSaveOrder()) {
          if (AllocatedBytes(device) <= plan.spill_to) break;
          if (entry->device != device) continue;
          // A reload that finished while nobody looked (its saves outlive backward:
          // retain_graph) is resident, and may go again.
          Refresh(*entry);
          if (Eligible(*entry)) SpillInPass(*entry, pass);
        }
        break;
      }
      // The newest entries (up to the prefetch window) are needed first in backward: kept.
      table_.VisitSpillCandidates(table_.WindowStart(device), PolicyMaySpill, [&](Entry& e) {
        if (AllocatedBytes(device) <= plan.spill_to) return false;
        if (e.device == device && Eligible(e)) SpillInPass(e, pass);
        return true;
      });
      break;
  }
  return released + pass.released;
}

void OffloadEngine::SpillInPass(Entry& e, SpillPass& pass) {
  if (e.nbytes >= pass.no_host_from) {
    CountSkipOf(e, pass.no_host_reason);  // kept on the device for that reason all the same
    return;
  }
  // Refused (a prefetch keeps its host copy until read, and GiveBackPrefetches takes those; no
  // pinned memory; a copy that could not be issued; a resized storage): nothing released.
  const SpillResult result = Spill(e);
  switch (result.outcome) {
    case SpillOutcome::kSpilled: {
      pass.released += result.block_bytes;
      // A save of this forward spilled, ahead or not: auto spills ahead that much less.
      DeviceState& state = State(e.device);
      if (e.forward == state.forward) state.ahead.OnSpill(e.nbytes);
      break;
    }
    case SpillOutcome::kNoHostMemory:
      pass.no_host_from = e.nbytes;
      pass.no_host_reason = e.skipped_for;
      break;
    case SpillOutcome::kRefused:
      break;
  }
}

size_t OffloadEngine::ReleaseMemory(int device, size_t bytes) {
  // (Never for a prefetch's allocation: the allocator asks no holder to make room for a
  // speculative one, which stops where memory does rather than push other saves out.)
  EngineLock lock(mutex_, this);
  if (device < 0 || device >= static_cast<int>(devices_.size())) return 0;
  // The ladder that calls this may have heard of a copy's failure: settle it before any spill
  // below is issued, or it would fail those too once heard.
  TakeHeardFailures(device);
  const size_t released = Carry(PlanRescue(config_.policy, AllocatedBytes(device), bytes), device);
  if (released > 0) {
    // The allocator retries right after this returns: the freed blocks must be reusable. Each
    // spill's own event is waited on first: a failed copy is reported once, to the first wait
    // that finds it, and must mark its entry failed rather than escape from the stream-wide wait
    // (leaving the entry to pass for spilled with bytes that never arrived).
    for (const auto& [seq, entry] : table_.InSaveOrder()) {
      if (entry->device == device && entry->state == Residency::kSpilling) Refresh(*entry, true);
    }
    copies_.WaitStream(device, Residency::kSpilling);
    for (const auto& [seq, entry] : table_.InSaveOrder()) Refresh(*entry);
  }
  return released;
}

size_t OffloadEngine::GiveBackPrefetches(int device, size_t target_allocated) {
  // A prefetch nobody has used yet is a guess, and an allocation that fails otherwise comes first
  // (without this, prefetching made backward run out of memory where reloading at use fitted).
  // Until it is acquired the entry keeps its host copy (Refresh): once the copy to the device is
  // done, the device copy can go with no copy back. Oldest first: backward reads those last.
  size_t released = 0;
  for (const auto& [seq, entry] : table_.InSaveOrder()) {
    if (AllocatedBytes(device) <= target_allocated) break;
    Entry& e = *entry;
    // (A prefetch keeps its host copy until it is acquired or fails, either of which ends it.)
    if (e.device != device || !e.prefetched || e.storage->external_holders() != 0) continue;
    // Taken back while its spill was copying (TakeBack): no host copy to fall back on.
    if (e.host == nullptr) continue;
    // Waits for the copy (and the spill it read from, if it was still copying): a failure
    // found there fails the entry, which then is no prefetch any more.
    Refresh(e, /*wait=*/true);
    if (e.state != Residency::kResident || !e.prefetched) continue;
    const auto info = allocator_.Lookup(e.storage->data());
    // The copy is done and nothing else used the block: it may be reused at once.
    e.storage->drop_device_memory();
    e.state = Residency::kSpilled;
    EndPrefetch(e);
    table_.ListOffloaded(e);
    CountSpilled(e, true);
    Note(OffloadEvent::Kind::kPrefetchGivenBack, e);
    released += info ? info->size : e.nbytes;
  }
  return released;
}

void OffloadEngine::OnPressure(int device, size_t incoming_bytes) {
  // A prefetch's (speculative) allocation: it stops at the budget on its own (PrefetchPlan).
  if (SpeculativeAllocations::Active()) return;
  EngineLock lock(mutex_, this);
  if (config_.policy != OffloadPolicy::kAuto) return;
  TakeHeardFailures(device);
  SpillToBudget(device, incoming_bytes);
}

size_t OffloadEngine::AllocatedBytes(int device) const {
  return static_cast<size_t>(allocator_.stats(device).allocated_bytes.all().current);
}

size_t OffloadEngine::budget_bytes(int device) const {
  EngineLock lock(mutex_, this);
  return BudgetLocked(device);
}

size_t OffloadEngine::BudgetLocked(int device) const {
  // The device's total is asked for only when needed: on CUDA the query makes its context.
  if (config_.budget_bytes != 0) return config_.budget_bytes;
  return BudgetBytes(config_, allocator_.total_memory(device), allocator_.memory_limit(device));
}

size_t OffloadEngine::spilled_bytes(int device) const {
  EngineLock lock(mutex_, this);
  if (device < 0 || static_cast<size_t>(device) >= devices_.size()) {
    throw InvalidArgumentError(absl::StrFormat(
        "OffloadEngine::spilled_bytes: device %d is out of range: valid devices are 0..%d", device,
        devices_.size() - 1));
  }
  return static_cast<size_t>(devices_[static_cast<size_t>(device)].spilled_bytes);
}

void OffloadEngine::CountSpilled(const Entry& e, bool spilled) {
  const auto bytes = static_cast<int64_t>(e.nbytes);
  if (spilled) {
    stats_.spilled_bytes.Increase(bytes);
  } else {
    stats_.spilled_bytes.Decrease(bytes);
  }
  DeviceState& state = State(e.device);
  state.spilled_bytes += spilled ? bytes : -bytes;
  state.footprint.OnSpilledBytes(static_cast<size_t>(state.spilled_bytes));
}

void OffloadEngine::UpdateWatermarks() {
  for (int d = 0; d < allocator_.device_count(); ++d) {
    if (config_.policy != OffloadPolicy::kAuto) {
      allocator_.SetWatermark(d, std::numeric_limits<size_t>::max());
    } else if (config_.budget_bytes != 0) {
      allocator_.SetWatermark(d, config_.budget_bytes);
    } else {
      // The same budget as budget_bytes(d), resolved by the allocator on the device's first
      // memory: asking every device for its total here would create a CUDA context on each.
      allocator_.SetWatermarkFraction(d, config_.budget_fraction);
    }
  }
}

void OffloadEngine::SetConfig(const OffloadConfig& config) {
  CheckedOffloadConfig(config);
  EngineLock lock(mutex_, this);
  // Entries saved so far keep the minimum size of the block they were saved in (offload blocks
  // nest, and each one sets the configuration as it starts and ends).
  const bool new_window = config.prefetch_bytes != config_.prefetch_bytes;
  const bool new_host_limit = config.host_limit_bytes != config_.host_limit_bytes;
  // What eager and auto learned of their forwards (ForwardSpillQuota, ForwardSpillAhead) is their
  // own: another policy's forwards say nothing of it.
  if (config.policy != config_.policy) {
    for (DeviceState& state : devices_) {
      state.quota.Reset();
      state.ahead.Reset();
    }
  }
  config_ = config;
  if (new_host_limit) copies_.SetHostLimit(config_.host_limit_bytes);
  if (new_window) table_.SetWindowLimit(WindowLimit(config_));
  UpdateWatermarks();
}

OffloadConfig OffloadEngine::config() const {
  EngineLock lock(mutex_, this);
  return config_;
}

}  // namespace spillway
