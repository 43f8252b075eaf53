// OffloadEngine: statistics, descriptions of entries, the event log.
#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"
#include "allocator/format.h"
#include "allocator/history.h"
#include "offload/engine.h"
#include "offload/engine_internal.h"

namespace spillway {

std::optional<EntryInfo> OffloadEngine::Describe(const void* key) const {
  EngineLock lock(mutex_, this);
  return table_.Describe(key);
}

std::optional<EntryInfo> OffloadEngine::DescribeKeeper(KeeperId id) const {
  EngineLock lock(mutex_, this);
  return table_.DescribeKeeper(id);
}

std::vector<const void*> OffloadEngine::EntryKeys() const {
  EngineLock lock(mutex_, this);
  return table_.Keys();
}

void OffloadEngine::CountSkip(std::string_view reason) {
  EngineLock lock(mutex_, this);
  CountSkipLocked(reason);
}

void OffloadEngine::CountSkipLocked(std::string_view reason) {
  ++stats_.skipped[std::string(reason)];
}

void OffloadEngine::DeclareSkipReason(std::string_view reason) {
  EngineLock lock(mutex_, this);
  stats_.skipped.try_emplace(std::string(reason), 0);
}

OffloadStats OffloadEngine::stats() const {
  EngineLock lock(mutex_, this);
  OffloadStats out = stats_;
  out.host_reserved_bytes = static_cast<int64_t>(copies_.host_reserved_bytes());
  return out;
}

void OffloadEngine::RecordHostHistory(bool enabled, size_t max_entries) {
  EngineLock lock(mutex_, this);
  copies_.RecordHostHistory(enabled, max_entries);
}

bool OffloadEngine::host_history_enabled() const {
  EngineLock lock(mutex_, this);
  return copies_.host_history_enabled();
}

std::vector<SegmentSnapshot> OffloadEngine::HostSegments() const {
  EngineLock lock(mutex_, this);
  return copies_.HostSegments();
}

std::vector<TraceEntry> OffloadEngine::HostHistory() const {
  EngineLock lock(mutex_, this);
  return copies_.HostHistory();
}

void OffloadEngine::ResetPeakStats() {
  EngineLock lock(mutex_, this);
  stats_.spilled_bytes.ResetPeak();
  stats_.host_bytes.ResetPeak();
}

std::string_view OffloadEventName(OffloadEvent::Kind kind) {
  switch (kind) {
    case OffloadEvent::Kind::kSpill:
      return "spill";
    case OffloadEvent::Kind::kReload:
      return "reload";
    case OffloadEvent::Kind::kDropSpilled:
      return "drop_spilled";
    case OffloadEvent::Kind::kFailed:
      return "failed";
    case OffloadEvent::Kind::kPrefetchGivenBack:
      return "prefetch_given_back";
    case OffloadEvent::Kind::kTakenBack:
      return "taken_back";
  }
  return "unknown";
}

std::vector<OffloadEvent> OffloadEngine::Events() const {
  EngineLock lock(mutex_, this);
  return {events_.begin(), events_.end()};
}

}  // namespace spillway
