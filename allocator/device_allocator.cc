#include "allocator/device_allocator.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"
#include "allocator/format.h"

namespace spillway {

DeviceAllocator::DeviceAllocator(Backend& backend, int device, const AllocatorConfig& config,
                                 FreeMemoryCallbacksFn callbacks, StreamFailureSink& failures)
    : DeviceAllocator(backend, device, SizePolicy(config), config, std::move(callbacks), failures) {
}

DeviceAllocator::DeviceAllocator(Backend& backend, int device, SizePolicy policy,
                                 const AllocatorConfig& config, FreeMemoryCallbacksFn callbacks,
                                 StreamFailureSink& failures)
    : backend_(backend),
      device_(device),
      policy_(policy),
      gc_threshold_(config.garbage_collection_threshold),
      callbacks_(std::move(callbacks)),
      failures_(failures),
      // The configuration's 0 means "not set" (its key accepts (0, 1] only).
      memory_fraction_(config.per_process_memory_fraction > 0.0
                           ? std::optional(config.per_process_memory_fraction)
                           : std::nullopt),
      memory_limit_bytes_(config.memory_limit_bytes) {
  // Not ComputeLimit() now: a fraction needs the device total, which on CUDA creates a context,
  // and a process using one GPU of eight (one rank per GPU) must not get one on each.
  limit_ = memory_limit_bytes_;
  limit_resolved_ = !memory_fraction_.has_value();
}

DeviceAllocator::~DeviceAllocator() {
  // The owner is going away: wait for outstanding stream uses, then hand every segment and event
  // back, allocated or not. Each step on its own: a failure one of them hears of (an earlier
  // copy's) must not keep the rest from running, for the backend is shared and may live on.
  // Errors are swallowed: a destructor cannot report them.
  const auto quietly = [](auto&& step) {
    try {
      step();
    } catch (const std::exception&) {
    }
  };
  std::lock_guard lock(mutex_);
  for (auto& [stream, queue] : pending_) {
    for (const Pending& p : queue) {
      quietly([&] { backend_.synchronize_event(device_, p.event); });
      quietly([&] { backend_.destroy_event(device_, p.event); });
    }
  }
  pending_.clear();
  for (const auto& segment : segments_) {
    void* const base = reinterpret_cast<void*>(segment.first);
    quietly([&] { backend_.device_free(device_, base); });
  }
  for (EventHandle e : spare_events_) quietly([&] { backend_.destroy_event(device_, e); });
}

void DeviceAllocator::SetSoftLimit(size_t bytes) {
  std::lock_guard lock(mutex_);
  soft_limit_fraction_ = 0.0;
  soft_limit_.store(bytes, std::memory_order_relaxed);
}

void DeviceAllocator::SetSoftLimitFraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    throw InvalidArgumentError(absl::StrFormat(
        "soft limit fraction %g for device %d is out of range: expected a value in (0, 1]",
        fraction, device_));
  }
  std::lock_guard lock(mutex_);
  soft_limit_fraction_ = fraction;
  ResolveSoftLimit();
}

void DeviceAllocator::ResolveSoftLimit() {
  if (soft_limit_fraction_ == 0.0) return;
  // Until the device reserves memory nothing is allocated on it, so nothing passes the level.
  if (segments_.empty()) {
    soft_limit_.store(std::numeric_limits<size_t>::max(), std::memory_order_relaxed);
    return;
  }
  // A limit beyond the device (memory_limit_mb larger than it) is no base for a fraction.
  const size_t base = Limit() == 0 ? TotalMemory() : std::min(Limit(), TotalMemory());
  soft_limit_.store(static_cast<size_t>(soft_limit_fraction_ * static_cast<double>(base)),
                    std::memory_order_relaxed);
}

