#include "offload/pinned_pool.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "allocator/format.h"
#include "allocator/size_policy.h"

namespace spillway {
namespace {

size_t CheckedGrowBytes(size_t grow_bytes) {
  if (grow_bytes > PinnedPool::kMaxBytes) {
    throw InvalidArgumentError(
        absl::StrFormat("Spillway pinned pool: grow_bytes %d exceeds the maximum of %d bytes",
                        grow_bytes, PinnedPool::kMaxBytes));
  }
  return grow_bytes;
}

void CheckRequest(size_t bytes) {
  if (bytes == 0 || bytes > PinnedPool::kMaxBytes) {
    throw InvalidArgumentError(absl::StrFormat(
        "Spillway pinned pool: cannot allocate %d bytes: the size must be in [1, %d]", bytes,
        PinnedPool::kMaxBytes));
  }
}

size_t RoundUp(size_t bytes) {
  return (bytes + PinnedPool::kGranule - 1) / PinnedPool::kGranule * PinnedPool::kGranule;
}

}  // namespace

// Collects what the core reports during one of the pool's calls on this thread.
class PinnedPool::CallScope {
 public:
  // The list of the call under way on this thread; null outside one (the core is called by
  // nothing else, so a report always finds one).
  static thread_local std::vector<Heard>* current;

  CallScope() : outer_(std::exchange(current, &heard_)) {}
  ~CallScope() { current = outer_; }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

  const std::vector<Heard>& heard() const { return heard_; }

 private:
  std::vector<Heard> heard_;
  std::vector<Heard>* outer_;
};

thread_local std::vector<PinnedPool::Heard>* PinnedPool::CallScope::current = nullptr;

void PinnedPool::HeardInCall::OnStreamFailure(int /*device*/, uint64_t stream,
                                              const BackendError& error) {
  // Under the core's lock: only a push (no call back into the core).
  if (CallScope::current != nullptr) CallScope::current->push_back(Heard{stream, error});
}

PinnedPool::PinnedPool(Backend& backend, int device, Options options)
    : device_(device),
      host_memory_(backend),
      core_(host_memory_, device, SizePolicy::Uniform(CheckedGrowBytes(options.grow_bytes)),
            AllocatorConfig{}, /*callbacks=*/{}, heard_) {
  core_.SetMemoryLimit(options.limit_bytes);
}

PinnedPool::~PinnedPool() = default;  // the core waits for pending buffers, then frees chunks

void PinnedPool::ThrowHeard(const std::vector<Heard>& heard) {
  if (heard.empty()) return;
  // One stream's earlier work: that stream's owner acts on it. A failure of a call itself, or
  // failures on several streams, name no one stream: the caller must assume either.
  const Heard& first = heard.front();
  for (const Heard& h : heard) {
    if (!h.error.earlier_work() || h.stream != first.stream) throw BackendError(h.error);
  }
  throw StreamFailure(first.error, first.stream);
}

void* PinnedPool::TryTake(size_t rounded) {
  TraceContext none;
  try {
    return core_.Malloc(rounded, kAllocationStream, none, MallocOptions{.reclaim = false});
  } catch (const OutOfMemoryError&) {
    return nullptr;
  }
}

absl::StatusOr<void*> PinnedPool::Allocate(size_t bytes) {
  CheckRequest(bytes);
  const size_t rounded = RoundUp(bytes);
  void* ptr = nullptr;
  {
    CallScope call;
    ptr = TryTake(rounded);
    // The cached chunks may be what stands in the way (the limit counts them, the backend may be
    // short of pinned memory): return the wholly free ones and, if that gave any back, ask once
    // more.
    if (ptr == nullptr) {
      const size_t reserved = reserved_bytes();
      core_.EmptyCache();
      if (reserved_bytes() < reserved) ptr = TryTake(rounded);
    }
    // A failure heard on the way (a last use's copy failed) is the caller's to act on first: the
    // buffer goes back, and the caller may ask again.
    if (ptr != nullptr && !call.heard().empty()) core_.Free(ptr, nullptr);
    ThrowHeard(call.heard());
  }
  if (ptr == nullptr) return FailureStatus(bytes, rounded);
  return ptr;
}

absl::Status PinnedPool::FailureStatus(size_t bytes, size_t rounded) const {
  const DeviceStats stats = Stats();
  const auto reserved = static_cast<size_t>(stats.reserved_bytes.all().current);
  const auto in_use = static_cast<size_t>(stats.active_bytes.all().current);
  const size_t limit = core_.memory_limit();
  if (limit != 0 && (rounded > limit || reserved > limit - rounded)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "Spillway pinned pool: cannot allocate %d bytes (%s, rounded to %s): %s of pinned memory "
        "reserved (%s in use) and the limit is %s",
        bytes, FormatBytes(bytes), FormatBytes(rounded), FormatBytes(reserved), FormatBytes(in_use),
        FormatBytes(limit)));
  }
  return absl::UnavailableError(absl::StrFormat(
      "Spillway pinned pool: the backend could not provide %s of pinned memory for a request of "
      "%d bytes (%s reserved by the pool): %s",
      FormatBytes(rounded), bytes, FormatBytes(reserved), host_memory_.last_failure()));
}

