#include "allocator/stream_memo.h"

#include <atomic>

namespace spillway {
namespace {

uint64_t NextMemoNumber() {
  static std::atomic<uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;  // never 0: 0 marks an empty slot
}

}  // namespace

thread_local std::array<StreamMemo::Slot, StreamMemo::kSlots> StreamMemo::slots;
thread_local size_t StreamMemo::next_slot = 0;

StreamMemo::StreamMemo(Backend& backend) : backend_(backend), number_(NextMemoNumber()) {}

StreamRef StreamMemo::ResolveAndRemember(int device, StreamHandle handle) {
  const StreamRef ref = backend_.resolve_stream(device, handle);  // may throw: nothing kept
  slots[next_slot] = Slot{number_, device, handle, ref};
  next_slot = (next_slot + 1) % kSlots;
  return ref;
}

}  // namespace spillway