size_t DeviceAllocator::TotalMemory() const {
  // Asked once, and only where needed (a fraction set, a soft limit fraction once the device
  // holds memory, the offload budget of a device in use): on CUDA the query creates the device's
  // context, and a process that never uses a device (one rank per GPU) must not get one on it.
  if (total_memory_ == 0) total_memory_ = backend_.mem_info(device_).total_bytes;
  return total_memory_;
}

size_t DeviceAllocator::Limit() const {
  if (!limit_resolved_) {
    limit_ = ComputeLimit();
    limit_resolved_ = true;
  }
  return limit_;
}

size_t DeviceAllocator::ComputeLimit() const {
  size_t limit = memory_limit_bytes_;
  if (memory_fraction_.has_value()) {
    // At least one byte: a fraction that rounds to nothing (0 included, as in PyTorch) is a
    // limit nothing fits under, not "no limit" (which a limit of 0 would mean).
    const auto from_fraction = std::max<size_t>(
        1, static_cast<size_t>(*memory_fraction_ * static_cast<double>(TotalMemory())));
    limit = limit == 0 ? from_fraction : std::min(limit, from_fraction);
  }
  return limit;
}

void* DeviceAllocator::Malloc(size_t size, StreamRef stream, TraceContext& context,
                              MallocOptions options) {
  std::unique_lock lock(mutex_);
  const size_t rounded = policy_.RoundSize(size);
  if (options.decline_past_soft_limit &&
      static_cast<size_t>(stats_.allocated_bytes.all().current) + rounded >
          soft_limit_.load(std::memory_order_relaxed)) {
    return nullptr;
  }
  ProcessEventsLocked();
  const PoolKind kind = policy_.PoolFor(rounded);
  const size_t segment_size = policy_.FullSegmentSize(rounded);

  BlockId block = FindFree(kind, stream, rounded);
  // Under a soft limit, blocks whose stream uses (a spill's copies, under the offload budget) are
  // still reading them are about to be free, and they are what whoever set the level counts on:
  // use them rather than take a segment that would lift reserved memory past it. (Without this
  // the offload engine's `auto` held its allocated bytes at the budget while its reserved bytes
  // grew to twice that.) Where every access is stream work, `stream` waits for the uses and the
  // host goes on; else the host waits for them. Only as many as the request needs, oldest first.
  if (block == kNoBlock && static_cast<size_t>(stats_.reserved_bytes.all().current) + segment_size >
                               soft_limit_.load(std::memory_order_relaxed)) {
    block = AwaitPendingUntilFit(kind, stream, rounded);
  }
  if (block == kNoBlock) {
    GarbageCollect(segment_size);
    block = AllocSegment(kind, stream, rounded, context);
  }
  // A guess takes only what is there: no ladder, and no out-of-memory error on record.
  if (block == kNoBlock && !options.reclaim) {
    throw OutOfMemoryError(
        absl::StrFormat("Spillway: an allocation of %s on device %d that may not reclaim memory "
                        "(a speculative one) found no room without freeing memory",
                        FormatBytes(size), device_),
        size, device_);
  }
  // The out-of-memory ladder, cheapest step first: what the allocator can do on its own, then
  // what the registered holders (the offload engine, whose spills cost copies) can give back.
  // num_alloc_retries counts mallocs that retried, as PyTorch's does, not the holders' rounds.
  if (block == kNoBlock) {
    ++stats_.num_alloc_retries;
    block = Reclaim(kind, stream, rounded, context);
  }
  if (block == kNoBlock && callbacks_) block = AskHolders(kind, stream, rounded, lock, context);
  if (block == kNoBlock) ThrowOutOfMemory(size, rounded);
  return UseBlock(block, rounded, size, std::move(context));
}

