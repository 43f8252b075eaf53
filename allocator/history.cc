#include "allocator/history.h"

#include <chrono>
#include <utility>

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
  }
  return "unknown";
}

int64_t NowMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void HistoryRing::Enable(size_t max_entries) {
  if (max_entries == 0) max_entries = 1;
  if (max_entries != ring_.size()) {
    ring_.assign(max_entries, TraceEntry{});
    next_ = count_ = 0;
    overflowed_ = false;
  }
  enabled_ = true;
}

void HistoryRing::Clear() {
  for (TraceEntry& e : ring_) e = TraceEntry{};
  next_ = count_ = 0;
  overflowed_ = false;
}

void HistoryRing::Record(TraceEntry entry) {
  if (!enabled_ || ring_.empty()) return;
  ring_[next_] = std::move(entry);
  next_ = (next_ + 1) % ring_.size();
  if (count_ < ring_.size()) {
    ++count_;
  } else {
    overflowed_ = true;
  }
}

std::vector<TraceEntry> HistoryRing::Entries() const {
  std::vector<TraceEntry> out;
  out.reserve(count_);
  const size_t start = (next_ + ring_.size() - count_) % (ring_.empty() ? 1 : ring_.size());
  for (size_t i = 0; i < count_; ++i) out.push_back(ring_[(start + i) % ring_.size()]);
  return out;
}

}  // namespace spillway
