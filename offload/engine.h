// The offload engine: moves a storage's bytes to pinned host memory and back without any of its
// views noticing.
//
// One entry per storage (never per view), identified by the storage object the caller registers.
// An entry's keepers are the saved views registered on it; the storage is eligible to spill only
// when nothing but those keepers holds it (`Storage::external_holders() == 0`).
//
// Residency: resident -> spilling (D2H in flight) -> spilled -> reloading (H2D in flight) ->
// resident; an entry is dropped from any state when its last keeper goes. Transitions that wait
// on a copy are observed lazily (the engine queries events; it never blocks the host except in
// the out-of-memory rescue, which must hand memory back before the allocator retries).
//
// Streams (per device, owned by the engine): spill = event on the producer stream -> D2H stream
// waits -> copy -> copy-done event -> the device block goes back to the allocator with reuse
// deferred until copy-done (record_stream once, then free). Reload = block allocated on the
// consumer stream -> event there -> H2D stream waits -> copy -> reload-done -> consumer waits.
//
// Policies: `eager` spills every eligible entry at the next save or at the end of forward, oldest
// first, up to what the link carried before backward in the run of that forward before
// (ForwardSpillQuota); `auto` holds allocated device bytes under its budget: the allocator calls
// the engine before an allocation that would pass the budget
// (CachingAllocator::SetPressureHandler), and the engine gives back prefetches nobody read yet,
// then spills the oldest eligible entries outside the prefetch window, until that allocation
// fits. Backward prefetches ahead of each read: a fixed window, or by default an adaptive depth
// (OffloadConfig::prefetch_bytes, Prefetch).
//
// Composed of three parts with one job each: the entry table (entries, keepers, the indices by
// save order: offload/entry_table.h), the copy engine (streams, events, the pinned pool, copies
// and the direction of their failures: offload/copy_engine.h) and the policies, which return
// plans (offload/policy.h). The engine itself carries the plans out and moves entries through
// their residency (engine.cc), attributes copy failures to entries (engine_failures.cc), and
// answers for what it holds (engine_info.cc).
//
// Thread-safe: one plain mutex (EngineLock, engine_internal.h) guards all three parts, never
// taken twice by one thread. Nothing the engine calls under it takes it again: device memory for
// a reload or a prefetch is allocated with it released (Reload; the entry is marked `allocating`
// meanwhile), so the allocator's budget handler (OnPressure) and out-of-memory rescue
// (ReleaseMemory) that allocation may run take it as any other caller does; the table calls
// nothing, the copy engine only the backend and the pinned pool, and the policies are pure. The
// one call that comes back on the same thread is the allocator passing on a copy failure it heard
// in a call the engine made under the lock (a free, a wait, TakeHeardFailures): OnStreamError
// acts on it under the hold the thread has. Lock order: the GIL (when the caller holds it), the
// engine's lock, an allocator's lock, the pinned pool's, the backend's. Nothing under the engine's
// lock waits for the GIL, nor does a reload's allocation made with it released (see EngineLock).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "allocator/config.h"
#include "allocator/errors.h"
#include "offload/backward_jumps.h"
#include "offload/copy_engine.h"
#include "offload/entry_table.h"
#include "offload/offload_stats.h"
#include "offload/policy.h"
#include "offload/storage.h"