BlockId DeviceAllocator::FindFree(PoolKind kind, StreamRef stream, size_t size) {
  // The best fit is the smallest candidate; if it breaks an oversize rule so does every larger one.
  // A stream without a slot has no segment, so no free block either.
  const std::optional<uint16_t> slot = streams_.Find(stream.id);
  if (!slot.has_value()) return kNoBlock;
  return pool(kind).TakeBestFit(*slot, size, [&](const FreeKey& key) {
    if (!policy_.AcceptsBlock(key.size(), size)) return false;
    // With many live blocks the block and its allocated_ slot are cache misses; start both now
    // so they overlap the index erase instead of following it.
    __builtin_prefetch(&arena_[key.block], 1);
    allocated_.Prefetch(key.ptr);
    return true;
  });
}

BlockId DeviceAllocator::AllocSegment(PoolKind kind, StreamRef stream, size_t rounded,
                                      const TraceContext& context) {
  // PyTorch's segment size first (a 20 MiB segment for a 1-10 MiB request leaves room for the
  // next few); when that does not fit under the limit or on the device, a segment of just the
  // request's size. At the edge of memory the spare room is a luxury that would fail a request
  // the device can hold (PyTorch's allocator fails it).
  // (Not when its one block would be an oversize block for a request below max_split_size: such
  // a block is never split, nor handed to such a request.) Under a soft limit, the request's own
  // size comes first when only it stays under the soft limit.
  const size_t full = policy_.FullSegmentSize(rounded);
  const size_t least = policy_.LeastSegmentSize(rounded);
  const bool least_allowed = least < full;
  const auto reserved = static_cast<size_t>(stats_.reserved_bytes.all().current);
  const size_t soft_limit = soft_limit_.load(std::memory_order_relaxed);
  if (least_allowed && reserved + full > soft_limit && reserved + least <= soft_limit) {
    return NewSegment(kind, stream, least, context);  // (if it fails, the larger one fails too)
  }
  BlockId block = NewSegment(kind, stream, full, context);
  if (block == kNoBlock && least_allowed) block = NewSegment(kind, stream, least, context);
  return block;
}

BlockId DeviceAllocator::NewSegment(PoolKind kind, StreamRef stream, size_t segment_size,
                                    const TraceContext& context) {
  const size_t reserved = static_cast<size_t>(stats_.reserved_bytes.all().current);
  if (const size_t limit = Limit(); limit != 0 && reserved + segment_size > limit) return kNoBlock;
  // The device's first memory resolves a soft limit fraction below, which needs the device total:
  // asked now, since asking may fail, and then no segment may be left registered that nobody holds.
  if (segments_.empty() && soft_limit_fraction_ != 0.0) TotalMemory();
  absl::StatusOr<void*> memory = backend_.device_malloc(device_, segment_size);
  if (!memory.ok()) {
    if (absl::IsResourceExhausted(memory.status())) return kNoBlock;
    throw BackendError("device_malloc", std::string(memory.status().message()));
  }
  uint16_t slot = 0;
  try {
    slot = streams_.Acquire(stream.id);
  } catch (const Error&) {  // too many streams hold memory: give this segment back
    backend_.device_free(device_, *memory);
    throw;
  }
  const BlockId id = arena_.New();
  Block& block = arena_[id];
  block.ptr = reinterpret_cast<uintptr_t>(*memory);
  block.set_size(segment_size);
  block.stream = slot;
  block.pool = kind;
  segments_[block.ptr] = Segment{segment_size, kind, clock_, id, stream, context};
  stream_handles_.try_emplace(stream.id, stream.handle);
  ++clock_;
  stats_.segment.Increase(kind, 1);
  stats_.reserved_bytes.Increase(kind, static_cast<int64_t>(segment_size));
  if (policy_.IsOversize(segment_size)) stats_.oversize_segments.Increase(1);
  ++stats_.num_device_alloc;
  Trace(TraceAction::kSegmentAlloc, block.ptr, segment_size, stream.id, context);
  if (segments_.size() == 1) ResolveSoftLimit();  // the device's first memory: see SetSoftLimit
  return id;
}

