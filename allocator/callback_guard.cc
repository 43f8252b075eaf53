#include "allocator/callback_guard.h"

namespace spillway {
namespace {

// Calls in progress on this thread, over every guard: a removal inside one must not wait.
thread_local int calls_on_this_thread = 0;

}  // namespace

CallbackGuard::Call::Call(CallbackGuard& guard, const CallbackSlot* slot) : guard_(guard) {
  if (slot == nullptr) return;
  const std::lock_guard lock(guard_.mutex_);
  if (slot->removed) return;
  ++guard_.in_flight_;
  ++calls_on_this_thread;
  entered_ = true;
}

CallbackGuard::Call::~Call() {
  if (!entered_) return;
  const std::lock_guard lock(guard_.mutex_);
  --calls_on_this_thread;
  if (--guard_.in_flight_ == 0) guard_.idle_.notify_all();
}

void CallbackGuard::Remove(CallbackSlot* slot) {
  std::unique_lock lock(mutex_);
  if (slot != nullptr) slot->removed = true;
  if (calls_on_this_thread > 0) return;
  idle_.wait(lock, [&] { return in_flight_ == 0; });
}

}  // namespace spillway
