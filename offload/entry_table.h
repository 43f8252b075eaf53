// The offload engine's bookkeeping: one entry per storage, the keepers (saved views) registered on
// it, and the indices by save order that the policies walk. No I/O: nothing here calls a backend,
// an allocator, a copy or Python; an entry's storage is only read (its pointer and holders, for
// descriptions), and the table never lets go of one itself (Erase hands the entry back, and the
// engine releases its storage outside its lock).
//
// Invariants:
// - every entry is in exactly one of `entries_` (the storage's current entry, by key) and
//   `detached_` (failed entries set aside for their keepers when the storage was saved anew);
// - `by_seq_` holds every entry once, at its seq; seqs are never reused;
// - a keeper names a live entry, and the entry lists it; an entry with no keeper is erased by the
//   engine in the same call that removed its last keeper;
// - `spill_candidates_` and `offloaded_` are subsets of the entries, pruned lazily by the walks
//   that find an entry no longer belongs (their owners say when: MaySpill, residency);
// - a device's window holds the newest entries of at least the min_bytes of their save whose bytes
//   add up to at most the window limit.
//
// Threads: none of its own. The engine's lock guards the table; since nothing in it calls out, no
// other lock is ever taken under that lock from here.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "allocator/backend.h"
#include "offload/storage.h"

namespace spillway {

enum class Residency { kResident, kSpilling, kSpilled, kReloading, kFailed };
std::string_view ResidencyName(Residency residency);

using KeeperId = uint64_t;

// What `Keepers()` reports per registered saved view.
struct KeeperInfo {
  KeeperId id = 0;
  ViewInfo view;
  // Its entry's bytes are lost (kFailed: released by force, or a copy failed): its Acquire
  // throws. It still keeps the storage.
  bool lost = false;
};

struct EntryInfo {
  const void* key = nullptr;
  void* data = nullptr;  // current device pointer; null while spilled
  size_t nbytes = 0;
  int device = 0;
  Residency residency = Residency::kResident;
  // Brought back ahead of use and not read yet: it keeps its host copy until read (or given back),
  // unless it was taken back while its spill was still copying (then it has none).
  bool prefetched = false;
  // It holds a pinned host copy (spilling, spilled, reloading, or a prefetch not read yet).
  bool host_copy = false;
  int64_t external_holders = 0;
  std::vector<KeeperInfo> keepers;
  int64_t spill_count = 0;
  int64_t reload_count = 0;
  int64_t last_spill_us = 0;   // wall time of the latest spill start, 0 if never
  int64_t last_reload_us = 0;  // wall time of the latest reload start, 0 if never
};

// One storage under the engine: its residency and copies. The table owns where it is listed; the
// engine owns its residency fields (state, host, copies), the copy engine none of it.
struct Entry {
  const void* key = nullptr;
  std::shared_ptr<Storage> storage;
  size_t nbytes = 0;
  int device = 0;
  StreamRef producer;
  uint64_t seq = 0;
  // The seq of each save with keepers still registered, and how many: where a backward may read
  // the storage (a storage saved by two graphs alive at once is read at both saves), so where
  // the offloaded index lists it for prefetch.
  absl::flat_hash_map<uint64_t, int> saves;
  Residency state = Residency::kResident;
  absl::flat_hash_map<KeeperId, ViewInfo> keepers;
  void* host = nullptr;  // pinned copy: spilling, spilled, reloading, or prefetched and unused
  EventHandle copy_done = nullptr;  // the latest D2H or H2D copy of this entry
  StreamRef block_stream;           // allocation stream of the current device block
  bool acquired = false;            // handed to a consumer since its last spill
  bool prefetched = false;          // reloaded ahead of use, not yet acquired
  bool acquiring = false;           // inside Acquire: its own prefetch must not spill it
  bool policy_refused = false;      // a spill was refused for a reason that will not change
  bool saved_under_off = false;     // saved in an "off" block: never spilled, whatever comes later
  // Saved while a backward that reads it ran (SavePhase::kBackward): no policy spills it, the
  // out-of-memory rescue may (a recomputation that does not fit otherwise). Whatever comes later.
  bool saved_in_backward = false;
  // The forward of the entry's latest save (OffloadEngine's count, per device): eager's bound on
  // a forward's spills is on that forward's saves (ForwardSpillQuota).
  uint64_t forward = 0;
  // policy_refused covers saves below the min_bytes in force when they were saved, too.
  // Its memory is being allocated for a reload with the engine's lock released (see
  // OffloadEngine::Reload): nothing else reloads or drops it, or reads its storage's pointer.
  bool allocating = false;
  // The reason of the last refused spill, counted when it was refused; cleared by a spill, so
  // that a refusal after one counts again.
  std::string_view skipped_for;
  // A consumer waits since then (none: nobody waits). A steady clock: stall_us is a duration, and
  // a wall-clock step while backward waited would count it wrong (negative, even).
  std::optional<std::chrono::steady_clock::time_point> stall_since;
  std::string failure;  // why the bytes are lost (state kFailed)
  // Reloaded while still spilling: the D2H copy the reload reads from, until seen complete. Its
  // failure fails the entry although it is reloading by then (FailInFlight).
  EventHandle spill_done = nullptr;
  // The device block the latest spill gave up and the allocator's tag of that allocation
  // (CachingAllocator::TagForRevival); the allocator keeps the block from reuse until the copy
  // has read it. Backward asking for the storage before then takes it back rather than reloading
  // it (OffloadEngine::TakeBack). Read only while the entry is spilling (that spill's).
  void* spilled_block = nullptr;
  uint64_t spilled_tag = 0;
  // How many stream errors the device's allocator had found (CachingAllocator::StreamErrorsFound)
  // just before the latest copy (and the spill_done copy) was enqueued: a failure it found
  // later, and passed on, may be that copy's; one it found before was an earlier copy's.
  uint64_t errors_found_before_copy = 0;
  uint64_t errors_found_before_spill = 0;
  // kFailed: the state the failure interrupted, so that dropping the entry still orders reuse of
  // its block and host buffer after a copy that may be running (FailInFlight fails every copy in
  // flight in one direction, the healthy ones too).
  Residency failed_while = Residency::kResident;
  int64_t spill_count = 0;
  int64_t reload_count = 0;
  int64_t last_spill_us = 0;
  int64_t last_reload_us = 0;
};

// A registered keeper: its entry, and the seq of the save that made it (the entry's seq then; a
// later save of the storage moves the entry to a new seq, see Resequence). Backward reads the
// storage at this save: prefetch goes on from the save being read.
struct Keeper {
  Entry* entry = nullptr;
  uint64_t save_seq = 0;
};

class EntryTable {
 public:
  explicit EntryTable(size_t device_count) : windows_(device_count) {}