void DeviceAllocator::IndexInsert(BlockId id) {
  const Block& b = arena_[id];
  pool(b.pool).Insert(b.stream, FreeKey{b.size(), b.ptr, id});
}

void DeviceAllocator::IndexErase(BlockId id) {
  const Block& b = arena_[id];
  pool(b.pool).Erase(b.stream, FreeKey{b.size(), b.ptr, id});
}

void* DeviceAllocator::UseBlock(BlockId id, size_t rounded, size_t requested,
                                TraceContext context) {
  const PoolKind kind = arena_[id].pool;
  const bool split = policy_.ShouldSplit(kind, arena_[id].size(), rounded);
  const BlockId rest_id = split ? arena_.New() : kNoBlock;  // may move blocks: before references
  Block& block = arena_[id];
  const bool already_split = block.is_split();
  if (split) {
    // The allocation keeps the front; the remainder goes back to the pool.
    Block& rest = arena_[rest_id];
    rest.ptr = block.ptr + rounded;
    rest.set_size(block.size() - rounded);
    rest.stream = block.stream;
    rest.pool = kind;
    rest.prev = id;
    rest.next = block.next;
    if (rest.next != kNoBlock) arena_[rest.next].prev = rest_id;
    block.next = rest_id;
    block.set_size(rounded);
    IndexInsert(rest_id);
    if (already_split) {
      stats_.inactive_split_bytes.Decrease(kind, static_cast<int64_t>(rounded));
    } else {
      stats_.inactive_split.Increase(kind, 1);
      stats_.inactive_split_bytes.Increase(kind, static_cast<int64_t>(rest.size()));
    }
  } else if (already_split) {
    stats_.inactive_split.Decrease(kind, 1);
    stats_.inactive_split_bytes.Decrease(kind, static_cast<int64_t>(block.size()));
  }
  block.allocated = true;
  block.requested = requested;
  if (context != nullptr) arena_.mutable_extras(id).context = context;
  allocated_.Insert(block.ptr, id);
  const auto size = static_cast<int64_t>(block.size());
  stats_.allocation.Increase(kind, 1);
  stats_.allocated_bytes.Increase(kind, size);
  stats_.active.Increase(kind, 1);
  stats_.active_bytes.Increase(kind, size);
  stats_.requested_bytes.Increase(kind, static_cast<int64_t>(requested));
  if (policy_.IsOversize(block.size())) stats_.oversize_allocations.Increase(1);
  TraceBlock(TraceAction::kAlloc, id, std::move(context));
  return reinterpret_cast<void*>(block.ptr);
}

