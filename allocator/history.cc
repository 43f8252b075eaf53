#include "allocator/history.h"

#include <chrono>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace spillway {

std::string_view TraceActionName(TraceAction action) {
  switch (action) {
    case TraceAction::kAlloc:
      return "alloc";
    case TraceAction::kFreeRequested:
      return "free_requested";
    case TraceAction::kFreeCompleted:
      return "free_completed";
    case TraceAction::kSegmentAlloc:
      return "segment_alloc";
    case TraceAction::kSegmentFree:
      return "segment_free";
    case TraceAction::kOom:
      return "oom";
    case TraceAction::kSnapshot:
      return "snapshot";
    case TraceAction::kAnnotate:
      return "annotate";
  }
  return "unknown";
}

std::string_view TraceCategoryName(TraceCategory category) {
  switch (category) {
    case TraceCategory::kUnknown:
      return "unknown";
    case TraceCategory::kSavedForBackward:
      return "saved_for_backward";
    case TraceCategory::kSpilled:
      return "spilled";
    case TraceCategory::kReloaded:
      return "reloaded";
  }
  return "unknown";
}

namespace trace_labels {
namespace {

// One per thread, as PyTorch's (DeviceCachingAllocator's static thread_local compile_context and
// user_metadata). `current` is rebuilt on each change, which is rare (a compiled region's entry
// and exit, a metadata change), so that recording an entry only copies a pointer.
struct ThreadLabels {
  std::vector<std::string> compile_contexts;
  std::string user_metadata;
  TraceLabelsRef current;

  void Refresh() {
    if (compile_contexts.empty() && user_metadata.empty()) {
      current = nullptr;
      return;
    }
    current = std::make_shared<const TraceLabels>(TraceLabels{
        compile_contexts.empty() ? std::string() : compile_contexts.back(), user_metadata});
  }
};

ThreadLabels& This() {
  thread_local ThreadLabels labels;
  return labels;
}

}  // namespace

void PushCompileContext(std::string context) {
  ThreadLabels& labels = This();
  labels.compile_contexts.push_back(std::move(context));
  labels.Refresh();
}

void PopCompileContext() {
  ThreadLabels& labels = This();
  if (labels.compile_contexts.empty()) return;
  labels.compile_contexts.pop_back();
  labels.Refresh();
}

void SetUserMetadata(std::string metadata) {
  ThreadLabels& labels = This();
  labels.user_metadata = std::move(metadata);
  labels.Refresh();
}

const std::string& UserMetadata() { return This().user_metadata; }

const TraceLabelsRef& Current() { return This().current; }

}  // namespace trace_labels

int64_t NowMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void HistoryRing::Enable(size_t max_entries) {
  if (max_entries == 0) max_entries = 1;
  if (max_entries != max_entries_) {
    ring_.clear();
    max_entries_ = max_entries;
    next_ = 0;
    overflowed_ = false;
  }
  enabled_ = true;
}

void HistoryRing::Clear() {
  ring_.clear();
  next_ = 0;
  overflowed_ = false;
}

void HistoryRing::Record(TraceEntry entry) {
  if (!enabled_) return;
  if (entry.labels == nullptr) entry.labels = trace_labels::Current();
  // Grown as entries come, as PyTorch's ring is: its default asks for sys.maxsize entries.
  if (ring_.size() < max_entries_) {
    try {
      ring_.push_back(std::move(entry));
      return;
    } catch (const std::bad_alloc&) {
      // The ring is as large as it can be: recording goes on in it rather than fail the
      // allocation or free being recorded. (A failed push_back leaves the entry as it was.)
      if (ring_.empty()) return;
      max_entries_ = ring_.size();
    }
  }
  ring_[next_] = std::move(entry);
  next_ = (next_ + 1) % max_entries_;
  overflowed_ = true;
}

std::vector<TraceEntry> HistoryRing::Entries() const {
  // Until the ring is full, next_ is 0 and the entries are in order.
  std::vector<TraceEntry> out;
  out.reserve(ring_.size());
  for (size_t i = 0; i < ring_.size(); ++i) out.push_back(ring_[(next_ + i) % ring_.size()]);
  return out;
}

}  // namespace spillway
