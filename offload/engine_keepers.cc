#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"
#include "offload/engine.h"
#include "offload/engine_internal.h"

// Keepers: each save of a storage is a keeper of the storage's entry (made at its first save),
// known by its KeeperId until RemoveKeeper. The entry goes with its last keeper.
namespace spillway {

// `view` by value: it is moved into the entry (clang-tidy 14 misreads that as a const use).
// NOLINTBEGIN(performance-unnecessary-value-param)
std::optional<KeeperId> OffloadEngine::AddKeeper(const void* key,
                                                 const StorageFactory& make_storage, ViewInfo view,
                                                 StreamRef producer,
                                                 std::optional<SaveSettings> settings) {
  // NOLINTEND(performance-unnecessary-value-param)
  if (key == nullptr || !make_storage) {
    throw InvalidArgumentError("OffloadEngine::AddKeeper: key and storage factory must be given");
  }
  EngineLock lock(mutex_);
  const SaveSettings save =
      settings.value_or(SaveSettings{config_.policy == OffloadPolicy::kOff, config_.min_bytes});
  Entry* const entry = EntryForSave(key, make_storage, producer, save);
  if (entry == nullptr) return std::nullopt;
  Entry& e = *entry;
  // Forward's footprint, which adaptive prefetch keeps backward within (the saved bytes are still
  // allocated now: a policy spills them only below).
  DeviceContext& dc = Device(e.device);
  if (dc.read_since_save) dc.saving_high = dc.spilled_high = dc.prefetch_room_taken = 0;
  dc.read_since_save = false;
  dc.saving_high = std::max(dc.saving_high, AllocatedBytes(e.device));
  // Saved before, and other saves since: backward reads it first at this save. Auto's spill order
  // and window take it as new (it kept its first save's place, outside the window, and went
  // first); older keepers keep their seqs, so each backward prefetches from its own save.
  if (e.seq != next_seq_ - 1) Resequence(e);
  // A spill waits for the stream of the latest save: the program wrote the storage there last
  // (the stream of an earlier save, whose graph may be gone, knows nothing of that write), and a
  // race-free program ordered that stream after every earlier write.
  e.producer = producer;
  // Each save follows the block it was saved in: a storage saved in an "off" block (say, nested in
  // an "eager" one) stays on the device after that block ends, too.
  if (save.never_spill) e.saved_under_off = true;
  const KeeperId id = next_keeper_++;
  e.keepers.emplace(id, std::move(view));
  keepers_[id] = Keeper{&e, e.seq};
  ++e.saves[e.seq];
  // (A save of a storage whose bytes are on the host: a backward may read it here too.)
  if (e.state == Residency::kSpilling || e.state == Residency::kSpilled) ListOffloaded(e);
  try {
    RunPolicy();
  } catch (...) {
    RemoveKeeper(id);  // the caller never learns the id: the keeper must not outlive the call
    throw;
  }
  ++stats_.num_keepers;
  return id;
}

OffloadEngine::Entry* OffloadEngine::EntryForSave(const void* key,
                                                  const StorageFactory& make_storage,
                                                  StreamRef producer,
                                                  const SaveSettings& settings) {
  // The storage's binding, kept by its failed entries set aside: a second binding would count the
  // first as a holder, and the new entry would never be spilled.
  std::shared_ptr<Storage> bound;
  if (auto it = entries_.find(key); it != entries_.end()) {
    Entry& current = *it->second;
    // The storage's saved bytes are lost, and it has memory again (resized after a forced
    // release, say): a new save reads that memory. It gets an entry of its own; joined to the
    // failed one, its unpack raised too.
    if (current.state != Residency::kFailed || current.storage->data() == nullptr) return &current;
    bound = current.storage;
    detached_[key].push_back(std::move(it->second));
    entries_.erase(it);
  } else if (auto set_aside = detached_.find(key); set_aside != detached_.end()) {
    bound = set_aside->second.front()->storage;
  }
  std::shared_ptr<Storage> storage = bound != nullptr ? std::move(bound) : make_storage();
  if (storage == nullptr) {
    throw InvalidArgumentError("OffloadEngine::AddKeeper: the storage factory returned null");
  }
  const size_t nbytes = storage->nbytes();
  // (A binding refused goes once the lock is released, as a dropped entry's does.)
  if (nbytes == 0) {
    CountSkip(kSkipEmpty);
    DeferRelease(std::move(storage));
    return nullptr;
  }
  const auto info = allocator_.Lookup(storage->data());
  if (!info || info->ptr != storage->data() || info->requested < nbytes) {
    CountSkip(kSkipForeign);
    DeferRelease(std::move(storage));
    return nullptr;
  }
  auto entry = std::make_unique<Entry>();
  entry->key = key;
  entry->storage = std::move(storage);
  entry->nbytes = nbytes;
  entry->device = info->device;
  entry->producer = producer;
  entry->block_stream = info->stream;
  entry->seq = next_seq_++;
  if (nbytes < settings.min_bytes) {
    entry->policy_refused = true;
    CountSkip(kSkipSmall);
  } else {
    WindowAdd(*entry);
    // A save under "off" is never spilled by a policy (saved_under_off, in AddKeeper).
    if (!settings.never_spill) spill_candidates_[entry->seq] = entry.get();
  }
  by_seq_[entry->seq] = entry.get();
  ++stats_.num_entries;
  return entries_.emplace(key, std::move(entry)).first->second.get();
}

void OffloadEngine::Resequence(Entry& e) {
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

const OffloadEngine::Keeper& OffloadEngine::KeeperOf(KeeperId id) const {
  auto it = keepers_.find(id);
  if (it == keepers_.end()) {
    throw InvalidArgumentError(absl::StrFormat(
        "offload keeper %d is not registered (released already, or never added)", id));
  }
  return it->second;
}

std::shared_ptr<Storage> OffloadEngine::StorageOf(KeeperId id) const {
  EngineLock lock(mutex_);
  auto it = keepers_.find(id);
  return it == keepers_.end() ? nullptr : it->second.entry->storage;
}

void OffloadEngine::RemoveKeeper(KeeperId id) {
  EngineLock lock(mutex_);
  const Keeper keeper = KeeperOf(id);
  Entry& e = *keeper.entry;
  keepers_.erase(id);
  e.keepers.erase(id);
  // A save whose keepers are all gone is read by nobody: prefetch must not bring the storage back
  // for it.
  if (const auto save = e.saves.find(keeper.save_seq);
      save != e.saves.end() && --save->second == 0) {
    e.saves.erase(save);
    UnlistOffloadedAt(e, keeper.save_seq);
  }
  if (e.keepers.empty()) Drop(e);
}

void OffloadEngine::ListOffloaded(Entry& e) {
  for (const auto& [seq, count] : e.saves) offloaded_[seq] = &e;
}

void OffloadEngine::UnlistOffloadedAt(const Entry& e, uint64_t seq) {
  // Seqs are never reused, so a listing there is `e`'s; checked all the same, as a dangling
  // listing would be read after `e` is freed.
  if (const auto it = offloaded_.find(seq); it != offloaded_.end() && it->second == &e) {
    offloaded_.erase(it);
  }
}

}  // namespace spillway