namespace spillway {

// One change of spilled bytes, for timelines (spillway.report).
struct OffloadEvent {
  enum class Kind { kSpill, kReload, kDropSpilled, kFailed, kPrefetchGivenBack, kTakenBack };
  int64_t time_us = 0;
  Kind kind = Kind::kSpill;
  int device = 0;
  const void* key = nullptr;
  size_t bytes = 0;
};
std::string_view OffloadEventName(OffloadEvent::Kind kind);

// What one save asks of the engine: the settings of the offload block it was saved in, which
// another thread's block may have replaced in the engine's configuration since.
struct SaveSettings {
  bool never_spill = false;  // saved under "off": stays on the device, whatever comes later
  size_t min_bytes = 0;      // a storage smaller than this at its first save is never spilled
};

// When a save is made. kBackward: while a backward runs that reads it before it ends (a reentrant
// checkpoint's recomputation: the hooks layer asks autograd, and takes a backward that keeps its
// graph, as create_graph does, for a forward, since a later backward may read what it saves).
// Spilling such a save would cost a copy each way for nothing (a reentrant checkpoint's
// recomputations under eager moved 5.3x what its forward spilled, 2026-12-07). So no policy
// spills it (the out-of-memory rescue may: a recomputation that does not fit otherwise), nor does
// the save run a policy; it is counted once as skipped for "backward" where it keeps a storage on
// the device. And it is no forward's: it neither begins a forward nor counts in one (the
// footprint adaptive prefetch keeps to, eager's bound, auto's spills ahead and its window).
enum class SavePhase { kForward, kBackward };

class EngineLock;  // engine_internal.h

class OffloadEngine {
 public:
  // Registers itself with `allocator` for the out-of-memory rescue and the budget watermark.
  OffloadEngine(CachingAllocator& allocator, const OffloadConfig& config);
  ~OffloadEngine();
  OffloadEngine(const OffloadEngine&) = delete;
  OffloadEngine& operator=(const OffloadEngine&) = delete;

  // Registers a saved view of a storage, produced on `producer`. `key` identifies the storage
  // (the caller's storage object); it stays unique while the entry lives because the entry keeps
  // the storage alive. `make_storage` is called only when the storage has no entry yet, so one
  // binding serves every view. Returns nullopt, counting the reason, for a storage the engine
  // will not manage (zero bytes, not allocated by Spillway). `settings`: the save's own (see
  // SaveSettings); without them, the configuration's policy ("off" or not) and min_bytes. `phase`:
  // when the save was made (SavePhase). Runs the policy afterwards; should that throw (a
  // ProgramStreamError), the keeper is not registered.
  using StorageFactory = std::function<std::shared_ptr<Storage>()>;
  std::optional<KeeperId> AddKeeper(const void* key, const StorageFactory& make_storage,
                                    ViewInfo view, StreamRef producer,
                                    std::optional<SaveSettings> settings = std::nullopt,
                                    SavePhase phase = SavePhase::kForward);
  // The storage a keeper keeps (to rebuild its view), or null for an unknown keeper.
  std::shared_ptr<Storage> StorageOf(KeeperId id) const;
  // Blocks the host until the copies in flight for the keeper's storage are done: for consumers
  // that are host code (the simulated device's CPU kernels), which no stream wait can order. Call
  // it after Acquire: it brings nothing back itself (a spilled storage stays spilled). Throws
  // spillway::Error, as Acquire does, when the copy failed.
  void WaitResident(KeeperId id);
  // The saved view is gone. The last keeper drops the entry and any host copy.
  void RemoveKeeper(KeeperId id);
  // The program freed the storage behind `key` while views saved of it remain (a forced
  // release): any host copy goes, nothing reloads it, and Acquire fails naming `why`. Call it
  // before the storage lets go of its device memory: a reload still writing it is waited for.
  void MarkReleased(const void* key, const std::string& why);
  // Makes the storage resident and orders `consumer` after its reload; returns its device
  // pointer. Throws spillway::Error when the bytes cannot be brought back: OutOfMemoryError
  // leaves the entry spilled, so a later call may succeed; a failed copy fails the entry for good
  // (every reload in flight on that copy stream, prefetches included, since the backend does not
  // say which copy failed), and each later call says so.
  void* Acquire(KeeperId id, StreamRef consumer);