bool DeviceAllocator::Free(void* ptr, TraceContext context) {
  std::lock_guard lock(mutex_);
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  const BlockId id = allocated_.Take(address, AddressOf());
  if (id == kNoBlock) return false;
  Block& block = arena_[id];
  // Merging reads both neighbours: start their cache misses together, ahead of the bookkeeping.
  // (kNoBlock is a real, never used slot of the arena, so prefetching it is harmless.)
  __builtin_prefetch(&arena_[block.prev], 1);
  __builtin_prefetch(&arena_[block.next], 1);
  block.allocated = false;
  stats_.allocation.Decrease(block.pool, 1);
  stats_.allocated_bytes.Decrease(block.pool, static_cast<int64_t>(block.size()));
  bytes_freed_ += block.size();
  if (policy_.IsOversize(block.size())) stats_.oversize_allocations.Decrease(1);
  TraceBlock(TraceAction::kFreeRequested, id, std::move(context));
  if (!arena_.has_stream_uses(id)) {
    FreeBlock(id);
    return true;
  }
  // Reuse waits for every other stream that used the block: one event per stream, polled at
  // the next Malloc. If an event cannot be recorded, wait for that stream on the host instead;
  // if even that fails the block is quarantined (never reused) rather than risk corruption, and
  // the failure goes to the stream's owner. Free itself does not fail: the pointer is freed.
  BlockExtras& extras = arena_.mutable_extras(id);
  absl::InlinedVector<StreamRef, 1> uses;
  uses.swap(extras.stream_uses);
  std::vector<ForeignStreamUse> foreign;
  foreign.swap(extras.foreign_uses);
  // Streams of other devices: no event of this device can be recorded there, and events of
  // theirs would need bookkeeping of their own for a rare case; a host wait covers what they
  // enqueued up to now, as an event would.
  bool quarantine = false;  // some stream cannot be waited for: the block is never reused
  for (const ForeignStreamUse& use : foreign) {
    if (!WaitOnHost(use.device, use.stream)) quarantine = true;
  }
  for (const StreamRef& use : uses) {
    EventHandle event = nullptr;
    try {
      // Creating the event can fail too (TakeEvent has no spare): same fallback as a failed record.
      event = TakeEvent();
      backend_.record_event(device_, event, use.handle);
    } catch (const BackendError& error) {
      if (event != nullptr) spare_events_.push_back(event);
      // The record may have failed because earlier work on that stream failed (a backend
      // reports that once, to whoever looks): the stream's owner must hear of it.
      if (error.earlier_work()) NoteStreamError(device_, use.id, error);
      if (!WaitOnHost(device_, use)) quarantine = true;
      continue;
    }
    pending_[use.id].push_back(Pending{event, id, use.handle});
    AddPendingEvent(id);
  }
  if (quarantine) {
    // A pending event that never completes: the block stays active_pending_free for good.
    AddPendingEvent(id);
    ++stats_.quarantined_blocks;
    stats_.quarantined_bytes += static_cast<int64_t>(block.size());
  }
  if (!block.pending) FreeBlock(id);
  return true;
}

bool DeviceAllocator::WaitOnHost(int device, const StreamRef& use) {
  try {
    backend_.synchronize_stream(device, use.handle);
    return true;
  } catch (const BackendError& error) {
    // Either way the stream's owner hears of it. An earlier failure is reported (once) after
    // draining: the stream has passed the free. Otherwise the wait itself failed.
    NoteStreamError(device, use.id, error);
    return error.earlier_work();
  }
}

void DeviceAllocator::FreeBlock(BlockId id) {
  Block* block = &arena_[id];
  TraceBlock(TraceAction::kFreeCompleted, id, nullptr);
  const PoolKind kind = block->pool;
  stats_.active.Decrease(kind, 1);
  stats_.active_bytes.Decrease(kind, static_cast<int64_t>(block->size()));
  stats_.requested_bytes.Decrease(kind, static_cast<int64_t>(block->requested));
  block->requested = 0;
  if (block->has_extras) {
    BlockExtras& extras = arena_.mutable_extras(id);
    extras.context.reset();
    extras.category = TraceCategory::kUnknown;
    extras.revive_tag = 0;  // the allocation is over: nobody may take this memory back now
  }

  int64_t net_split_blocks = 0;
  int64_t net_split_bytes = 0;
  // Merge with a free next neighbour: `block` absorbs it. Sizes add in units: a segment's blocks
  // never sum past the segment.
  if (const BlockId next_id = block->next; next_id != kNoBlock && arena_[next_id].is_free()) {
    const Block& next = arena_[next_id];
    IndexErase(next_id);
    net_split_blocks -= 1;
    net_split_bytes -= static_cast<int64_t>(next.size());
    block->units += next.units;
    block->next = next.next;
    if (block->next != kNoBlock) arena_[block->next].prev = id;
    arena_.Delete(next_id);
  }
  // Merge with a free previous neighbour: it absorbs `block`, so a segment's head block never
  // changes.
  if (const BlockId prev_id = block->prev; prev_id != kNoBlock && arena_[prev_id].is_free()) {
    Block& prev = arena_[prev_id];
    IndexErase(prev_id);
    net_split_blocks -= 1;
    net_split_bytes -= static_cast<int64_t>(prev.size());
    prev.units += block->units;
    prev.next = block->next;
    if (prev.next != kNoBlock) arena_[prev.next].prev = prev_id;
    arena_.Delete(id);
    id = prev_id;
    block = &prev;
  }
  if (block->is_split()) {
    net_split_blocks += 1;
    net_split_bytes += static_cast<int64_t>(block->size());
  } else {
    segments_.at(block->ptr).freed_at = clock_;
  }
  if (net_split_blocks > 0) stats_.inactive_split.Increase(kind, net_split_blocks);
  if (net_split_blocks < 0) stats_.inactive_split.Decrease(kind, -net_split_blocks);
  if (net_split_bytes > 0) stats_.inactive_split_bytes.Increase(kind, net_split_bytes);
  if (net_split_bytes < 0) stats_.inactive_split_bytes.Decrease(kind, -net_split_bytes);
  IndexInsert(id);
}

