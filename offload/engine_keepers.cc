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
                                                 std::optional<SaveSettings> settings,
                                                 SavePhase phase) {
  // NOLINTEND(performance-unnecessary-value-param)
  if (key == nullptr || !make_storage) {
    throw InvalidArgumentError("OffloadEngine::AddKeeper: key and storage factory must be given");
  }
  EngineLock lock(mutex_, this);
  const SaveSettings save =
      settings.value_or(SaveSettings{config_.policy == OffloadPolicy::kOff, config_.min_bytes});
  const bool in_backward = phase == SavePhase::kBackward;
  const uint64_t seq_before = table_.next_seq();
  Entry* const entry = EntryForSave(key, make_storage, producer, save, in_backward);
  if (entry == nullptr) return std::nullopt;
  Entry& e = *entry;
  DeviceState& state = State(e.device);
  if (!in_backward) {
    // Forward's footprint, which adaptive prefetch keeps backward within (the saved bytes are
    // still allocated now: a policy spills them only below).
    const size_t allocated = AllocatedBytes(e.device);
    const auto spilled = static_cast<size_t>(state.spilled_bytes);
    if (state.footprint.OnSave(allocated)) {
      state.quota.OnForwardStart();
      // (The budget is asked for only under auto: on CUDA the query makes the device's context.)
      if (config_.policy == OffloadPolicy::kAuto) {
        state.ahead.OnForwardStart(BudgetTarget(BudgetLocked(e.device)), allocated, spilled);
      }
      ++state.forward;
    }
    state.ahead.OnSave(allocated, spilled);
    // The forward the save is of, for eager's bound (ForwardSpillQuota).
    e.forward = state.forward;
    state.quota.OnSave();
  }
  if (!state.saved_on) {
    state.saved_on = true;
    ++saving_devices_;
  }
  // Saved before, and other saves since: backward reads it first at this save. Auto's spill order
  // and window take it as new (it kept its first save's place, outside the window, and went
  // first); older keepers keep their seqs, so each backward prefetches from its own save. (A
  // backward's save of a forward's storage is no forward's: the entry keeps its place.)
  if (!in_backward && e.seq != table_.next_seq() - 1) table_.Resequence(e);
  if (table_.next_seq() != seq_before) jumps_.OnSave(e.seq, e.nbytes, !in_backward);
  // A spill waits for the stream of the latest save: the program wrote the storage there last
  // (the stream of an earlier save, whose graph may be gone, knows nothing of that write), and a
  // race-free program ordered that stream after every earlier write.
  e.producer = producer;
  // Each save follows the block it was saved in: a storage saved in an "off" block (say, nested in
  // an "eager" one) stays on the device after that block ends, too; so does one saved while a
  // backward ran (from policies, not from the rescue), whatever later saves of it say.
  if (save.never_spill) e.saved_under_off = true;
  if (in_backward) {
    // Counted where it keeps a storage on the device: not for a forward's save that was spilled
    // and read back before backward saved it again (a reentrant region's input).
    if (!e.saved_in_backward && !e.policy_refused && e.spill_count == 0) {
      CountSkipOf(e, kSkipBackward);
    }
    e.saved_in_backward = true;
  }
  const KeeperId id = table_.AddKeeper(e, std::move(view));
  // (A save of a storage whose bytes are on the host: a backward may read it here too.)
  if (e.state == Residency::kSpilling || e.state == Residency::kSpilled) table_.ListOffloaded(e);
  try {
    // A policy has nothing to do at a backward's save: no policy spills it, and what it would
    // spill now (auto's spills ahead of the forward backward is reading) waits for the next
    // forward.
    if (!in_backward) RunPolicyLocked();
  } catch (...) {
    RemoveKeeperLocked(id);  // the caller never learns the id: the keeper must not outlive it
    throw;
  }
  ++stats_.num_keepers;
  return id;
}

Entry* OffloadEngine::EntryForSave(const void* key, const StorageFactory& make_storage,
                                   StreamRef producer, const SaveSettings& settings,
                                   bool in_backward) {
  // The storage's binding, kept by its failed entries set aside: a second binding would count the
  // first as a holder, and the new entry would never be spilled.
  std::shared_ptr<Storage> bound;
  if (Entry* const current = table_.Current(key); current != nullptr) {
    // The storage's saved bytes are lost, and it has memory again (resized after a forced
    // release, say): a new save reads that memory. It gets an entry of its own; joined to the
    // failed one, its unpack raised too.
    // (An entry being reloaded, `allocating`, has no pointer to read yet: it is joined.)
    if (current->state != Residency::kFailed || current->allocating ||
        current->storage->data() == nullptr) {
      return current;
    }
    bound = current->storage;
    table_.SetAsideCurrent(key);
  } else if (const auto* set_aside = table_.SetAside(key); set_aside != nullptr) {
    bound = set_aside->front()->storage;
  }
  std::shared_ptr<Storage> storage = bound != nullptr ? std::move(bound) : make_storage();
  if (storage == nullptr) {
    throw InvalidArgumentError("OffloadEngine::AddKeeper: the storage factory returned null");
  }
  const size_t nbytes = storage->nbytes();
  // (A binding refused goes once the lock is released, as a dropped entry's does.)
  if (nbytes == 0) {
    CountSkipLocked(kSkipEmpty);
    DeferRelease(std::move(storage));
    return nullptr;
  }
  const auto info = allocator_.Lookup(storage->data());
  if (!info || info->ptr != storage->data() || info->requested < nbytes) {
    CountSkipLocked(kSkipForeign);
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
  const bool sized = nbytes >= settings.min_bytes;
  if (!sized) {
    entry->policy_refused = true;
    CountSkipLocked(kSkipSmall);
  }
  ++stats_.num_entries;
  // A save under "off" is never spilled by a policy (saved_under_off, in AddKeeper), nor one of
  // backward (saved_in_backward), which is no forward's saves' either: not in the prefetch window
  // `auto` keeps for the forward's newest.
  return &table_.Insert(std::move(entry), sized && !in_backward,
                        sized && !settings.never_spill && !in_backward);
}

std::shared_ptr<Storage> OffloadEngine::StorageOf(KeeperId id) const {
  EngineLock lock(mutex_, this);
  const Keeper* keeper = table_.FindKeeper(id);
  return keeper == nullptr ? nullptr : keeper->entry->storage;
}

void OffloadEngine::RemoveKeeper(KeeperId id) {
  EngineLock lock(mutex_, this);
  RemoveKeeperLocked(id);
}

void OffloadEngine::RemoveKeeperLocked(KeeperId id) {
  Entry* const unkept = table_.RemoveKeeper(id);
  if (unkept == nullptr) return;
  // A thread allocating the entry's memory with the lock released drops it when it comes back
  // (FinishAllocation): the entry must outlive that allocation.
  if (unkept->allocating) return;
  Drop(*unkept);
}

}  // namespace spillway
