// OffloadEngine: the spill policies, prefetch, the out-of-memory rescue and the budget.
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

void OffloadEngine::Prefetch(int device, uint64_t before_seq, StreamRef consumer) {
  // Under "off" too: saves spilled by an inner block come back ahead of use all the same.
  const std::optional<size_t> window = config_.prefetch_bytes;
  if (window == 0) return;
  // Per device: each has its own memory, budget and copy stream.
  DeviceContext& dc = Device(device);
  size_t& prefetched = dc.prefetched_bytes;
  uint64_t cursor = before_seq;  // newest first, from just below `before_seq`
  // A fixed window: up to its bytes. Adaptive: the bounds below. No timing decides the depth: on
  // CUDA the host runs ahead of the device, so when backward asks for a save says nothing of when
  // the device reads it, and depth only helps there (the copies wait for the consumer stream to
  // reach the read that asked, then run back to back).
  while (!window.has_value() || prefetched < *window) {
    auto it = offloaded_.lower_bound(cursor);
    if (it == offloaded_.begin()) break;
    --it;
    cursor = it->first;
    Entry& e = *it->second;
    // Saves on other devices (a process driving several GPUs): `consumer` is no stream of theirs.
    if (e.device != device) continue;
    Refresh(e);
    if (e.state != Residency::kSpilled && e.state != Residency::kSpilling) {
      offloaded_.erase(cursor);  // reloaded on demand, or failed
      continue;
    }
    // Never prefetch past the budget (under "eager" too: the configured fraction of the device
    // limit), so backward's own allocations keep their headroom: a prefetch is a guess, and
    // reloads that fill the device would make backward run out of memory, or spill them again.
    const size_t after = AllocatedBytes(e.device) + e.nbytes;
    const size_t budget = budget_bytes(e.device);
    if (after > budget) break;
    // Adaptive: the next save always (a read it overlaps with), then older ones up to an eighth
    // of what forward spilled (backward's start holds what forward's end did: reloading more
    // there brought the peak back), and only while backward stays within the most that forward
    // held (and the budget), less a sixteenth left to backward's own allocations, which land on
    // top: prefetching does not raise the peak, nor fill `auto`'s budget only to be given back
    // at backward's next allocation.
    if (!window.has_value() && prefetched > 0) {
      size_t ceiling = std::min(budget, dc.saving_high);
      ceiling -= std::min(ceiling, ceiling / 16 + dc.prefetch_room_taken);
      if (prefetched + e.nbytes > dc.spilled_high / 8 || after > ceiling) break;
    }
    try {
      PolicyScope scope(in_policy_);
      // A guess: it takes free memory only, and a miss is no out-of-memory error (the ladder's
      // waits and cache releases for it cost more than the prefetch could save).
      const SpeculativeAllocations speculative;
      Reload(e, consumer);
    } catch (const ProgramStreamError&) {
      throw;  // the program's own failed copy, not the prefetch's: never swallowed
    } catch (const std::exception&) {
      break;  // prefetch is best effort; Acquire will retry and report
    }
    offloaded_.erase(cursor);
    e.prefetched = true;
    prefetched += e.nbytes;
  }
}

void OffloadEngine::ForwardEnd() {
  EngineLock lock(mutex_);
  RunPolicy();
}

template <typename Visit>
void OffloadEngine::VisitSpillCandidates(uint64_t before_seq, Visit visit) {
  for (auto it = spill_candidates_.begin();
       it != spill_candidates_.end() && it->first < before_seq;) {
    const uint64_t seq = it->first;
    Entry& e = *it->second;
    if (!PolicyMaySpill(e)) {
      spill_candidates_.erase(seq);
    } else if (!visit(e)) {
      return;
    }
    it = spill_candidates_.upper_bound(seq);
  }
}

