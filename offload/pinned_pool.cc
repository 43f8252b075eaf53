#include "offload/pinned_pool.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <iterator>
#include <utility>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"
#include "allocator/format.h"

namespace spillway {
namespace {

size_t RoundUp(size_t bytes) {
  return (bytes + PinnedPool::kGranule - 1) / PinnedPool::kGranule * PinnedPool::kGranule;
}

// The smallest remainder worth keeping as its own free block. Below it the remainder stays with
// the buffer: tiny fragments would only clutter the free index, and the 1/64 bound keeps that
// slack proportional to the buffer (the waste guarantee in the header).
size_t SplitThreshold(size_t rounded) { return std::max(PinnedPool::kGranule, rounded / 64); }

// Whether the last use on `stream_id` that `event` follows is over; an earlier failure reported
// there is that stream's work's (a failure of the query itself, or a sticky one, names nothing).
bool PollEvent(UniqueEvent& event, uint64_t stream_id) {
  try {
    return event.query();
  } catch (const BackendError& error) {
    if (!error.earlier_work()) throw;
    throw PinnedPool::StreamFailure(error, stream_id);
  }
}

size_t CheckedGrowBytes(size_t grow_bytes) {
  if (grow_bytes > PinnedPool::kMaxBytes) {
    throw InvalidArgumentError(
        absl::StrFormat("Spillway pinned pool: grow_bytes %d exceeds the maximum of %d bytes",
                        grow_bytes, PinnedPool::kMaxBytes));
  }
  return RoundUp(grow_bytes);
}

void CheckRequest(size_t bytes) {
  if (bytes == 0 || bytes > PinnedPool::kMaxBytes) {
    throw InvalidArgumentError(absl::StrFormat(
        "Spillway pinned pool: cannot allocate %d bytes: the size must be in [1, %d]", bytes,
        PinnedPool::kMaxBytes));
  }
}

}  // namespace

const char* PinnedPool::StateName(State state) {
  switch (state) {
    case State::kFree:
      return "free";
    case State::kAllocated:
      return "allocated";
    case State::kPending:
      return "freed (awaiting its last use)";
  }
  return "unknown";  // only reachable through a corrupted value
}

PinnedPool::PinnedPool(Backend& backend, int device, Options options)
    : backend_(backend),
      device_(device),
      grow_bytes_(CheckedGrowBytes(options.grow_bytes)),
      limit_bytes_(options.limit_bytes) {}

PinnedPool::~PinnedPool() {
  // Copies into or out of pooled buffers may still be running, and the memory must outlive
  // them. Destroying the events and freeing the chunks is left to the members' own destructors.
  std::lock_guard lock(mu_);
  for (auto& [stream, queue] : pending_) {
    for (Pending& pending : queue) {
      try {
        pending.event.synchronize();
      } catch (const std::exception& e) {
        // A destructor cannot report it; the backend is broken and its next checked call says so.
        std::fprintf(stderr, "spillway: pinned pool: waiting for a pending buffer failed: %s\n",
                     e.what());
      }
    }
  }
}

absl::StatusOr<void*> PinnedPool::Allocate(size_t bytes) {
  CheckRequest(bytes);
  const size_t rounded = RoundUp(bytes);
  std::lock_guard lock(mu_);
  ProcessEventsLocked();
  std::optional<uintptr_t> block = TakeBestFitLocked(rounded);
  if (!block.has_value()) {
    absl::StatusOr<uintptr_t> chunk = GrowLocked(bytes, rounded);
    if (!chunk.ok()) return chunk.status();
    block = *chunk;
  }
  return UseBlockLocked(*block, rounded);
}

void PinnedPool::Free(void* ptr, std::optional<StreamRef> last_use) {
  std::lock_guard lock(mu_);
  const size_t size = LiveBlockLocked(ptr).size;  // throws for anything but a live buffer
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  TraceLocked(TraceAction::kFreeRequested, address, size);
  if (!last_use.has_value()) {
    ReleaseLocked(address);
    return;
  }
  // Quarantined from here on: only a completed event or host wait makes it reusable.
  blocks_.at(address).state = State::kPending;
  if (DeferLocked(address, *last_use)) return;
  // No event could be recorded: a host wait is the only other way to know the last use is over.
  // If the wait fails itself, the buffer stays quarantined rather than risk handing it out
  // mid-copy. A failure of earlier work it reports comes after the wait: the stream has drained,
  // and the buffer is free to go back.
  try {
    backend_.synchronize_stream(device_, last_use->handle);
  } catch (const BackendError& error) {
    deferred_error_.reset();
    if (!error.earlier_work()) throw;  // the wait's own failure names no stream's work
    ReleaseLocked(address);
    throw StreamFailure(error, last_use->id);
  }
  ReleaseLocked(address);
  // A record fails when earlier work on the stream failed (reported once, to whoever looks):
  // the buffer is safe to reuse now, and the caller, who owns that work, must hear of it.
  if (deferred_error_.has_value()) {
    const BackendError error = *std::exchange(deferred_error_, std::nullopt);
    throw StreamFailure(error, last_use->id);
  }
}

void PinnedPool::Trim() {
  std::lock_guard lock(mu_);
  TrimLocked();
}

void PinnedPool::SetLimit(size_t limit_bytes) {
  std::lock_guard lock(mu_);
  limit_bytes_ = limit_bytes;
  if (limit_bytes_ != 0 && reserved_ > limit_bytes_) TrimLocked();
}

size_t PinnedPool::reserved_bytes() const {
  std::lock_guard lock(mu_);
  return reserved_;
}

size_t PinnedPool::in_use_bytes() const {
  std::lock_guard lock(mu_);
  return in_use_;
}

size_t PinnedPool::peak_reserved_bytes() const {
  std::lock_guard lock(mu_);
  return peak_reserved_;
}

size_t PinnedPool::buffer_size(const void* ptr) const {
  std::lock_guard lock(mu_);
  return LiveBlockLocked(ptr).size;
}

int64_t PinnedPool::num_backend_allocs() const {
  std::lock_guard lock(mu_);
  return num_backend_allocs_;
}

void PinnedPool::RecordHistory(bool enabled, size_t max_entries) {
  std::lock_guard lock(mu_);
  if (enabled) {
    history_.Enable(max_entries);
  } else {
    history_.Disable();
    history_.Clear();
  }
}

bool PinnedPool::history_enabled() const {
  std::lock_guard lock(mu_);
  return history_.enabled();
}

std::vector<TraceEntry> PinnedPool::history() const {
  std::lock_guard lock(mu_);
  return history_.Entries();
}

std::vector<SegmentSnapshot> PinnedPool::Chunks() const {
  std::lock_guard lock(mu_);
  std::vector<SegmentSnapshot> out;
  out.reserve(chunks_.size());
  for (const auto& [base, buffer] : chunks_) {
    SegmentSnapshot segment;
    segment.device = -1;
    segment.address = base;
    segment.total_size = buffer.size();
    segment.requested_size = buffer.size();
    // The blocks of a chunk tile it in address order, starting at its base.
    for (auto it = blocks_.find(base); it != blocks_.end() && it->second.chunk == base; ++it) {
      const auto& [address, block] = *it;
      BlockSnapshot b;
      b.address = address;
      b.size = block.size;
      b.requested_size = block.size;
      switch (block.state) {
        case State::kFree:
          b.state = BlockState::kInactive;
          break;
        case State::kAllocated:
          b.state = BlockState::kActiveAllocated;
          segment.allocated_size += block.size;
          segment.active_size += block.size;
          break;
        case State::kPending:
          b.state = BlockState::kActivePendingFree;
          segment.active_size += block.size;
          break;
      }
      segment.blocks.push_back(std::move(b));
    }
    out.push_back(std::move(segment));
  }
  // chunks_ is a hash map: address order, as the allocator's segments come.
  std::sort(out.begin(), out.end(), [](const SegmentSnapshot& a, const SegmentSnapshot& b) {
    return a.address < b.address;
  });
  return out;
}

void PinnedPool::RecordLocked(TraceAction action, uintptr_t address, size_t size) {
  TraceEntry entry;
  entry.action = action;
  entry.device = -1;  // host memory, as PyTorch's host allocator records it
  entry.addr = address;
  entry.size = size;
  entry.time_us = NowMicros();  // the allocator's clock: host and device entries line up
  history_.Record(std::move(entry));
}

void PinnedPool::ProcessEventsLocked() {
  if (pending_.empty()) return;  // the common case: no backend call at all
  for (auto it = pending_.begin(); it != pending_.end();) {
    std::deque<Pending>& queue = it->second;
    while (!queue.empty() && PollEvent(queue.front().event, it->first)) {
      Pending done = std::move(queue.front());
      queue.pop_front();
      ReleaseLocked(done.ptr);
      spare_events_.push_back(std::move(done.event));
    }
    if (queue.empty()) {
      pending_.erase(it++);
    } else {
      ++it;
    }
  }
}

std::optional<uintptr_t> PinnedPool::TakeBestFitLocked(size_t rounded) {
  const auto it = free_.lower_bound(FreeKey{rounded, 0});
  if (it == free_.end()) return std::nullopt;
  const uintptr_t ptr = it->second;
  free_.erase(it);
  return ptr;
}

absl::StatusOr<uintptr_t> PinnedPool::GrowLocked(size_t bytes, size_t rounded) {
  // Cached free chunks count against the limit; returning them is the only way to make room.
  if (!FitsLimitLocked(rounded)) TrimLocked();
  if (!FitsLimitLocked(rounded)) return LimitErrorLocked(bytes, rounded);
  // A large chunk spreads the cost of pinning over many buffers, but not at the price of failing
  // a request that an exact-size chunk would satisfy.
  const size_t preferred = std::max(rounded, grow_bytes_);
  absl::StatusOr<UniqueHostBuffer> buffer =
      HostMallocLocked(FitsLimitLocked(preferred) ? preferred : rounded, rounded);
  if (!buffer.ok()) {
    return absl::UnavailableError(absl::StrFormat(
        "Spillway pinned pool: the backend could not provide %s of pinned memory for a request of "
        "%d bytes (%s reserved by the pool): %s",
        FormatBytes(rounded), bytes, FormatBytes(reserved_), buffer.status().message()));
  }
  return AddChunkLocked(*std::move(buffer));
}

absl::StatusOr<UniqueHostBuffer> PinnedPool::HostMallocLocked(size_t preferred, size_t rounded) {
  absl::StatusOr<UniqueHostBuffer> buffer = UniqueHostBuffer::Allocate(backend_, preferred);
  if (!buffer.ok() && preferred > rounded) {
    buffer = UniqueHostBuffer::Allocate(backend_, rounded);
  }
  // The backend's pinned memory may be short because this pool caches free chunks that are too
  // small for the request: return them and try once more.
  if (!buffer.ok() && TrimLocked() > 0) buffer = UniqueHostBuffer::Allocate(backend_, rounded);
  return buffer;
}

uintptr_t PinnedPool::AddChunkLocked(UniqueHostBuffer buffer) {
  const auto base = reinterpret_cast<uintptr_t>(buffer.data());
  const size_t size = buffer.size();
  chunks_.emplace(base, std::move(buffer));
  blocks_.emplace(base, Block{size, base, State::kFree});
  reserved_ += size;
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  ++num_backend_allocs_;
  TraceLocked(TraceAction::kSegmentAlloc, base, size);
  return base;
}

void* PinnedPool::UseBlockLocked(uintptr_t ptr, size_t rounded) {
  Block& block = blocks_.at(ptr);
  block.state = State::kAllocated;
  const uintptr_t chunk = block.chunk;
  const size_t remainder = block.size - rounded;
  const bool split = remainder >= SplitThreshold(rounded);
  // The buffer keeps the front; the remainder becomes a free block of its own.
  if (split) block.size = rounded;
  in_use_ += block.size;
  TraceLocked(TraceAction::kAlloc, ptr, block.size);
  if (split) InsertFreeLocked(ptr + rounded, remainder, chunk);  // last: it invalidates `block`
  return reinterpret_cast<void*>(ptr);
}

bool PinnedPool::DeferLocked(uintptr_t ptr, StreamRef last_use) {
  std::optional<UniqueEvent> event;
  try {
    event.emplace(TakeEventLocked());
    event->record(last_use.handle);
  } catch (const BackendError& error) {
    if (event.has_value()) spare_events_.push_back(std::move(*event));  // still a usable event
    if (error.earlier_work()) deferred_error_ = error;
    return false;
  }
  pending_[last_use.id].push_back(Pending{std::move(*event), ptr});
  return true;
}

UniqueEvent PinnedPool::TakeEventLocked() {
  if (spare_events_.empty()) return UniqueEvent(backend_, device_);
  UniqueEvent event = std::move(spare_events_.back());
  spare_events_.pop_back();
  return event;
}

void PinnedPool::ReleaseLocked(uintptr_t ptr) {
  const Block block = blocks_.at(ptr);
  in_use_ -= block.size;
  TraceLocked(TraceAction::kFreeCompleted, ptr, block.size);  // the buffer's, before it coalesces
  blocks_.erase(ptr);
  uintptr_t start = ptr;
  size_t size = block.size;
  // Absorb a free next neighbour. The address check alone is not enough: two chunks can be
  // adjacent in memory, and each chunk goes back to the backend whole.
  if (const auto next = blocks_.find(ptr + size); next != blocks_.end() &&
                                                  next->second.chunk == block.chunk &&
                                                  next->second.state == State::kFree) {
    size += next->second.size;
    EraseFreeLocked(next->first);
  }
  // The blocks of a chunk tile it, so unless this one starts the chunk, the block just below it
  // is its previous neighbour in the same chunk.
  if (start != block.chunk) {
    const auto prev = std::prev(blocks_.lower_bound(start));
    if (prev->second.state == State::kFree) {
      start = prev->first;
      size += prev->second.size;
      EraseFreeLocked(start);
    }
  }
  InsertFreeLocked(start, size, block.chunk);
}

void PinnedPool::InsertFreeLocked(uintptr_t ptr, size_t size, uintptr_t chunk) {
  blocks_.emplace(ptr, Block{size, chunk, State::kFree});
  free_.insert(FreeKey{size, ptr});
}

void PinnedPool::EraseFreeLocked(uintptr_t ptr) {
  const auto it = blocks_.find(ptr);
  free_.erase(FreeKey{it->second.size, ptr});
  blocks_.erase(it);
}

size_t PinnedPool::TrimLocked() {
  ProcessEventsLocked();
  std::vector<uintptr_t> idle;
  for (const auto& [base, buffer] : chunks_) {
    const Block& head = blocks_.at(base);
    if (head.state == State::kFree && head.size == buffer.size()) idle.push_back(base);
  }
  size_t released = 0;
  for (const uintptr_t base : idle) {
    const size_t size = blocks_.at(base).size;
    EraseFreeLocked(base);
    chunks_.erase(base);  // UniqueHostBuffer hands the memory back
    reserved_ -= size;
    released += size;
    TraceLocked(TraceAction::kSegmentFree, base, size);
  }
  return released;
}

bool PinnedPool::FitsLimitLocked(size_t chunk_bytes) const {
  return limit_bytes_ == 0 ||
         (chunk_bytes <= limit_bytes_ && reserved_ <= limit_bytes_ - chunk_bytes);
}

absl::Status PinnedPool::LimitErrorLocked(size_t bytes, size_t rounded) const {
  return absl::ResourceExhaustedError(absl::StrFormat(
      "Spillway pinned pool: cannot allocate %d bytes (%s, rounded to %s): %s of pinned memory "
      "reserved (%s in use) and the limit is %s",
      bytes, FormatBytes(bytes), FormatBytes(rounded), FormatBytes(reserved_), FormatBytes(in_use_),
      FormatBytes(limit_bytes_)));
}

const PinnedPool::Block& PinnedPool::LiveBlockLocked(const void* ptr) const {
  const auto it = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == blocks_.end() || it->second.state != State::kAllocated) {
    throw InvalidArgumentError(DescribeNonLiveLocked(ptr));
  }
  return it->second;
}

std::string PinnedPool::DescribeNonLiveLocked(const void* ptr) const {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  auto it = blocks_.upper_bound(address);
  if (it != blocks_.begin()) {
    --it;
    const auto& [start, block] = *it;
    if (address == start) {
      return absl::StrFormat(
          "Spillway pinned pool: %p was already freed (double free, or a pointer used after Free)",
          ptr);
    }
    if (address - start < block.size) {
      return absl::StrFormat(
          "Spillway pinned pool: %p points %d bytes into the %s block at %#x; pass the pointer "
          "Allocate returned",
          ptr, address - start, StateName(block.state), start);
    }
  }
  return absl::StrFormat("Spillway pinned pool: %p is not a buffer of this pool", ptr);
}

}  // namespace spillway
