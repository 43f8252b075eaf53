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
  EngineLock lock(mutex_);
  const auto current = entries_.find(key);
  const auto set_aside = detached_.find(key);
  if (set_aside == detached_.end()) {
    if (current == entries_.end()) return std::nullopt;
    return DescribeEntry(*current->second);
  }
  // Who keeps the storage is every keeper of it: saves whose bytes are lost hold it as well.
  const std::vector<std::unique_ptr<Entry>>& aside = set_aside->second;
  const Entry& described = current != entries_.end() ? *current->second : *aside.back();
  EntryInfo info = DescribeEntry(described);
  for (const std::unique_ptr<Entry>& e : aside) {
    if (e.get() == &described) continue;
    for (const auto& [id, view] : e->keepers) info.keepers.push_back(KeeperInfo{id, view, true});
  }
  std::sort(info.keepers.begin(), info.keepers.end(),
            [](const KeeperInfo& a, const KeeperInfo& b) { return a.id < b.id; });
  return info;
}

EntryInfo OffloadEngine::DescribeEntry(const Entry& e) {
  EntryInfo info;
  info.key = e.key;
  info.data = e.storage->data();
  info.nbytes = e.nbytes;
  info.device = e.device;
  info.residency = e.state;
  info.prefetched = e.prefetched;
  info.external_holders = e.storage->external_holders();
  const bool lost = e.state == Residency::kFailed;
  for (const auto& [id, view] : e.keepers) info.keepers.push_back(KeeperInfo{id, view, lost});
  std::sort(info.keepers.begin(), info.keepers.end(),
            [](const KeeperInfo& a, const KeeperInfo& b) { return a.id < b.id; });
  info.spill_count = e.spill_count;
  info.reload_count = e.reload_count;
  info.last_spill_us = e.last_spill_us;
  info.last_reload_us = e.last_reload_us;
  return info;
}

std::optional<EntryInfo> OffloadEngine::DescribeKeeper(KeeperId id) const {
  EngineLock lock(mutex_);
  auto it = keepers_.find(id);
  if (it == keepers_.end()) return std::nullopt;
  return DescribeEntry(*it->second.entry);  // a detached entry's too
}

std::vector<const void*> OffloadEngine::EntryKeys() const {
  EngineLock lock(mutex_);
  std::vector<const void*> keys;
  keys.reserve(by_seq_.size());
  for (const auto& [seq, entry] : by_seq_) {
    // A set-aside entry's key names its storage's current entry, listed in its own place; with
    // none, the newest entry set aside stands for the storage.
    const auto current = entries_.find(entry->key);
    bool listed = false;
    if (current != entries_.end()) {
      listed = current->second.get() == entry;
    } else if (const auto aside = detached_.find(entry->key); aside != detached_.end()) {
      listed = aside->second.back().get() == entry;
    }
    if (listed) keys.push_back(entry->key);
  }
  return keys;
}

void OffloadEngine::CountSkip(std::string_view reason) {
  EngineLock lock(mutex_);
  ++stats_.skipped[std::string(reason)];
}

void OffloadEngine::DeclareSkipReason(std::string_view reason) {
  EngineLock lock(mutex_);
  stats_.skipped.try_emplace(std::string(reason), 0);
}

OffloadStats OffloadEngine::stats() const {
  EngineLock lock(mutex_);
  OffloadStats out = stats_;
  out.host_reserved_bytes = 0;
  for (const auto& dc : devices_) {
    if (dc != nullptr) out.host_reserved_bytes += static_cast<int64_t>(dc->pool.reserved_bytes());
  }
  return out;
}

void OffloadEngine::ResetPeakStats() {
  EngineLock lock(mutex_);
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
  }
  return "unknown";
}

std::vector<OffloadEvent> OffloadEngine::Events() const {
  EngineLock lock(mutex_);
  return {events_.begin(), events_.end()};
}

}  // namespace spillway