void OffloadEngine::RunPolicy() {
  EngineLock lock(mutex_);
  if (in_policy_) return;
  PolicyScope scope(in_policy_);
  for (const auto& dc : devices_) {
    if (dc != nullptr) TakeHeardFailures(dc->device);
  }
  if (config_.policy == OffloadPolicy::kEager) {
    // What stays a candidate is what the program still holds: a few tensors, not the graph.
    // (A refusal for good, a resized storage, drops the entry from the candidates; one for now,
    // no pinned memory or a copy that could not be issued, leaves it for the next pass.)
    SpillPass pass;
    VisitSpillCandidates(next_seq_, [&](Entry& e) {
      if (Eligible(e)) SpillInPass(e, pass);
      return true;
    });
  } else if (config_.policy == OffloadPolicy::kAuto) {
    for (int d = 0; d < static_cast<int>(devices_.size()); ++d) SpillToBudget(d, 0);
  }
}

void OffloadEngine::SpillToBudget(int device, size_t incoming_bytes) {
  // Spill down to the budget less a hysteresis, so the next few allocations do not re-trigger,
  // and less what is about to be allocated, so that it fits too.
  // Nothing allocated, nothing to spill; and the budget of a device nobody uses is not asked for
  // (on CUDA that would create a context on it).
  const size_t allocated = AllocatedBytes(device);
  if (allocated + incoming_bytes == 0) return;
  const size_t budget = budget_bytes(device);
  if (allocated + incoming_bytes <= budget) return;
  const size_t target = budget - budget / 16;
  const size_t goal = target > incoming_bytes ? target - incoming_bytes : 0;
  // Prefetches nobody read yet go first: their host copies are still there, so one costs no copy
  // now (a reload later, if backward gets to it), where a spill costs one each way. Without this,
  // backward's own allocations landed on top of the prefetches and passed the budget.
  const size_t given_back = GiveBackPrefetches(device, goal);
  // What backward needed was that room: an adaptive prefetch leaves it from now on, rather than
  // refill it at the next read and give it back again at the next allocation (a copy each way
  // for nothing; seen as more bytes reloaded than spilled).
  // (Only then is the device's context asked for: on CUDA, making one makes streams there.)
  if (given_back > 0) Device(device).prefetch_room_taken += given_back;
  if (AllocatedBytes(device) > goal) SpillOldest(device, goal, false);
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
    case SpillOutcome::kSpilled:
      pass.released += result.block_bytes;
      break;
    case SpillOutcome::kNoHostMemory:
      pass.no_host_from = e.nbytes;
      pass.no_host_reason = e.skipped_for;
      break;
    case SpillOutcome::kRefused:
      break;
  }
}

size_t OffloadEngine::SpillOldest(int device, size_t target_allocated, bool include_window) {
  SpillPass pass;
  const auto spill = [&](Entry& e) { SpillInPass(e, pass); };
  if (include_window) {
    // The rescue (an allocation would fail otherwise): any eligible entry, oldest first, the
    // ones a policy would keep included. Rare enough to visit every entry.
    for (auto& [seq, entry] : by_seq_) {
      if (AllocatedBytes(device) <= target_allocated) break;
      if (entry->device != device) continue;
      // A reload that finished while nobody looked (its saves outlive backward: retain_graph)
      // is resident, and may go again.
      Refresh(*entry);
      if (Eligible(*entry)) spill(*entry);
    }
    return pass.released;
  }
  // The newest entries (up to the prefetch window) are needed first in backward: keep them.
  const Window& w = windows_[static_cast<size_t>(device)];
  const uint64_t window_start = w.start == Window::kEmpty ? next_seq_ : w.start;
  VisitSpillCandidates(window_start, [&](Entry& e) {
    if (AllocatedBytes(device) <= target_allocated) return false;
    if (e.device == device && Eligible(e)) spill(e);
    return true;
  });
  return pass.released;
}