bool DeviceAllocator::ReleaseSegment(BlockId id) {
  const Block& block = arena_[id];
  if (block.is_split() || !block.is_free()) return false;
  const PoolKind kind = block.pool;
  // The device free first: should it throw, the segment is still cached and indexed, whole.
  backend_.device_free(device_, reinterpret_cast<void*>(block.ptr));
  IndexErase(id);
  const auto segment = segments_.find(block.ptr);
  // As PyTorch's: the frames of the allocation that made the segment.
  TraceContext context = std::move(segment->second.context);
  segments_.erase(segment);
  stats_.segment.Decrease(kind, 1);
  stats_.reserved_bytes.Decrease(kind, static_cast<int64_t>(block.size()));
  if (policy_.IsOversize(block.size())) stats_.oversize_segments.Decrease(1);
  ++stats_.num_device_free;
  if (history_.enabled()) {
    Trace(TraceAction::kSegmentFree, block.ptr, block.size(), streams_.id(block.stream),
          std::move(context));
  }
  streams_.Release(block.stream);
  arena_.Delete(id);
  return true;
}

void DeviceAllocator::ReleaseCachedSegments(size_t until_freed) {
  size_t freed = 0;
  std::vector<BlockId> heads;
  for (const auto& [base, segment] : segments_) {
    if (WhollyFree(segment)) heads.push_back(segment.head);
  }
  for (const BlockId head : heads) {
    if (freed >= until_freed) break;
    const size_t size = arena_[head].size();
    if (ReleaseSegment(head)) freed += size;
  }
}

void DeviceAllocator::GarbageCollect(size_t incoming) {
  const size_t limit = Limit();
  if (gc_threshold_ <= 0.0 || limit == 0) return;
  const auto target = static_cast<size_t>(gc_threshold_ * static_cast<double>(limit));
  auto reserved = static_cast<size_t>(stats_.reserved_bytes.all().current);
  if (reserved + incoming <= target) return;
  // Oldest wholly free segments first: they are the least likely to be wanted again soon.
  std::vector<std::pair<int64_t, BlockId>> candidates;
  for (const auto& [base, segment] : segments_) {
    if (WhollyFree(segment)) candidates.emplace_back(segment.freed_at, segment.head);
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [age, head] : candidates) {
    if (reserved + incoming <= target) break;
    const size_t size = arena_[head].size();
    if (ReleaseSegment(head)) reserved -= size;
  }
}

bool DeviceAllocator::RecordStream(void* ptr, StreamRef stream, int stream_device) {
  std::lock_guard lock(mutex_);
  const BlockId id = allocated_.Find(reinterpret_cast<uintptr_t>(ptr), AddressOf());
  if (id == kNoBlock) return false;
  if (stream_device != device_) {
    auto& foreign = arena_.mutable_extras(id).foreign_uses;
    const bool known = std::any_of(foreign.begin(), foreign.end(), [&](const ForeignStreamUse& u) {
      return u.device == stream_device && u.stream.id == stream.id;
    });
    if (!known) foreign.push_back(ForeignStreamUse{stream_device, stream});
    return true;
  }
  if (stream.id == streams_.id(arena_[id].stream)) return true;
  auto& uses = arena_.mutable_extras(id).stream_uses;
  for (const StreamRef& use : uses) {
    if (use.id == stream.id) return true;
  }
  uses.push_back(stream);
  return true;
}

