// DeviceAllocator's pending stream uses: a block freed after record_stream waits for one event
// per other stream that used it. Polled at malloc (ProcessEventsLocked), waited for on the host
// (SynchronizeAllEvents), or, under a soft limit, awaited one at a time until a request fits
// (AwaitPendingUntilFit: by the allocating stream where every access follows streams, else by
// the host). The allocation paths are in
// device_allocator.cc.
#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "allocator/device_allocator.h"
#include "allocator/errors.h"

namespace spillway {

void DeviceAllocator::AddPendingEvent(BlockId id) {
  ++arena_.mutable_extras(id).event_count;
  arena_[id].pending = true;
}

bool DeviceAllocator::EventDone(BlockId id) {
  if (--arena_.mutable_extras(id).event_count > 0) return false;
  arena_[id].pending = false;
  return true;
}

void DeviceAllocator::CompletePending(const Pending& done) {
  spare_events_.push_back(done.event);
  if (EventDone(done.block)) FreeBlock(done.block);
}

void DeviceAllocator::ProcessEvents() {
  std::lock_guard lock(mutex_);
  ProcessEventsLocked();
}

void DeviceAllocator::ProcessEventsLocked() {
  if (pending_.empty()) return;  // the common case: no backend call at all
  // One FIFO per stream, so a long-running stream does not hold up blocks used by others.
  for (auto it = pending_.begin(); it != pending_.end();) {
    std::deque<Pending>& queue = it->second;
    while (!queue.empty() && UseIsOver(it->first, queue.front().event, false)) {
      CompletePending(queue.front());
      queue.pop_front();
    }
    if (queue.empty()) {
      pending_.erase(it++);
    } else {
      ++it;
    }
  }
}

BlockId DeviceAllocator::AwaitPendingUntilFit(PoolKind kind, StreamRef stream, size_t rounded) {
  const std::optional<uint16_t> slot = streams_.Find(stream.id);
  if (!slot.has_value()) return kNoBlock;
  const bool on_stream = backend_.accesses_follow_streams();
  bool host_waited = false;
  BlockId found = kNoBlock;
  for (auto it = pending_.begin(); it != pending_.end() && found == kNoBlock;) {
    std::deque<Pending>& queue = it->second;
    // Oldest first: a copy stream runs its copies in order, so the front's copy is done first.
    for (auto entry = queue.begin(); entry != queue.end() && found == kNoBlock;) {
      // Only blocks of `stream`'s own pool: one of another stream's, freed now, could be reused
      // on that stream, which has not waited. And only of the request's pool kind: a block of the
      // other kind cannot serve it, and waiting for its copy would only delay `stream`.
      const Block& pending_block = arena_[entry->block];
      if (pending_block.stream != *slot || pending_block.pool != kind) {
        ++entry;
        continue;
      }
      // A use already over needs no wait; asking also reports a failed copy to the stream's owner
      // now, as event processing would.
      if (!UseIsOver(it->first, entry->event, /*wait=*/false)) {
        if (on_stream) {
          try {
            backend_.stream_wait_event(device_, stream.handle, entry->event);
          } catch (const BackendError&) {
            ++entry;  // stays pending: polled, or waited for on the host, as before
            continue;
          }
        } else {
          UseIsOver(it->first, entry->event, /*wait=*/true);
          host_waited = true;
        }
      }
      // The wait captured the event's work, so the event can be recorded again.
      CompletePending(*entry);
      entry = queue.erase(entry);
      // Stop as soon as the request fits: every further wait would hold `stream` (or the host)
      // back for a copy it does not need.
      found = FindFree(kind, stream, rounded);
    }
    if (queue.empty()) {
      pending_.erase(it++);
    } else {
      ++it;
    }
  }
  if (host_waited) ++stats_.num_sync_all_streams;
  return found;
}

bool DeviceAllocator::SynchronizeAllEvents() {
  const bool anything_pending = std::any_of(
      pending_.begin(), pending_.end(), [](const auto& entry) { return !entry.second.empty(); });
  if (!anything_pending) return false;
  ++stats_.num_sync_all_streams;
  for (auto& [stream, queue] : pending_) {
    while (!queue.empty()) {
      UseIsOver(stream, queue.front().event, true);
      CompletePending(queue.front());
      queue.pop_front();
    }
  }
  pending_.clear();
  return true;
}

bool DeviceAllocator::UseIsOver(uint64_t stream, EventHandle event, bool wait) {
  // A failure reported here may be earlier work's, reported once to whoever looks first: it goes
  // to the stream's owner. A wait reports after waiting, so the use is over then; a poll reports
  // before looking at the event, so it asks again (a few times: each report is another failure).
  constexpr int kMaxPolls = 4;
  for (int poll = 1;; ++poll) {
    try {
      if (wait) {
        backend_.synchronize_event(device_, event);
        return true;
      }
      return backend_.query_event(device_, event);
    } catch (const BackendError& error) {
      NoteStreamError(device_, stream, error);
      // Not an earlier copy's (CUDA's failures are sticky: nothing on the stream runs any more).
      if (wait || !error.earlier_work()) return true;
      if (poll == kMaxPolls) return false;  // failures still coming: the next poll looks again
    }
  }
}

void DeviceAllocator::NoteStreamError(int device, uint64_t stream, const BackendError& error) {
  failures_.OnStreamFailure(device, stream, error);
}

void DeviceAllocator::AwaitReports() const {
  // Every call that took a failure from the backend reports it before it lets the mutex go.
  const std::lock_guard lock(mutex_);
}

EventHandle DeviceAllocator::TakeEvent() {
  if (spare_events_.empty()) return backend_.create_event(device_);
  EventHandle event = spare_events_.back();
  spare_events_.pop_back();
  return event;
}

}  // namespace spillway
