// OffloadEngine: copy failures. A backend reports a failed asynchronous copy once, to the first
// call that looks at its stream, which need not be the call for the copy that failed: these
// settle which entries lose their bytes, and keep the program's own failures apart.
#include <optional>
#include <string>

#include "allocator/errors.h"
#include "offload/engine.h"
#include "offload/engine_internal.h"

namespace spillway {

void OffloadEngine::MarkFailed(Entry& e, const std::string& why) {
  // The device copy is gone (spilling), or the bytes never arrived (reloading).
  if (e.state == Residency::kSpilling) {
    CountSpilled(e, false);
    Note(OffloadEvent::Kind::kFailed, e);
  }
  // No longer a prefetch: its bytes must not hold back further prefetches, nor its entry pass
  // for one (it is never acquired, so Acquire would not clear it).
  EndPrefetch(e);
  if (e.spill_done != nullptr) {
    copies_.Spare(e.device, e.spill_done);  // nothing waits on it any more
    e.spill_done = nullptr;
  }
  e.failed_while = e.state;
  e.state = Residency::kFailed;
  e.failure = why;
}

void OffloadEngine::FailInFlight(int device, Residency in_flight, const std::string& why,
                                 std::optional<uint64_t> found_seq) {
  // A backend reports a failed asynchronous copy to whoever looks first, not necessarily for
  // the copy that failed. Any copy in flight in that direction may be the one: none of their
  // bytes can be trusted, and an error at use beats silently wrong data. Only a copy enqueued
  // after the failure was found cannot be it (the allocator found it while this engine was
  // issuing that copy, and passed it on after).
  const auto enqueued_before_found = [&](uint64_t errors_found_before) {
    return !found_seq.has_value() || errors_found_before < *found_seq;
  };
  for (const auto& [seq, entry] : table_.InSaveOrder()) {
    if (entry->device != device) continue;
    // A reload issued while its spill was still copying reads what that spill wrote.
    const bool reads_a_spill =
        in_flight == Residency::kSpilling && entry->state == Residency::kReloading &&
        entry->spill_done != nullptr && enqueued_before_found(entry->errors_found_before_spill);
    const bool its_copy =
        entry->state == in_flight && enqueued_before_found(entry->errors_found_before_copy);
    if (its_copy || reads_a_spill) MarkFailed(*entry, why);
  }
}

void OffloadEngine::OnStreamError(const StreamError& error) {
  // Heard in an allocator call the engine made under its lock (a free, a wait, TakeHeardFailures)
  // on this thread: acted on under that hold, at once, as the call that found it returns.
  if (engine_lock_holder == this) {
    ActOnStreamError(error);
    return;
  }
  EngineLock lock(mutex_, this);
  ActOnStreamError(error);
}

void OffloadEngine::ActOnStreamError(const StreamError& error) {
  // Told again by a thread that was delivering it while this engine took it (TakeHeardFailures):
  // the copies in flight now came after it.
  if (error.seq <= stream_errors_acted_on_[error.found_by]) return;
  // A failure on another stream is the program's own (or a stream no copy of the engine's ran
  // on, or a device the engine never copied on): no entry's.
  if (const auto direction = copies_.DirectionOf(error.device, error.stream)) {
    // Copies record the count of the allocator of their own device: another's numbers say
    // nothing of them.
    const std::optional<uint64_t> found_seq =
        error.found_by == error.device ? std::optional<uint64_t>(error.seq) : std::nullopt;
    FailInFlight(error.device, *direction, error.message, found_seq);
  }
  // Only now: should the above throw, the error is told again (it stays pending) and acted on.
  stream_errors_acted_on_[error.found_by] = error.seq;
}

bool OffloadEngine::CopyDone(Entry& e, EventHandle copy, Residency direction, bool wait) {
  try {
    if (!wait && !backend_.query_event(e.device, copy)) return false;
    if (wait) backend_.synchronize_event(e.device, copy);
  } catch (const BackendError& error) {
    FailInFlight(e.device, direction, error.what());
    return false;
  }
  // The allocator may have heard of this copy's failure first (its event for a block a spill
  // gave back) and not passed it on yet: inside its out-of-memory ladder, which asks the engine
  // for memory before it returns. Heard of here, the failure marks the entry failed.
  TakeHeardFailures(e.device);
  return e.state != Residency::kFailed;
}

void OffloadEngine::TakeHeardFailures(int device) {
  // OnStreamError, called back on this thread, which holds the engine's lock. Those another
  // thread has found and waits for this lock to pass on are among them.
  allocator_.DeliverStreamErrors(device);
}

}  // namespace spillway
