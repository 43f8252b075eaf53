// A thread's memory of the identities of streams that last as long as the process.
//
// Every allocation names its stream by handle, and the allocator keys its state by the stream's
// identity (StreamRef::id), never by the handle: handles of destroyed streams are recycled by the
// runtime (rmm#2252). On CUDA, resolving a handle costs a device guard, a cudaGetDevice and a
// cudaStreamGetId: three runtime calls on every malloc, more than the allocator's own work. The
// streams almost every allocation names are PyTorch's own (each device's default stream and its
// pool streams), which c10 creates once and never destroys: their identity never changes, so a
// thread may remember it. The caller vouches for that (the c10 adapter: any stream that is not
// an external one); a stream that may be destroyed is resolved each time, as before.
//
// Threads: each thread has slots of its own (thread_local), so a lookup takes no lock and shares
// no cache line. A memo is told apart from every other by a number never reused in the process,
// so slots a thread filled for a memo that is gone are never mistaken for another's at the same
// address.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "allocator/backend.h"

namespace spillway {

class StreamMemo {
 public:
  // `backend` must outlive the memo.
  explicit StreamMemo(Backend& backend);
  StreamMemo(const StreamMemo&) = delete;
  StreamMemo& operator=(const StreamMemo&) = delete;

  // The identity of `handle` on `device` (a valid device index), a stream the caller knows is
  // never destroyed while the process runs: asked of the backend the first time this thread
  // names it, remembered after that (while it is among the thread's last few). Throws what the
  // backend's resolve_stream throws.
  StreamRef ResolveLasting(int device, StreamHandle handle) {
    for (const Slot& slot : slots) {
      if (slot.memo == number_ && slot.handle == handle && slot.device == device) return slot.ref;
    }
    return ResolveAndRemember(device, handle);
  }

 private:
  struct Slot {
    uint64_t memo = 0;  // StreamMemo::number_; 0: empty
    int device = -1;
    StreamHandle handle = nullptr;
    StreamRef ref;
  };
  // A thread allocates on few streams at a time (the compute stream, a side stream or two):
  // four slots, the oldest replaced first.
  static constexpr size_t kSlots = 4;
  static thread_local std::array<Slot, kSlots> slots;
  static thread_local size_t next_slot;

  StreamRef ResolveAndRemember(int device, StreamHandle handle);

  Backend& backend_;
  const uint64_t number_;
};

}  // namespace spillway