  // Phase signal from the hooks: forward ended (eager spills everything eligible). Backward needs
  // none: each Acquire prefetches the saves older than its own, which backward reads next (and
  // never the newer saves of another graph, whose backward may come later or never).
  void ForwardEnd();
  // Runs the spill policy now (the hooks call it after each save).
  void RunPolicy();
  // Out-of-memory rescue: gives back prefetches nobody used yet (no copy: their host copies are
  // kept until use), then, except under "off", spills eligible entries on `device`, oldest first,
  // waiting for their copies, until `bytes` were released or nothing is left. Nothing for an
  // allocation of the engine's own prefetch (a guess that stops instead). Returns the bytes
  // released.
  size_t ReleaseMemory(int device, size_t bytes);
  // Waits for every copy in flight and settles the states; device blocks the spills gave back are
  // free when it returns.
  void Synchronize();
  // Gives every wholly free pinned host chunk back (what spilled data no longer uses): part of
  // spillway.empty_cache().
  void TrimHostMemory();
  // The pinned host pools' history (PinnedPool::RecordHistory; the pools of devices started
  // later record too), and what snapshots show of them: PyTorch's host_segments and host_traces.
  void RecordHostHistory(bool enabled, size_t max_entries);
  bool host_history_enabled() const;
  std::vector<SegmentSnapshot> HostSegments() const;
  std::vector<TraceEntry> HostHistory() const;

  void SetConfig(const OffloadConfig& config);
  OffloadConfig config() const;

  // The storage `key`: its entry, with the keepers of the failed entries a new save set aside
  // (lost, and still keeping the storage) among its keepers. Without an entry of its own, the
  // newest of those, with all their keepers. Null when nothing keeps it.
  std::optional<EntryInfo> Describe(const void* key) const;
  // The entry of keeper `id` alone (one set aside included); null when `id` is not registered.
  std::optional<EntryInfo> DescribeKeeper(KeeperId id) const;
  // The key of every storage Describe finds, once, oldest save first (a storage kept only by
  // entries set aside at the place of the newest).
  std::vector<const void*> EntryKeys() const;
  void CountSkip(std::string_view reason);
  // The latest spills, reloads and drops of spilled entries (a bounded ring), oldest first.
  std::vector<OffloadEvent> Events() const;
  // Makes `reason` appear in the statistics (at 0) before it is first counted.
  void DeclareSkipReason(std::string_view reason);
  OffloadStats stats() const;
  void ResetPeakStats();
  size_t budget_bytes(int device) const;
  // Bytes of `device`'s entries spilling or spilled: its part of stats().spilled_bytes.
  size_t spilled_bytes(int device) const;

  // True while the calling thread is inside the engine (holding its lock). Hooks that would take
  // other locks on allocation (the Python stack gatherer takes the GIL) skip their work then.
  static bool InsideEngineOnThisThread();

  // Testing only: skips the consumer's wait on reload-done, the one wait whose absence corrupts
  // data silently. The integrity tests turn it on to prove they catch it.
  void set_skip_consumer_wait_for_testing(bool skip) { skip_consumer_wait_ = skip; }
  // Testing only: reloads a storage still spilling after its copy to the host, as when the
  // allocator cannot give its block back (TakeBack refused), so that tests reach that path.
  void set_take_back_for_testing(bool take_back) { take_back_ = take_back; }
  // Testing only: the engine's copy streams on `device`, so a test can hold or watch them.
  StreamRef h2d_stream_for_testing(int device);
  StreamRef d2h_stream_for_testing(int device);
  // Testing only: the key of the oldest entry in `device`'s prefetch window (null when empty).
  const void* window_oldest_for_testing(int device) const;

 private:
  // Per device, the engine's own numbers (the streams and pool are the copy engine's).
  struct DeviceState {
    size_t prefetched_bytes = 0;  // reloaded ahead of use, not yet acquired
    int64_t spilled_bytes = 0;    // see spilled_bytes(device)
    ForwardFootprint footprint;   // what adaptive prefetch knows of the latest forward
    ForwardSpillQuota quota;      // how many bytes of a forward eager spills
    ForwardSpillAhead ahead;      // how many bytes of a forward auto spills as it saves them
    size_t reloading_bytes = 0;   // spilled saves whose reload is allocating (still spilled)
    uint64_t forward = 1;         // forwards begun (a save after a read begins one)
    bool saved_on = false;        // a save was made on the device
  };
  DeviceState& State(int device) { return devices_[static_cast<size_t>(device)]; }

  // The unlocked bodies of public calls that other calls make under the lock.
  // `forward_end`: called at the end of a forward (eager keeps or spills there what its bound
  // deferred, see ForwardSpillQuota), else after a save.
  void RunPolicyLocked(bool forward_end = false);
  void RemoveKeeperLocked(KeeperId id);
  void CountSkipLocked(std::string_view reason);
  void SynchronizeLocked();
  size_t BudgetLocked(int device) const;