void PinnedPool::Free(void* ptr, std::optional<StreamRef> last_use) {
  CallScope call;
  // The last use first: the core then records its event at the free (or waits on the host when
  // it cannot), and the buffer is reused only after it.
  if (last_use.has_value() && !core_.RecordStream(ptr, *last_use, device_)) ThrowNotLive(ptr);
  if (!core_.Free(ptr, nullptr)) ThrowNotLive(ptr);
  ThrowHeard(call.heard());
}

void PinnedPool::Trim() {
  CallScope call;
  core_.EmptyCache();
  ThrowHeard(call.heard());
}

void PinnedPool::SetLimit(size_t limit_bytes) {
  CallScope call;
  core_.SetMemoryLimit(limit_bytes);
  if (limit_bytes != 0 && reserved_bytes() > limit_bytes) core_.EmptyCache();
  ThrowHeard(call.heard());
}

size_t PinnedPool::reserved_bytes() const {
  return static_cast<size_t>(Stats().reserved_bytes.all().current);
}

size_t PinnedPool::in_use_bytes() const {
  return static_cast<size_t>(Stats().active_bytes.all().current);
}

size_t PinnedPool::peak_reserved_bytes() const {
  return static_cast<size_t>(Stats().reserved_bytes.all().peak);
}

size_t PinnedPool::buffer_size(const void* ptr) const {
  const std::optional<AllocationInfo> info = core_.Lookup(ptr);
  if (!info.has_value()) ThrowNotLive(ptr);
  return info->size;
}

int64_t PinnedPool::num_backend_allocs() const { return Stats().num_device_alloc; }

void PinnedPool::ThrowNotLive(const void* ptr) const {
  if (const std::optional<AllocationInfo> live = core_.LookupContaining(ptr); live.has_value()) {
    throw InvalidArgumentError(absl::StrFormat(
        "Spillway pinned pool: %p points %d bytes into the buffer at %p; pass the pointer "
        "Allocate returned",
        ptr, static_cast<const char*>(ptr) - static_cast<const char*>(live->ptr), live->ptr));
  }
  if (core_.SegmentOf(ptr).has_value()) {
    throw InvalidArgumentError(absl::StrFormat(
        "Spillway pinned pool: %p is in the pool's memory but no live buffer: already freed (a "
        "double free, or a pointer used after Free), or inside a freed one",
        ptr));
  }
  throw InvalidArgumentError(
      absl::StrFormat("Spillway pinned pool: %p is not a buffer of this pool", ptr));
}

void PinnedPool::RecordHistory(bool enabled, size_t max_entries) {
  core_.RecordHistory(enabled, max_entries);
  if (!enabled) core_.ClearHistory();  // stopping forgets, as the allocator's history does
}

bool PinnedPool::history_enabled() const { return core_.history_enabled(); }

std::vector<TraceEntry> PinnedPool::history() const {
  std::vector<TraceEntry> entries = core_.history();
  for (TraceEntry& e : entries) {
    // PyTorch's host allocator records host memory as device -1, stream 0.
    e.device = -1;
    e.stream = 0;
  }
  return entries;
}

std::vector<SegmentSnapshot> PinnedPool::Chunks() const {
  std::vector<SegmentSnapshot> chunks = core_.SnapshotSegments();
  for (SegmentSnapshot& chunk : chunks) {
    chunk.device = -1;
    chunk.stream = 0;
    // As PyTorch's host segments: a block's requested size is its size.
    chunk.requested_size = chunk.total_size;
    for (BlockSnapshot& block : chunk.blocks) block.requested_size = block.size;
  }
  return chunks;
}

}  // namespace spillway