  // The storage's current entry, or null.
  Entry* Current(const void* key) const;
  // The failed entries of `key` set aside for their keepers (oldest first), or null when none.
  const std::vector<std::unique_ptr<Entry>>* SetAside(const void* key) const;
  // Sets the storage's current entry aside (it failed, and the storage is saved anew).
  void SetAsideCurrent(const void* key);
  // Makes `entry` the current entry of its key, at the next seq. `sized`: it joins its device's
  // window; `candidate`: a policy may spill it.
  Entry& Insert(std::unique_ptr<Entry> entry, bool sized, bool candidate);
  // Takes `e` out of every map and index; the caller destroys it (its storage outside the lock).
  std::unique_ptr<Entry> Erase(Entry& e);
  // Every entry, set-aside ones included, taken out of the table (the engine's destructor).
  std::vector<std::unique_ptr<Entry>> TakeAll();

  KeeperId AddKeeper(Entry& e, ViewInfo&& view);
  // The keeper `id`, or InvalidArgumentError when it is not registered.
  const Keeper& KeeperOf(KeeperId id) const;
  const Keeper* FindKeeper(KeeperId id) const;
  // Unregisters `id`; a save left with no keeper leaves the offloaded index. Returns its entry
  // when that has no keeper left (the caller erases it), else null.
  Entry* RemoveKeeper(KeeperId id);

  // Gives `e` the next seq (a save of it after others), in every index keyed by the entry's seq
  // (not the offloaded index, whose listings are per save).
  void Resequence(Entry& e);
  uint64_t next_seq() const { return next_seq_; }
  // Every entry, oldest save first. A walk may change entries, not the map (no insert or erase).
  const absl::btree_map<uint64_t, Entry*>& InSaveOrder() const { return by_seq_; }