  // -- Registration (engine_keepers.cc)
  // The entry a save of `key` joins: the storage's, or a new one (a failed entry whose storage
  // has memory again is set aside). Null when the engine cannot keep the storage (empty, or not
  // a whole block of its allocator), counted as a skip.
  Entry* EntryForSave(const void* key, const StorageFactory& make_storage, StreamRef producer,
                      const SaveSettings& settings, bool in_backward);
  Entry& EntryOf(KeeperId id) const { return *table_.KeeperOf(id).entry; }
  // Takes `e` out of the table with its copies; its storage goes once no engine lock is held.
  void Drop(Entry& e);

  // -- Residency and copies (engine.cc)
  // Settles a spilling or reloading entry whose copy has completed; with `wait`, blocks the host
  // until it has. A failed copy makes the entry kFailed.
  void Refresh(Entry& e, bool wait = false);
  // Counts a stall on `e` (backward waits for its reload) and when it began, once per reload.
  void StartStall(Entry& e);
  // Throws the error of an entry whose bytes are lost (kFailed).
  [[noreturn]] static void ThrowLost(const Entry& e);
  bool Eligible(const Entry& e) const;
  // Whether a policy may still spill `e` some day (it may be held by the program now). A spill
  // makes it false, and a storage that came back is marked acquired or prefetched, so it stays
  // false: a policy never spills a storage twice (the out-of-memory rescue may).
  static bool PolicyMaySpill(const Entry& e);
  // Ends `e`'s being a prefetch (acquired, given back, failed or dropped); false if it was none.
  bool EndPrefetch(Entry& e);
  enum class SpillOutcome { kSpilled, kRefused, kNoHostMemory };
  struct SpillResult {
    // kNoHostMemory: no pinned buffer of the entry's size (host_limit_mb reached, or pinning
    // failed): no entry of the device as large can be spilled in this pass either.
    SpillOutcome outcome = SpillOutcome::kRefused;
    size_t block_bytes = 0;  // kSpilled: the size of the block given back (rounded)
  };
  SpillResult Spill(Entry& e);
  // Brings a spilled (or spilling) entry back on `consumer`: its memory allocated with the lock
  // released, then its copy issued. A prefetch's allocation is speculative. False when the entry
  // went meanwhile (a prefetch's: its last keeper went on another thread); throws as Acquire.
  bool Reload(EngineLock& lock, Entry& e, StreamRef consumer, bool prefetch);
  // A spill whose copy to the host has not finished (as Refresh found under this hold of the
  // lock) is wanted back: its device block, which the allocator cannot reuse before that copy
  // has read it, becomes the storage's memory again, and the entry is resident with no copy at
  // all (the copy runs on, into a host buffer freed after it). Without this, backward's first
  // reads wait for the whole queue of copies to the host and then copy the bytes back: a round
  // trip. False when the allocator no longer has the block to give (then Reload copies).
  bool TakeBack(Entry& e);
  void IssueReload(Entry& e, void* ptr, StreamRef consumer);
  // Gives up the entry's host copy and any copy in flight (the storage keeps its device memory).
  void DiscardCopies(Entry& e);
  void ReleaseHost(Entry& e, std::optional<StreamRef> last_use);
  // Counts `reason` for `e` unless it was the last reason counted for it: a policy may ask
  // again at every allocation.
  void CountSkipOf(Entry& e, std::string_view reason);
  // Counts `e`'s bytes into (or, `spilled` false, out of) the spilled bytes, overall and of its
  // device.
  void CountSpilled(const Entry& e, bool spilled);
  void Note(OffloadEvent::Kind kind, const Entry& e);

