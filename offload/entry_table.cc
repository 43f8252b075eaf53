#include "offload/entry_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"

namespace spillway {

std::string_view ResidencyName(Residency residency) {
  switch (residency) {
    case Residency::kResident:
      return "resident";
    case Residency::kSpilling:
      return "spilling";
    case Residency::kSpilled:
      return "spilled";
    case Residency::kReloading:
      return "reloading";
    case Residency::kFailed:
      return "failed";
  }
  return "unknown";
}

Entry* EntryTable::Current(const void* key) const {
  const auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : it->second.get();
}

const std::vector<std::unique_ptr<Entry>>* EntryTable::SetAside(const void* key) const {
  const auto it = detached_.find(key);
  return it == detached_.end() ? nullptr : &it->second;
}

void EntryTable::SetAsideCurrent(const void* key) {
  const auto it = entries_.find(key);
  detached_[key].push_back(std::move(it->second));
  entries_.erase(it);
}

Entry& EntryTable::Insert(std::unique_ptr<Entry> entry, bool sized, bool candidate) {
  Entry& e = *entry;
  e.seq = next_seq_++;
  if (sized) WindowAdd(e);
  if (candidate) spill_candidates_[e.seq] = &e;
  by_seq_[e.seq] = &e;
  entries_.emplace(e.key, std::move(entry));
  return e;
}

std::unique_ptr<Entry> EntryTable::Erase(Entry& e) {
  by_seq_.erase(e.seq);
  spill_candidates_.erase(e.seq);
  WindowRemove(e);
  // (Not listed in offloaded_ any more: each save's listing went with its last keeper.)
  std::unique_ptr<Entry> gone;
  const void* const key = e.key;
  if (const auto current = entries_.find(key);
      current != entries_.end() && current->second.get() == &e) {
    gone = std::move(current->second);
    entries_.erase(current);
    return gone;
  }
  // Set aside: the storage has a newer entry.
  auto set_aside = detached_.find(key);
  std::vector<std::unique_ptr<Entry>>& aside = set_aside->second;
  const auto it = std::find_if(aside.begin(), aside.end(),
                               [&e](const std::unique_ptr<Entry>& d) { return d.get() == &e; });
  gone = std::move(*it);
  aside.erase(it);
  if (aside.empty()) detached_.erase(set_aside);
  return gone;
}

std::vector<std::unique_ptr<Entry>> EntryTable::TakeAll() {
  std::vector<std::unique_ptr<Entry>> all;
  for (auto& [key, entry] : entries_) all.push_back(std::move(entry));
  for (auto& [key, aside] : detached_) {
    for (auto& entry : aside) all.push_back(std::move(entry));
  }
  entries_.clear();
  detached_.clear();
  keepers_.clear();
  by_seq_.clear();
  spill_candidates_.clear();
  offloaded_.clear();
  for (Window& w : windows_) w = Window{};
  return all;
}

KeeperId EntryTable::AddKeeper(Entry& e, ViewInfo&& view) {
  const KeeperId id = next_keeper_++;
  e.keepers.emplace(id, std::move(view));
  keepers_[id] = Keeper{&e, e.seq};
  ++e.saves[e.seq];
  return id;
}

const Keeper& EntryTable::KeeperOf(KeeperId id) const {
  const Keeper* keeper = FindKeeper(id);
  if (keeper == nullptr) {
    throw InvalidArgumentError(absl::StrFormat(
        "offload keeper %d is not registered (released already, or never added)", id));
  }
  return *keeper;
}

const Keeper* EntryTable::FindKeeper(KeeperId id) const {
  const auto it = keepers_.find(id);
  return it == keepers_.end() ? nullptr : &it->second;
}

Entry* EntryTable::RemoveKeeper(KeeperId id) {
  const Keeper keeper = KeeperOf(id);
  Entry& e = *keeper.entry;
  keepers_.erase(id);
  e.keepers.erase(id);
  // A save whose keepers are all gone is read by nobody: prefetch must not bring the storage back
  // for it. Seqs are never reused, so a listing there is `e`'s; checked all the same, as a
  // dangling listing would be read after `e` is freed.
  if (const auto save = e.saves.find(keeper.save_seq);
      save != e.saves.end() && --save->second == 0) {
    e.saves.erase(save);
    if (const auto it = offloaded_.find(keeper.save_seq);
        it != offloaded_.end() && it->second == &e) {
      offloaded_.erase(it);
    }
  }
  return e.keepers.empty() ? &e : nullptr;
}

void EntryTable::Resequence(Entry& e) {
  Window& w = windows_[static_cast<size_t>(e.device)];
  const bool sized = w.sized.contains(e.seq);
  if (sized) WindowRemove(e);
  by_seq_.erase(e.seq);
  const bool candidate = spill_candidates_.erase(e.seq) != 0;
  // offloaded_ keeps its listings: they are where the earlier saves' keepers read it.
  e.seq = next_seq_++;
  by_seq_[e.seq] = &e;
  if (candidate) spill_candidates_[e.seq] = &e;
  if (sized) WindowAdd(e);
}

void EntryTable::ListOffloaded(Entry& e) {
  for (const auto& [seq, count] : e.saves) offloaded_[seq] = &e;
}

Entry* EntryTable::OffloadedBefore(uint64_t* cursor) const {
  auto it = offloaded_.lower_bound(*cursor);
  if (it == offloaded_.begin()) return nullptr;
  --it;
  *cursor = it->first;
  return it->second;
}

Entry* EntryTable::SavedAt(uint64_t seq) const {
  if (const auto it = by_seq_.find(seq); it != by_seq_.end()) return it->second;
  const auto listed = offloaded_.find(seq);
  return listed == offloaded_.end() ? nullptr : listed->second;
}

void EntryTable::SetWindowLimit(size_t bytes) {
  window_limit_ = bytes;
  for (Window& w : windows_) {
    w.start = Window::kEmpty;
    w.bytes = 0;
    WindowExtend(w);
  }
}

uint64_t EntryTable::WindowStart(int device) const {
  const Window& w = windows_[static_cast<size_t>(device)];
  return w.start == Window::kEmpty ? next_seq_ : w.start;
}

const void* EntryTable::WindowOldestKey(int device) const {
  const Window& w = windows_.at(static_cast<size_t>(device));
  return w.start == Window::kEmpty ? nullptr : w.sized.at(w.start)->key;
}

void EntryTable::WindowAdd(Entry& e) {
  Window& w = windows_[static_cast<size_t>(e.device)];
  w.sized[e.seq] = &e;
  // The newest entry joins the window; the oldest leave while it holds too much.
  if (w.start == Window::kEmpty) w.start = e.seq;
  w.bytes += e.nbytes;
  while (w.bytes > window_limit_) {
    auto oldest = w.sized.find(w.start);
    w.bytes -= oldest->second->nbytes;
    ++oldest;
    if (oldest == w.sized.end()) {
      w.start = Window::kEmpty;  // the newest alone is larger than the window
      w.bytes = 0;
      break;
    }
    w.start = oldest->first;
  }
}

void EntryTable::WindowRemove(const Entry& e) {
  Window& w = windows_[static_cast<size_t>(e.device)];
  if (w.sized.erase(e.seq) == 0) return;
  if (w.start != Window::kEmpty && e.seq >= w.start) {
    w.bytes -= e.nbytes;
    if (e.seq == w.start) {
      const auto next = w.sized.upper_bound(e.seq);
      w.start = next == w.sized.end() ? Window::kEmpty : next->first;
    }
  }
  WindowExtend(w);  // room freed inside, or the entry that did not fit is gone
}

void EntryTable::WindowExtend(Window& w) const {
  while (true) {
    auto it = w.start == Window::kEmpty ? w.sized.end() : w.sized.find(w.start);
    if (it == w.sized.begin()) return;
    --it;
    if (w.bytes + it->second->nbytes > window_limit_) return;
    w.bytes += it->second->nbytes;
    w.start = it->first;
  }
}

std::optional<EntryInfo> EntryTable::Describe(const void* key) const {
  const Entry* const current = Current(key);
  const std::vector<std::unique_ptr<Entry>>* const aside = SetAside(key);
  if (aside == nullptr) {
    if (current == nullptr) return std::nullopt;
    return DescribeEntry(*current);
  }
  // Who keeps the storage is every keeper of it: saves whose bytes are lost hold it as well.
  const Entry& described = current != nullptr ? *current : *aside->back();
  EntryInfo info = DescribeEntry(described);
  for (const std::unique_ptr<Entry>& e : *aside) {
    if (e.get() == &described) continue;
    for (const auto& [id, view] : e->keepers) info.keepers.push_back(KeeperInfo{id, view, true});
  }
  std::sort(info.keepers.begin(), info.keepers.end(),
            [](const KeeperInfo& a, const KeeperInfo& b) { return a.id < b.id; });
  return info;
}

EntryInfo EntryTable::DescribeEntry(const Entry& e) {
  EntryInfo info;
  info.key = e.key;
  // (Being allocated, with the engine's lock released: not to be read now, and null until then.)
  info.data = e.allocating ? nullptr : e.storage->data();
  info.nbytes = e.nbytes;
  info.device = e.device;
  info.residency = e.state;
  info.prefetched = e.prefetched;
  info.host_copy = e.host != nullptr;
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

std::optional<EntryInfo> EntryTable::DescribeKeeper(KeeperId id) const {
  const Keeper* keeper = FindKeeper(id);
  if (keeper == nullptr) return std::nullopt;
  return DescribeEntry(*keeper->entry);  // a detached entry's too
}

std::vector<const void*> EntryTable::Keys() const {
  std::vector<const void*> keys;
  keys.reserve(by_seq_.size());
  for (const auto& [seq, entry] : by_seq_) {
    // A set-aside entry's key names its storage's current entry, listed in its own place; with
    // none, the newest entry set aside stands for the storage.
    const Entry* const current = Current(entry->key);
    bool listed = false;
    if (current != nullptr) {
      listed = current == entry;
    } else if (const auto* aside = SetAside(entry->key); aside != nullptr) {
      listed = aside->back().get() == entry;
    }
    if (listed) keys.push_back(entry->key);
  }
  return keys;
}

}  // namespace spillway
