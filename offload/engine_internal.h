// Internals of OffloadEngine shared by its source files (engine.cc: residency and copies;
// engine_keepers.cc: registration; engine_failures.cc: copy failures; engine_policy.cc: the
// policies' plans carried out; engine_info.cc: statistics and descriptions): its lock and the
// release of storages after it.
// Not part of the engine's interface.
#pragma once

#include <cassert>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "offload/engine.h"

namespace spillway {

// `config`, or InvalidArgumentError naming what ValidateOffloadConfig refused.
const OffloadConfig& CheckedOffloadConfig(const OffloadConfig& config);

// How many engine operations the calling thread is in: holding an engine's lock, or allocating a
// reload's memory with it released (EngineLock::Unlocked). Hooks that would wait for the GIL (the
// Python stack gatherer, out-of-memory observers) skip or defer their work meanwhile.
extern thread_local int engine_ops;
// The engine whose lock the calling thread holds, or null.
extern thread_local const void* engine_lock_holder;

// Storages whose hold the engine gave up while the calling thread held its lock (the entry that
// kept them went): let go of when the thread's outermost engine operation ends, with no lock of
// the engine's held. From torch 2.10 on, the last release of a storage that has a Python object
// takes the GIL and may run Python (the object's dealloc); made under the lock, it would wait for
// the GIL while a Python thread that holds the GIL waits for the engine: a deadlock. It may also
// come back to the engine (a finalizer that saves or drops a tensor).
void DeferRelease(std::shared_ptr<Storage> storage);
// Lets go of what the calling thread deferred (and what that deferred in turn).
void ReleaseDeferred() noexcept;

// The engine's lock: a plain mutex, never taken twice by one thread (asserted in debug builds),
// also marking the thread as inside the engine. Lock order: the GIL (when the caller holds it),
// then this, then an allocator's lock, the pinned pool's, the backend's. Nothing under this lock
// waits for the GIL: storages are let go of after it (DeferRelease), the allocator's stack
// gatherer records nothing inside the engine, and out-of-memory observers hear of a reload's
// failure from the engine's caller. The one storage reference taken under it, AddKeeper's storage
// factory, is the pack hook's, whose caller holds the GIL already (a first reference from 1 to 2
// increfs the storage's Python object). The torch layer asserts this in debug (sanitizer) builds.
//
// Nothing the engine calls under it comes back to take it: device memory for a reload or a
// prefetch is allocated with it released (Unlocked), the allocator's out-of-memory rescue and
// budget handler then take it as any other caller does, and the one call that comes back on the
// same thread under it, the allocator passing on a copy failure it heard in a call the engine
// made, is acted on under the hold the thread has (OffloadEngine::OnStreamError).
class EngineLock {
 public:
  EngineLock(std::mutex& mutex, const void* engine) : engine_(engine) {
    assert(engine_lock_holder != engine && "the offload engine's lock is not recursive");
    lock_ = std::unique_lock<std::mutex>(mutex);
    engine_lock_holder = engine;
    ++engine_ops;
  }
  ~EngineLock() {
    engine_lock_holder = nullptr;
    lock_.unlock();
    if (--engine_ops == 0) ReleaseDeferred();
  }
  EngineLock(const EngineLock&) = delete;
  EngineLock& operator=(const EngineLock&) = delete;

  // Waits on `cv` until `done()`, the lock released meanwhile.
  template <typename Done>
  void Wait(std::condition_variable& cv, Done done) {
    engine_lock_holder = nullptr;
    cv.wait(lock_, done);
    engine_lock_holder = engine_;
  }

  // Releases the lock for its scope, the thread's engine operation going on (storages deferred
  // stay deferred, hooks still skip what waits for the GIL); takes it again as it ends.
  class Unlocked {
   public:
    explicit Unlocked(EngineLock& lock) : lock_(lock) {
      engine_lock_holder = nullptr;
      lock_.lock_.unlock();
    }
    ~Unlocked() {
      lock_.lock_.lock();
      engine_lock_holder = lock_.engine_;
    }
    Unlocked(const Unlocked&) = delete;
    Unlocked& operator=(const Unlocked&) = delete;

   private:
    EngineLock& lock_;
  };

 private:
  const void* const engine_;
  std::unique_lock<std::mutex> lock_;
};

}  // namespace spillway
