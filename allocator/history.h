// A bounded ring of allocator events (PyTorch's `TraceEntry` history): what was allocated and
// freed, when, on which stream, optionally with a caller-supplied context (the torch layer stores
// Python stack frames there).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace spillway {

// One byte, as TraceCategory: the two take the four bytes the action took alone, so a TraceEntry
// is no larger for its category.
enum class TraceAction : uint8_t {
  kAlloc,
  kFreeRequested,
  kFreeCompleted,
  kSegmentAlloc,
  kSegmentFree,
  kOom,
  kSnapshot,
  // Metadata attached after the fact to a live allocation (torch 2.14's
  // torch.cuda.memory._annotate_tensor): addr and size are the allocation's, and the entry's
  // labels carry the annotation as their user_metadata.
  kAnnotate,
};

// PyTorch's spelling: "alloc", "free_requested", ..., "segment_free", "oom", "snapshot",
// "annotate".
std::string_view TraceActionName(TraceAction action);

// What an allocation held, as far as the layers above the allocator learned it (the torch
// layer's saves, and the offload engine's spills and reloads, through
// CachingAllocator::SetTraceCategory) while history was recorded. Ordered: a block's category
// only rises, so a reload given back stays a reload.
enum class TraceCategory : uint8_t {
  kUnknown,
  // Saved for backward. Not PyTorch's "activation": parameters and inputs are saved too, and
  // nothing cheap tells them apart at the save.
  kSavedForBackward,
  kSpilled,   // saved for backward; its device memory went when its bytes were spilled to host
  kReloaded,  // made by a reload of spilled bytes
};

// The `category` of PyTorch's trace entries, which its memory viewer colours allocations by:
// "unknown" (PyTorch's name for what it cannot tell), "saved_for_backward", "spilled",
// "reloaded".
std::string_view TraceCategoryName(TraceCategory category);

// What a context gatherer returns. Type-erased so the core stays free of torch and Python; the
// layer that installed the gatherer knows the real type.
using TraceContext = std::shared_ptr<const void>;
using ContextGatherer = std::function<TraceContext()>;

// What PyTorch's allocator attaches to each trace entry from the thread that records it (torch
// 2.7 on): the top of the thread's compile-context stack (the "Torch-Compiled Region: 0/1" that
// Dynamo's code runs in, pushed and popped by torch's RecordFunction callback) and the thread's
// user metadata (torch.cuda.memory._set_memory_metadata). Shared, immutable: an entry holds a
// pointer, so recording costs no string copies.
struct TraceLabels {
  std::string compile_context;  // empty: none (PyTorch then writes "N/A")
  std::string user_metadata;    // empty: none
};
using TraceLabelsRef = std::shared_ptr<const TraceLabels>;

// The calling thread's labels, as PyTorch keeps them: per thread (its `static thread_local`
// compile_context stack and user_metadata), so shared by every allocator of the process. Setting
// them is up to the front (CachingAllocator), which decides when they count.
namespace trace_labels {
void PushCompileContext(std::string context);
void PopCompileContext();  // an empty stack stays empty, as in PyTorch
void SetUserMetadata(std::string metadata);
const std::string& UserMetadata();
// Null while the thread has neither a compile context nor user metadata.
const TraceLabelsRef& Current();
}  // namespace trace_labels

// One record_function boundary (PyTorch's AnnotationEntry, its snapshot's
// `external_annotations`): the key/value pairs torch passes ({"name", ...}, {"stage", "START"} or
// "END"), the device current on the recording thread, and when.
struct AnnotationEntry {
  int device = 0;
  int64_t time_us = 0;  // microseconds since the Unix epoch, as TraceEntry::time_us
  std::vector<std::pair<std::string, std::string>> metadata;
};

struct TraceEntry {
  TraceAction action = TraceAction::kAlloc;
  // Of a free_requested or free_completed: the block's when it was freed (an allocation is
  // recorded before anything is learned of it; see TraceCategory).
  TraceCategory category = TraceCategory::kUnknown;
  int device = 0;
  uintptr_t addr = 0;  // for kOom: free device bytes at the time
  size_t size = 0;
  uint64_t stream = 0;  // StreamRef::id
  int64_t time_us = 0;  // microseconds since the Unix epoch
  TraceContext context;
  // The recording thread's labels (set by HistoryRing::Record unless the entry came with its own,
  // as an annotation does); null: none.
  TraceLabelsRef labels = nullptr;
};

int64_t NowMicros();

// Not thread-safe: the owning device allocator guards it with its mutex.
class HistoryRing {
 public:
  // Starts recording into a ring of at most `max_entries` (0 counts as 1), grown as entries come.
  // Recorded entries are kept when the capacity is unchanged, dropped otherwise.
  void Enable(size_t max_entries);
  void Disable() { enabled_ = false; }
  bool enabled() const { return enabled_; }
  void Clear();

  // Records `entry` while enabled, with the calling thread's labels (trace_labels::Current)
  // unless it carries labels of its own.
  void Record(TraceEntry entry);
  // Oldest first.
  std::vector<TraceEntry> Entries() const;
  // True once entries were overwritten since the last Clear/Enable.
  bool overflowed() const { return overflowed_; }
  size_t capacity() const { return max_entries_; }

 private:
  std::vector<TraceEntry> ring_;
  size_t max_entries_ = 0;
  size_t next_ = 0;  // once full, the oldest entry, overwritten next
  bool enabled_ = false;
  bool overflowed_ = false;
};

}  // namespace spillway