size_t OffloadEngine::ReleaseMemory(int device, size_t bytes) {
  EngineLock lock(mutex_);
  if (device < 0 || device >= static_cast<int>(devices_.size())) return 0;
  // Inside a policy step the allocation is a prefetch's (nothing else there allocates device
  // memory): a guess, which stops when memory runs out rather than push other saves out.
  if (in_policy_) return 0;
  // The ladder that calls this may have heard of a copy's failure: settle it before any spill
  // below is issued, or it would fail those too once heard.
  TakeHeardFailures(device);
  const size_t allocated = AllocatedBytes(device);
  const size_t target = allocated > bytes ? allocated - bytes : 0;
  size_t released = 0;
  {
    PolicyScope scope(in_policy_);
    // First what costs nothing now (prefetches nobody used yet: their host copies are still
    // there), then spills, oldest saves first. Under "off" nothing is spilled, but prefetches of
    // saves an inner block spilled still go back.
    released = GiveBackPrefetches(device, target);
    if (config_.policy != OffloadPolicy::kOff && AllocatedBytes(device) > target) {
      released += SpillOldest(device, target, true);
    }
  }
  if (released > 0) {
    // The allocator retries right after this returns: the freed blocks must be reusable. Each
    // spill's own event is waited on first: a failed copy is reported once, to the first wait
    // that finds it, and must mark its entry failed rather than escape from the stream-wide wait
    // (leaving the entry to pass for spilled with bytes that never arrived).
    for (auto& [seq, entry] : by_seq_) {
      if (entry->device == device && entry->state == Residency::kSpilling) Refresh(*entry, true);
    }
    WaitCopyStream(device, Residency::kSpilling);
    for (auto& [seq, entry] : by_seq_) Refresh(*entry);
  }
  return released;
}

size_t OffloadEngine::GiveBackPrefetches(int device, size_t target_allocated) {
  // A prefetch nobody has used yet is a guess, and an allocation that fails otherwise comes first
  // (without this, prefetching made backward run out of memory where reloading at use fitted).
  // Until it is acquired the entry keeps its host copy (Refresh): once the copy to the device is
  // done, the device copy can go with no copy back. Oldest first: backward reads those last.
  size_t released = 0;
  for (auto& [seq, entry] : by_seq_) {
    if (AllocatedBytes(device) <= target_allocated) break;
    Entry& e = *entry;
    // (A prefetch keeps its host copy until it is acquired or fails, either of which ends it.)
    if (e.device != device || !e.prefetched || e.storage->external_holders() != 0) continue;
    // Waits for the copy (and the spill it read from, if it was still copying): a failure
    // found there fails the entry, which then is no prefetch any more.
    Refresh(e, /*wait=*/true);
    if (e.state != Residency::kResident || !e.prefetched) continue;
    const auto info = allocator_.Lookup(e.storage->data());
    // The copy is done and nothing else used the block: it may be reused at once.
    e.storage->drop_device_memory();
    e.state = Residency::kSpilled;
    EndPrefetch(e);
    ListOffloaded(e);
    CountSpilled(e, true);
    Note(OffloadEvent::Kind::kPrefetchGivenBack, e);
    released += info ? info->size : e.nbytes;
  }
  return released;
}

void OffloadEngine::OnPressure(int device, size_t incoming_bytes) {
  EngineLock lock(mutex_);
  if (in_policy_ || config_.policy != OffloadPolicy::kAuto) return;
  PolicyScope scope(in_policy_);
  TakeHeardFailures(device);
  SpillToBudget(device, incoming_bytes);
}

size_t OffloadEngine::AllocatedBytes(int device) const {
  return static_cast<size_t>(allocator_.stats(device).allocated_bytes.all().current);
}

size_t OffloadEngine::budget_bytes(int device) const {
  EngineLock lock(mutex_);
  if (config_.budget_bytes != 0) return config_.budget_bytes;
  // The limit, or the device where that is smaller (memory_limit_mb may name more than it has).
  const size_t total = allocator_.total_memory(device);
  const size_t limit = allocator_.memory_limit(device);
  const size_t base = limit == 0 ? total : std::min(limit, total);
  return static_cast<size_t>(config_.budget_fraction * static_cast<double>(base));
}

