#include "allocator/callback_guard.h"

#include <algorithm>
#include <vector>

namespace spillway {
namespace {

// The calls in progress on this thread, innermost last, over every guard: a removal made inside
// a call of the slot it removes must not wait for that call.
thread_local std::vector<const CallbackSlot*> calls_on_this_thread;

}  // namespace

CallbackGuard::Call::Call(CallbackGuard& guard, CallbackSlot* slot) : guard_(guard) {
  if (slot == nullptr) return;
  const std::lock_guard lock(guard_.mutex_);
  if (slot->removed) return;
  ++slot->in_flight;
  calls_on_this_thread.push_back(slot);
  slot_ = slot;
  entered_ = true;
}

CallbackGuard::Call::~Call() {
  if (!entered_) return;
  const std::lock_guard lock(guard_.mutex_);
  // Calls on one thread nest, so this one is the innermost.
  calls_on_this_thread.pop_back();
  --slot_->in_flight;
  guard_.call_ended_.notify_all();
}

void CallbackGuard::Remove(CallbackSlot* slot) {
  if (slot == nullptr) return;
  std::unique_lock lock(mutex_);
  slot->removed = true;
  const auto enclosing = std::count(calls_on_this_thread.begin(), calls_on_this_thread.end(), slot);
  call_ended_.wait(lock, [&] { return slot->in_flight == enclosing; });
}

}  // namespace spillway
