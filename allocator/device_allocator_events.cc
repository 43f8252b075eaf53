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

#include "absl/container/inlined_vector.h"
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

uint64_t DeviceAllocator::TagForRevival(const void* ptr) {
  std::lock_guard lock(mutex_);
  const BlockId id = allocated_.Find(reinterpret_cast<uintptr_t>(ptr), AddressOf());
  if (id == kNoBlock) return 0;
  arena_.mutable_extras(id).revive_tag = ++revive_tags_;
  return revive_tags_;
}

bool DeviceAllocator::Revive(void* ptr, uint64_t tag, TraceContext context) {
  std::lock_guard lock(mutex_);
  if (tag == 0) return false;
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  // A pending block keeps its address and size (nothing merges with it until it is freed), and
  // its events are in the queues of the streams that used it: a scan of what is pending, which
  // only a take-back pays for. Another allocation's block may be pending at the same address
  // (this one's free completed early, its memory was reused and freed again): the tag says which.
  BlockId id = kNoBlock;
  int32_t queued = 0;
  for (const auto& [stream, queue] : pending_) {
    for (const Pending& entry : queue) {
      if (arena_[entry.block].ptr != address) continue;
      if (arena_.mutable_extras(entry.block).revive_tag != tag) return false;
      id = entry.block;
      ++queued;
    }
  }
  if (id == kNoBlock) return false;
  // More events counted than queued: quarantined (see Free), never to be reused, nor taken back.
  if (arena_[id].allocated || arena_.mutable_extras(id).event_count != queued) return false;
  absl::InlinedVector<StreamRef, 1> uses;
  for (auto it = pending_.begin(); it != pending_.end();) {
    std::deque<Pending>& queue = it->second;
    for (auto entry = queue.begin(); entry != queue.end();) {
      if (entry->block != id) {
        ++entry;
        continue;
      }
      // The work the event stands for is awaited again by the block's next free, which records
      // a new event on the same stream: this one can be recorded again.
      uses.push_back(StreamRef{entry->use, it->first});
      spare_events_.push_back(entry->event);
      entry = queue.erase(entry);
    }
    if (queue.empty()) {
      pending_.erase(it++);
    } else {
      ++it;
    }
  }
  BlockExtras& extras = arena_.mutable_extras(id);
  extras.event_count = 0;
  extras.revive_tag = 0;  // taken back once: the owner tags it again should it spill again
  extras.stream_uses = std::move(uses);
  Block& block = arena_[id];
  block.pending = false;
  // To the history the free completed and the same memory was allocated again: PyTorch's viewer
  // replays the trace with no other kind of entry.
  TraceBlock(TraceAction::kFreeCompleted, id, nullptr);
  extras.context.reset();
  extras.category = TraceCategory::kUnknown;
  block.allocated = true;
  if (context != nullptr) extras.context = context;
  allocated_.Insert(block.ptr, id);
  // As Malloc counts an allocation; `active` and `requested` never stopped counting it (a
  // pending free is active until it completes).
  const auto bytes = static_cast<int64_t>(block.size());
  stats_.allocation.Increase(block.pool, 1);
  stats_.allocated_bytes.Increase(block.pool, bytes);
  if (policy_.IsOversize(block.size())) stats_.oversize_allocations.Increase(1);
  TraceBlock(TraceAction::kAlloc, id, std::move(context));
  return true;
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