size_t OffloadEngine::spilled_bytes(int device) const {
  EngineLock lock(mutex_);
  if (device < 0 || static_cast<size_t>(device) >= spilled_by_device_.size()) {
    throw InvalidArgumentError(absl::StrFormat(
        "OffloadEngine::spilled_bytes: device %d is out of range: valid devices are 0..%d", device,
        spilled_by_device_.size() - 1));
  }
  return static_cast<size_t>(spilled_by_device_[static_cast<size_t>(device)]);
}

void OffloadEngine::CountSpilled(const Entry& e, bool spilled) {
  const auto bytes = static_cast<int64_t>(e.nbytes);
  if (spilled) {
    stats_.spilled_bytes.Increase(bytes);
  } else {
    stats_.spilled_bytes.Decrease(bytes);
  }
  int64_t& device_spilled = spilled_by_device_[static_cast<size_t>(e.device)];
  device_spilled += spilled ? bytes : -bytes;
  size_t& high = Device(e.device).spilled_high;
  high = std::max(high, static_cast<size_t>(device_spilled));
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
  EngineLock lock(mutex_);
  // Entries saved so far keep the minimum size of the block they were saved in (offload blocks
  // nest, and each one sets the configuration as it starts and ends).
  const bool new_window = config.prefetch_bytes != config_.prefetch_bytes;
  const bool new_host_limit = config.host_limit_bytes != config_.host_limit_bytes;
  config_ = config;
  // Pools made from now on take the limit from config_; those made already are told.
  if (new_host_limit) {
    for (const auto& dc : devices_) {
      if (dc != nullptr) PoolCall(dc->device, [&] { dc->pool.SetLimit(config_.host_limit_bytes); });
    }
  }
  if (new_window) {
    for (Window& w : windows_) {
      w.start = Window::kEmpty;
      w.bytes = 0;
      WindowExtend(w);
    }
  }
  UpdateWatermarks();
}

size_t OffloadEngine::WindowLimit() const {
  // Adaptive prefetch keeps nothing resident for backward: `auto` spills down to its budget, and
  // backward's first reads come back on demand (the reloads after them overlap).
  return config_.prefetch_bytes.value_or(0);
}

void OffloadEngine::WindowAdd(Entry& e) {
  Window& w = windows_[static_cast<size_t>(e.device)];
  w.sized[e.seq] = &e;
  // The newest entry joins the window; the oldest leave while it holds too much.
  if (w.start == Window::kEmpty) w.start = e.seq;
  w.bytes += e.nbytes;
  while (w.bytes > WindowLimit()) {
    auto oldest = w.sized.find(w.start);
    w.bytes -= oldest->second->nbytes;
    ++oldest;
    if (oldest == w.sized.end()) {
      w.start = Window::kEmpty;  // the newest alone is larger than the window
      w.bytes = 0;
      break;
    }
    w.start = oldest->first;
  }
}

void OffloadEngine::WindowRemove(const Entry& e) {
  Window& w = windows_[static_cast<size_t>(e.device)];
  if (w.sized.erase(e.seq) == 0) return;
  if (w.start != Window::kEmpty && e.seq >= w.start) {
    w.bytes -= e.nbytes;
    if (e.seq == w.start) {
      const auto next = w.sized.upper_bound(e.seq);
      w.start = next == w.sized.end() ? Window::kEmpty : next->first;
    }
  }
  WindowExtend(w);  // room freed inside, or the entry that did not fit is gone
}

void OffloadEngine::WindowExtend(Window& w) const {
  while (true) {
    auto it = w.start == Window::kEmpty ? w.sized.end() : w.sized.find(w.start);
    if (it == w.sized.begin()) return;
    --it;
    if (w.bytes + it->second->nbytes > WindowLimit()) return;
    w.bytes += it->second->nbytes;
    w.start = it->first;
  }
}

OffloadConfig OffloadEngine::config() const {
  EngineLock lock(mutex_);
  return config_;
}

}  // namespace spillway