  // Entries whose bytes went to the host, listed at each of their live saves: what prefetch can
  // bring back (a backward reads a storage at the save its graph made).
  void ListOffloaded(Entry& e);
  // The newest listing older than `*cursor`, its seq put in `*cursor`; null when none is left.
  Entry* OffloadedBefore(uint64_t* cursor) const;
  // The entry saved at `seq`: the one whose latest save it is, or one offloaded and listed there (a
  // storage saved again since keeps its older saves' listings); null when neither.
  Entry* SavedAt(uint64_t seq) const;
  void UnlistOffloaded(uint64_t seq) { offloaded_.erase(seq); }

  // Calls `visit(entry)` for the spill candidates older than `before_seq`, oldest first, dropping
  // those for which `may_spill` is false; stops when `visit` returns false. By seq cursor: a visit
  // may spill, and a spill may run the rescue, which changes the candidates.
  template <typename MaySpill, typename Visit>
  void VisitSpillCandidates(uint64_t before_seq, MaySpill may_spill, Visit visit) {
    for (auto it = spill_candidates_.begin();
         it != spill_candidates_.end() && it->first < before_seq;) {
      const uint64_t seq = it->first;
      Entry& e = *it->second;
      if (!may_spill(e)) {
        spill_candidates_.erase(seq);
      } else if (!visit(e)) {
        return;
      }
      it = spill_candidates_.upper_bound(seq);
    }
  }

  // The prefetch window (what `auto` keeps resident for backward): its bytes, from now on.
  void SetWindowLimit(size_t bytes);
  // The seq of the oldest entry in `device`'s window; next_seq() when it is empty.
  uint64_t WindowStart(int device) const;
  // `e` is never read again (its storage was released): its bytes leave its device's window.
  void LeaveWindow(const Entry& e) { WindowRemove(e); }
  const void* WindowOldestKey(int device) const;

  // The storage `key` (see OffloadEngine::Describe), the entry of keeper `id`, and the key of
  // every storage, once, oldest save first.
  std::optional<EntryInfo> Describe(const void* key) const;
  std::optional<EntryInfo> DescribeKeeper(KeeperId id) const;
  std::vector<const void*> Keys() const;
  static EntryInfo DescribeEntry(const Entry& e);

 private:
  struct Window {
    static constexpr uint64_t kEmpty = std::numeric_limits<uint64_t>::max();
    absl::btree_map<uint64_t, Entry*> sized;  // the device's entries of at least min_bytes
    uint64_t start = kEmpty;                  // seq of the oldest entry in the window
    size_t bytes = 0;                         // bytes of the entries in the window
  };
  void WindowAdd(Entry& e);
  void WindowRemove(const Entry& e);
  // Takes in older entries while they fit (after the window lost bytes, or from nothing).
  void WindowExtend(Window& w) const;

  absl::flat_hash_map<const void*, std::unique_ptr<Entry>> entries_;
  // Per storage key, failed entries (bytes lost) set aside when the storage was saved again after
  // it was given memory again (resized after a forced release, say): the new save has an entry of
  // its own in entries_, and these live on for their keepers, whose unpack raises, until those go.
  absl::flat_hash_map<const void*, std::vector<std::unique_ptr<Entry>>> detached_;
  absl::flat_hash_map<KeeperId, Keeper> keepers_;
  absl::btree_map<uint64_t, Entry*> by_seq_;  // save order
  // Parts of by_seq_, so that what runs at every save or unpack visits only entries it may act
  // on (a walk over all of them made a long graph's bookkeeping quadratic).
  absl::btree_map<uint64_t, Entry*> spill_candidates_;
  absl::btree_map<uint64_t, Entry*> offloaded_;
  // Per device: every budget check needs the window, so it follows the entries as they come and
  // go rather than be summed again each time.
  std::vector<Window> windows_;
  size_t window_limit_ = 0;
  uint64_t next_seq_ = 1;
  KeeperId next_keeper_ = 1;
};

}  // namespace spillway
