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

// Whether a registration was removed; read and written under its CallbackGuard's mutex.
struct CallbackSlot {
  bool removed = false;
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
    Call(CallbackGuard& guard, const CallbackSlot* slot);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    explicit operator bool() const { return entered_; }

   private:
    CallbackGuard& guard_;
    bool entered_ = false;
  };

  // Marks `slot` removed (null: nothing) and waits until no call is in progress. A removal made
  // from inside a call on the same thread does not wait: it would wait for itself.
  void Remove(CallbackSlot* slot);

 private:
  std::mutex mutex_;
  std::condition_variable idle_;
  int in_flight_ = 0;
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
