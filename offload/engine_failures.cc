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
    Device(e.device).spare.push_back(e.spill_done);  // nothing waits on it any more
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
  for (auto& [seq, entry] : by_seq_) {
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

std::optional<Residency> OffloadEngine::CopyDirectionOf(int device, uint64_t stream_id) {
  const DeviceContext& dc = Device(device);
  if (stream_id == dc.d2h.id) return Residency::kSpilling;
  if (stream_id == dc.h2d.id) return Residency::kReloading;
  return std::nullopt;
}

void OffloadEngine::OnStreamError(const StreamError& error) {
  EngineLock lock(mutex_);
  // Told again by a thread that was delivering it while this engine took it (TakeHeardFailures):
  // the copies in flight now came after it.
  if (error.seq <= stream_errors_acted_on_[error.found_by]) return;
  const bool known_device = error.device >= 0 && error.device < static_cast<int>(devices_.size()) &&
                            devices_[static_cast<size_t>(error.device)] != nullptr;
  if (known_device) {
    // A failure on another stream is the program's own (or a stream no copy of the engine's
    // ran on): no entry's.
    if (const auto direction = CopyDirectionOf(error.device, error.stream)) {
      // Copies record the count of the allocator of their own device: another's numbers say
      // nothing of them.
      const std::optional<uint64_t> found_seq =
          error.found_by == error.device ? std::optional<uint64_t>(error.seq) : std::nullopt;
      FailInFlight(error.device, *direction, error.message, found_seq);
    }
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
  // OnStreamError, called back on this thread (the engine's lock is recursive). Those another
  // thread has found and waits for this lock to pass on are among them.
  allocator_.DeliverStreamErrors(device);
}

uint64_t OffloadEngine::IssueCopy(int device, Residency direction, absl::FunctionRef<void()> copy,
                                  absl::FunctionRef<void()> record) {
  // A copy that failed earlier on the stream is reported (once) to whichever call comes next,
  // and that call has no effect. The failure belongs to the copies in flight there (which one is
  // not known): they fail, every time one is heard of, and what did not take effect is issued
  // again. Heard of at the record, it may be this very copy's: the copy is made again too (its
  // source is still intact). A few rounds at most: each one settles a failure of its own.
  constexpr int kMaxRounds = 4;
  bool copied = false;
  uint64_t errors_found_before = 0;
  for (int round = 1;; ++round) {
    try {
      if (!copied) {
        // Read first: a failure found between this read and the copy is blamed on it too
        // (wrongly, but safely); read after, one of the copy's own could pass unblamed.
        errors_found_before = allocator_.StreamErrorsFound(device);
        copy();
      }
      copied = true;
      record();
      return errors_found_before;
    } catch (const BackendError& error) {
      if (!error.earlier_work()) throw;
      FailInFlight(device, direction, error.what());
      if (round == kMaxRounds) throw;
      copied = false;
    }
  }
}

void OffloadEngine::WaitCopyStream(int device, Residency direction) {
  const DeviceContext& dc = Device(device);
  const StreamRef stream = direction == Residency::kSpilling ? dc.d2h : dc.h2d;
  try {
    backend_.synchronize_stream(device, stream.handle);
  } catch (const BackendError& error) {
    FailInFlight(device, direction, error.what());
  }
}

bool OffloadEngine::PoolCall(int device, absl::FunctionRef<void()> call) {
  try {
    call();
    return true;
  } catch (const BackendError& error) {
    // The pool polls and records events on both copy streams. A failure it heard on one of them
    // (StreamFailure) is that stream's copies'; any other may be either direction's.
    const auto* heard_on = dynamic_cast<const PinnedPool::StreamFailure*>(&error);
    const std::optional<Residency> direction =
        heard_on != nullptr ? CopyDirectionOf(device, heard_on->stream_id()) : std::nullopt;
    if (direction != Residency::kReloading)
      FailInFlight(device, Residency::kSpilling, error.what());
    if (direction != Residency::kSpilling)
      FailInFlight(device, Residency::kReloading, error.what());
    return false;
  }
}

void OffloadEngine::RecordOnProgramStream(int device, EventHandle event, StreamRef stream) {
  try {
    backend_.record_event(device, event, stream.handle);
  } catch (const BackendError& error) {
    if (error.earlier_work()) throw ProgramStreamError(error);
    throw;
  }
}

}  // namespace spillway