  // -- Copy failures (engine_failures.cc)
  // Whether `copy` (of `e`, in `direction`) has completed; a failure it reports fails the entries
  // in flight in that direction (FailInFlight) and counts as not done. Before it trusts a
  // completed copy it takes the failures the allocator heard (TakeHeardFailures): false if they
  // failed `e`.
  bool CopyDone(Entry& e, EventHandle copy, Residency direction, bool wait);
  // Has the allocator pass on, now, the copy-stream failures of `device` it heard and has not
  // passed on yet (OnStreamError). Called before copies are issued, which a failure heard
  // earlier must not fail, and before a completed copy is trusted.
  void TakeHeardFailures(int device);
  void MarkFailed(Entry& e, const std::string& why);
  // Fails the entries whose copy is in flight in direction `in_flight` on `device`. A failure the
  // device's allocator found (`found_seq`, its StreamError::seq) spares the copies enqueued
  // after it was found: it belongs to an earlier one.
  void FailInFlight(int device, Residency in_flight, const std::string& why,
                    std::optional<uint64_t> found_seq = std::nullopt);
  // The allocator's stream-error observer: takes the lock, unless this thread holds it already
  // (the error was heard in an allocator call the engine made under it), then ActOnStreamError.
  void OnStreamError(const StreamError& error);
  void ActOnStreamError(const StreamError& error);

  // -- Carrying out the policies' plans (engine_policy.cc)
  // Carries `plan` out on `device`, or on every device (kAllDevices, for a plan that gives back no
  // prefetch and spills every eligible save: eager's). Returns the block bytes released.
  static constexpr int kAllDevices = -1;
  size_t Carry(const SpillPlan& plan, int device);
  // One pass of a policy's spills. Once no pinned buffer of some size was to be had, larger
  // entries are not tried again in the pass: each try would cost a pinned allocation, at every
  // allocation (auto) or save (eager) the policy runs for. Such refusals are not for good: the
  // next pass tries again (host memory comes back as spilled entries are read or dropped).
  struct SpillPass {
    size_t no_host_from = std::numeric_limits<size_t>::max();
    std::string_view no_host_reason;
    size_t released = 0;  // block bytes given back
  };
  void SpillInPass(Entry& e, SpillPass& pass);
  // Turns prefetches nobody acquired yet back into spilled entries (their host copies are still
  // there), oldest first, until allocated bytes reach `target_allocated`. Returns the bytes
  // released.
  size_t GiveBackPrefetches(int device, size_t target_allocated);
  // `auto`'s budget with `incoming_bytes` about to be allocated (PlanBudget), carried out.
  void SpillToBudget(int device, size_t incoming_bytes);
  // `auto` after a save: the saves of the device's forward it spills ahead (ForwardSpillAhead).
  void SpillAhead(int device);
  // Reloads spilled saves of `device` older than `before_seq`, newest first, on `consumer`, as
  // far as a PrefetchPlan admits.
  void Prefetch(EngineLock& lock, int device, uint64_t before_seq, StreamRef consumer);
  size_t AllocatedBytes(int device) const;
  void UpdateWatermarks();
  // Removes the engine's callbacks from the allocator and lifts its watermarks.
  void DetachFromAllocator();
  void OnPressure(int device, size_t incoming_bytes);

  CachingAllocator& allocator_;
  Backend& backend_;
  uint64_t oom_callback_id_ = 0;

  mutable std::mutex mutex_;
  // Told when an entry's allocation with the lock released is over (Entry::allocating).
  std::condition_variable allocated_;
  OffloadConfig config_;
  // Declared before the table, so that it goes after it: entries' host buffers and events are its.
  CopyEngine copies_;
  EntryTable table_;
  // Where backward went on after a run of reads in the last cycle (GPipe's next microbatch): the
  // prefetch's walk goes on there when it runs out.
  BackwardJumps jumps_;
  std::vector<DeviceState> devices_;
  // Per allocator that found them, the number (StreamError::seq) of the last copy-stream failure
  // acted on: one can be told more than once, and acting twice would fail later, healthy copies.
  absl::flat_hash_map<int, uint64_t> stream_errors_acted_on_;
  int saving_devices_ = 0;  // devices a save was made on (DeviceState::saved_on)
  bool skip_consumer_wait_ = false;
  bool take_back_ = true;
  OffloadStats stats_;
  static constexpr size_t kMaxEvents = 1 << 16;
  std::deque<OffloadEvent> events_;
};

}  // namespace spillway