bool DeviceAllocator::SetTraceCategory(const void* ptr, TraceCategory category) {
  std::lock_guard lock(mutex_);
  const BlockId id = allocated_.Find(reinterpret_cast<uintptr_t>(ptr), AddressOf());
  if (id == kNoBlock) return false;
  BlockExtras& extras = arena_.mutable_extras(id);
  extras.category = std::max(extras.category, category);
  return true;
}

bool DeviceAllocator::Annotate(const void* ptr, TraceLabelsRef labels, TraceContext context) {
  std::lock_guard lock(mutex_);
  const BlockId id = allocated_.Find(reinterpret_cast<uintptr_t>(ptr), AddressOf());
  if (id == kNoBlock) return false;
  TraceBlock(TraceAction::kAnnotate, id, std::move(context), std::move(labels));
  return true;
}

void DeviceAllocator::EmptyCache() {
  std::lock_guard lock(mutex_);
  ProcessEventsLocked();
  ReleaseCachedSegments(std::numeric_limits<size_t>::max());
  for (FreeIndex& index : pools_) index.PruneEmpty();
  // What a burst of blocks grew the bookkeeping to goes back too (44 bytes per block id, 8 per
  // table slot: 13 MiB of host memory after 100k live blocks).
  arena_.Trim();
  allocated_.ShrinkToFit();
}

void DeviceAllocator::SetMemoryFraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw InvalidArgumentError(absl::StrFormat(
        "memory fraction %g for device %d is out of range: expected a value in [0, 1] (0 allows "
        "no new memory, 1 the whole device)",
        fraction, device_));
  }
  std::lock_guard lock(mutex_);
  // The device total first: asking for it may fail (on CUDA it creates the context), and then
  // nothing may have changed, the fraction that memory_fraction() reports included.
  TotalMemory();
  memory_fraction_ = fraction;
  limit_ = ComputeLimit();
  limit_resolved_ = true;
  ResolveSoftLimit();
}

void DeviceAllocator::SetMemoryLimit(size_t bytes) {
  std::lock_guard lock(mutex_);
  memory_limit_bytes_ = bytes;
  limit_ = ComputeLimit();
  limit_resolved_ = true;
  ResolveSoftLimit();
}

size_t DeviceAllocator::memory_limit() const {
  std::lock_guard lock(mutex_);
  return Limit();
}

size_t DeviceAllocator::total_memory() const {
  std::lock_guard lock(mutex_);
  return TotalMemory();
}

std::optional<double> DeviceAllocator::memory_fraction() const {
  std::lock_guard lock(mutex_);
  return memory_fraction_;
}

void DeviceAllocator::Trace(TraceAction action, uintptr_t addr, size_t size, uint64_t stream,
                            TraceContext context, TraceCategory category, TraceLabelsRef labels) {
  if (!history_.enabled()) return;
  history_.Record(TraceEntry{action, category, device_, addr, size, stream, NowMicros(),
                             std::move(context), std::move(labels)});
}

void DeviceAllocator::TraceBlockRecorded(TraceAction action, BlockId id, TraceContext context,
                                         TraceLabelsRef labels) {
  const Block& b = arena_[id];
  TraceCategory category = TraceCategory::kUnknown;
  if (const BlockExtras* extras = arena_.extras(id)) {
    category = extras->category;
    if (action == TraceAction::kFreeCompleted) context = extras->context;
  }
  Trace(action, b.ptr, b.requested, streams_.id(b.stream), std::move(context), category,
        std::move(labels));
}

}  // namespace spillway
