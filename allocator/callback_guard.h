// Callbacks that other threads may be calling while their owner removes them. The allocator calls
// its pressure handler, stream-error observer and out-of-memory callbacks outside its locks, from
// whichever thread allocates; their owner (the offload engine, whose callbacks capture `this`)
// removes them in its destructor. Once a removal returns, no call of the removed callback is
// running or will start, so the owner may go.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>

namespace spillway {

// One registration's state; read and written under its CallbackGuard's mutex.
struct CallbackSlot {
  bool removed = false;
  int in_flight = 0;  // calls in progress, over every thread
};

// One registered callback.
template <typename Fn>
struct RegisteredCallback : CallbackSlot {
  explicit RegisteredCallback(Fn f) : fn(std::move(f)) {}
  const Fn fn;
};

template <typename Fn>
std::shared_ptr<RegisteredCallback<Fn>> Register(Fn fn) {
  if (!fn) return nullptr;
  return std::make_shared<RegisteredCallback<Fn>>(std::move(fn));
}

class CallbackGuard {
 public:
  // A call in progress, if the slot was still registered when it began (check with bool).
  class Call {
   public:
    Call(CallbackGuard& guard, CallbackSlot* slot);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    explicit operator bool() const { return entered_; }

   private:
    CallbackGuard& guard_;
    CallbackSlot* slot_ = nullptr;  // set once entered
    bool entered_ = false;
  };

  // Marks `slot` removed (null: nothing) and waits until no call of it is in progress on another
  // thread. Calls of it that enclose the removal on this thread are not waited for (they would
  // wait for themselves); calls of other callbacks are not waited for at all. A callback that
  // removes a second one while that one, on another thread, removes the first waits forever:
  // no owner here does that.
  void Remove(CallbackSlot* slot);

 private:
  std::mutex mutex_;
  std::condition_variable call_ended_;
};

// One replaceable callback (the pressure handler, the stream-error observer): callers take the
// current one with Get() and call it inside a CallbackGuard::Call.
template <typename Fn>
class CallbackCell {
 public:
  using Registered = std::shared_ptr<RegisteredCallback<Fn>>;

  // Puts `fn` (empty: none) in the cell; returns once no call of the callback it replaced runs.
  void Set(CallbackGuard& guard, Fn fn) {
    Registered fresh = Register(std::move(fn));
    Registered old;
    {
      const std::lock_guard lock(mutex_);
      old = std::exchange(value_, std::move(fresh));
    }
    if (old != nullptr) guard.Remove(old.get());
  }

  Registered Get() const {
    const std::lock_guard lock(mutex_);
    return value_;
  }

 private:
  mutable std::mutex mutex_;
  Registered value_;
};

}  // namespace spillway
