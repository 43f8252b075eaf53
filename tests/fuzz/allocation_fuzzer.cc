// Fuzzes the caching allocator against a reference model. The input is a program of operations
// on a 64 MiB simulated device with two streams: malloc (size, stream), free, bad frees (double,
// interior), record_stream, a "kernel" writing into an allocation on the other stream, holding
// a stream busy, empty_cache, memory-fraction and watermark changes. After every operation the
// allocator's state must agree with the model:
//  - every live allocation is found by Lookup with its requested size, a block size at least
//    that large and its stream; no two live blocks overlap;
//  - the first and last 8 bytes of every live allocation still hold what was written there at
//    malloc (anything else means the block was handed out twice, or a copy queued by an earlier
//    owner landed after reuse);
//  - statistics: allocation and allocated_bytes match the live set; active_bytes and
//    requested_bytes match the snapshot's active blocks (live, or freed with a stream use
//    pending); reserved bytes match the segments and the device's bytes in use;
//  - snapshot: each segment's blocks tile it exactly, its allocated size is the sum of its
//    allocated blocks, and the allocated blocks are exactly the live allocations;
//  - stream-ordered reuse: a block freed after a stream use on a stream that is held (so the
//    use provably has not completed) is not handed out again until that stream is released.
// A fresh device and allocator per input (fuzz::FuzzDevice) keeps inputs independent and
// reproducible.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/errors.h"
#include "tests/fuzz/fuzz_support.h"

namespace spillway {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kCapacity = 64 * kMiB;
constexpr size_t kMark = 8;       // bytes checked at each end of an allocation
constexpr size_t kMaxLive = 512;  // keeps the per-step checks cheap

enum Op : uint8_t {
  kMalloc,
  kFree,
  kBadFree,
  kRecordStream,
  kKernelWrite,
  kHold,
  kRelease,
  kEmptyCache,
  kSetFraction,
  kProcessEvents,
  kSetWatermark,
  kNumOps,
};

struct Live {
  uint8_t* ptr;
  size_t requested;
  int stream;       // index into FuzzDevice::streams
  uint64_t id;      // seeds the marks
  bool used_on[2];  // record_stream was called for that stream (never the own one)
};

// A range that must not be handed out while `stream` stays held in `generation`.
struct Quarantine {
  uintptr_t begin;
  uintptr_t end;
  int stream;
  uint64_t generation;
};

uint8_t MarkByte(uint64_t id, size_t offset) {
  uint64_t x = (id + 1) * 0x9E3779B97F4A7C15ull + offset * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  return static_cast<uint8_t>(x ^ (x >> 17));
}

// Offsets of the bytes checked: the first and last kMark bytes (they overlap when small).
template <typename F>
void ForEachMarkOffset(size_t n, F&& f) {
  for (size_t i = 0; i < std::min(n, kMark); ++i) f(i);
  for (size_t i = n > kMark ? n - kMark : 0; i < n; ++i) f(i);
}

class Harness {
 public:
  void Run(FuzzedDataProvider& in) {
    while (in.remaining_bytes() > 0) {
      Step(in);
      Check();
    }
    // Everything freed and the cache emptied: the device must be back to nothing in use.
    while (!live_.empty()) FreeAt(live_.size() - 1);
    device_.backend->ReleaseAll();
    device_.allocator->EmptyCache();
    device_.Settle();
    device_.allocator->EmptyCache();
    Check();
    FUZZ_CHECK(device_.backend->bytes_in_use(0) == 0);
  }

 private:
  void Step(FuzzedDataProvider& in) {
    switch (in.ConsumeIntegralInRange<uint8_t>(0, kNumOps - 1)) {
      case kMalloc:
        Malloc(in);
        break;
      case kFree:
        if (!live_.empty()) FreeAt(Pick(in));
        break;
      case kBadFree:
        BadFree(in);
        break;
      case kRecordStream:
        if (!live_.empty()) RecordStream(live_[Pick(in)]);
        break;
      case kKernelWrite:
        if (!live_.empty()) KernelWrite(live_[Pick(in)]);
        break;
      case kHold:
        device_.backend->Hold(device_.streams[in.ConsumeIntegralInRange<int>(0, 1)]);
        break;
      case kRelease:
        device_.backend->ReleaseAll();
        break;
      case kEmptyCache:
        device_.allocator->EmptyCache();
        break;
      case kSetFraction:
        // Eighths of the device (0: no new memory, 8: the whole device), so limits below what is
        // already reserved are common.
        device_.allocator->SetMemoryFraction(in.ConsumeIntegralInRange<int>(0, 8) / 8.0, 0);
        break;
      case kProcessEvents:
        device_.allocator->ProcessEvents(0);
        break;
      case kSetWatermark: {
        // Eighths of the device, or none: under a watermark a new segment past it waits for
        // pending stream uses first (the offload budget's rule), on the host here.
        const int eighths = in.ConsumeIntegralInRange<int>(0, 8);
        device_.allocator->SetWatermark(0, eighths == 8 ? SIZE_MAX : eighths * (kCapacity / 8));
        break;
      }
    }
  }

  size_t Pick(FuzzedDataProvider& in) {
    return in.ConsumeIntegralInRange<size_t>(0, live_.size() - 1);
  }

  void Malloc(FuzzedDataProvider& in) {
    const int stream = in.ConsumeIntegralInRange<int>(0, 1);
    size_t size = 0;
    switch (in.ConsumeIntegralInRange<int>(0, 3)) {
      case 0:  // small pool, odd sizes included
        size = in.ConsumeIntegralInRange<size_t>(0, 4096);
        break;
      case 1:
        size = in.ConsumeIntegralInRange<size_t>(1, kMiB);
        break;
      case 2:  // large pool, shares 20 MiB segments
        size = in.ConsumeIntegralInRange<size_t>(kMiB + 1, 10 * kMiB);
        break;
      default:  // own segment; can exceed what is left of the device
        size = in.ConsumeIntegralInRange<size_t>(10 * kMiB, 48 * kMiB);
        break;
    }
    if (live_.size() >= kMaxLive) return;
    const int64_t before = device_.allocator->stats(0).allocation.all().current;
    void* p = nullptr;
    try {
      p = device_.allocator->Malloc(size, 0, device_.streams[stream]);
    } catch (const OutOfMemoryError& e) {
      // Legitimate on a 64 MiB device; it must not have changed what is allocated.
      FUZZ_CHECK(e.requested_bytes() == size);
      FUZZ_CHECK(device_.allocator->stats(0).allocation.all().current == before);
      return;
    }
    if (size == 0) {
      FUZZ_CHECK(p == nullptr);
      return;
    }
    FUZZ_CHECK(p != nullptr);
    auto* ptr = static_cast<uint8_t*>(p);
    const auto begin = reinterpret_cast<uintptr_t>(ptr);
    for (const Quarantine& q : quarantine_) {
      if (device_.backend->generation() != q.generation ||
          !device_.backend->held(device_.streams[q.stream]))
        continue;
      // The block's last use on a held stream cannot have completed: reusing it now is the
      // bug stream-ordered reuse exists to prevent.
      FUZZ_CHECK(begin + size <= q.begin || begin >= q.end);
    }
    const uint64_t id = next_id_++;
    ForEachMarkOffset(size, [&](size_t i) { ptr[i] = MarkByte(id, i); });
    live_.push_back(Live{ptr, size, stream, id, {false, false}});
  }

  void FreeAt(size_t i) {
    const Live l = live_[i];
    const auto info = device_.allocator->Lookup(l.ptr);
    FUZZ_CHECK(info.has_value());
    const uint64_t generation = device_.backend->generation();
    for (int s = 0; s < 2; ++s) {
      if (l.used_on[s] && device_.backend->held(device_.streams[s])) {
        quarantine_.push_back(Quarantine{reinterpret_cast<uintptr_t>(l.ptr),
                                         reinterpret_cast<uintptr_t>(l.ptr) + info->size, s,
                                         generation});
      }
    }
    if (l.id % 2 == 0) {
      device_.allocator->Free(l.ptr);
    } else {
      device_.allocator->Free(l.ptr, 0);
    }
    live_[i] = live_.back();
    live_.pop_back();
    freed_.push_back(l.ptr);
    if (freed_.size() > 64) freed_.pop_front();
    // Entries whose hold is gone can never apply again.
    std::erase_if(quarantine_, [&](const Quarantine& q) {
      return q.generation != device_.backend->generation() ||
             !device_.backend->held(device_.streams[q.stream]);
    });
  }

  // A double free or an interior pointer must be refused, naming the problem, and change nothing.
  void BadFree(FuzzedDataProvider& in) {
    void* bad = nullptr;
    if (in.ConsumeBool() && !freed_.empty()) {
      bad = freed_[in.ConsumeIntegralInRange<size_t>(0, freed_.size() - 1)];
      for (const Live& l : live_) {
        if (l.ptr == bad) return;  // reused since: a valid pointer again
      }
    } else if (!live_.empty()) {
      const Live& l = live_[Pick(in)];
      const auto info = device_.allocator->Lookup(l.ptr);
      FUZZ_CHECK(info.has_value());
      if (info->size < 2) return;
      bad = l.ptr + in.ConsumeIntegralInRange<size_t>(1, info->size - 1);
    } else {
      return;
    }
    bool refused = false;
    try {
      device_.allocator->Free(bad);
    } catch (const InvalidArgumentError& e) {
      refused = e.what()[0] != '\0';
    }
    FUZZ_CHECK(refused);
  }

  void RecordStream(Live& l) {
    const int other = 1 - l.stream;
    device_.allocator->RecordStream(l.ptr, device_.streams[other]);
    l.used_on[other] = true;
  }

  // A kernel on the other stream rewrites the allocation's first mark (the same bytes, so it is
  // harmless while the allocation lives). Queued behind a hold it runs late: if the allocator
  // let another allocation take the block meanwhile, it clobbers that one's mark.
  void KernelWrite(Live& l) {
    RecordStream(l);
    auto& source = sources_.emplace_back();
    const size_t n = std::min(l.requested, kMark);
    for (size_t i = 0; i < n; ++i) source[i] = MarkByte(l.id, i);
    device_.backend->memcpy_async(0, l.ptr, source.data(), n, CopyKind::kHostToDevice,
                                  device_.streams[1 - l.stream].handle);
  }

  void Check() {
    std::vector<const Live*> by_address;
    by_address.reserve(live_.size());
    int64_t allocated = 0;
    int64_t requested = 0;
    uintptr_t previous_end = 0;  // device addresses are never 0
    for (const Live& l : live_) by_address.push_back(&l);
    std::sort(by_address.begin(), by_address.end(),
              [](const Live* a, const Live* b) { return a->ptr < b->ptr; });
    for (const Live* l : by_address) {
      const auto info = device_.allocator->Lookup(l->ptr);
      FUZZ_CHECK(info.has_value());
      FUZZ_CHECK(info->ptr == l->ptr);
      FUZZ_CHECK(info->requested == l->requested);
      FUZZ_CHECK(info->size >= l->requested);
      FUZZ_CHECK(info->size % 512 == 0);
      FUZZ_CHECK(info->device == 0);
      FUZZ_CHECK(info->stream.id == device_.streams[l->stream].id);
      const auto begin = reinterpret_cast<uintptr_t>(l->ptr);
      FUZZ_CHECK(begin >= previous_end);
      previous_end = begin + info->size;
      ForEachMarkOffset(l->requested,
                        [&](size_t i) { FUZZ_CHECK(l->ptr[i] == MarkByte(l->id, i)); });
      allocated += static_cast<int64_t>(info->size);
      requested += static_cast<int64_t>(l->requested);
    }

    const DeviceStats stats = device_.allocator->stats(0);
    FUZZ_CHECK(stats.allocation.all().current == static_cast<int64_t>(live_.size()));
    FUZZ_CHECK(stats.allocated_bytes.all().current == allocated);

    const Snapshot snapshot = device_.allocator->TakeSnapshot();
    int64_t reserved = 0;
    size_t allocated_blocks = 0;
    int64_t allocated_requested = 0;
    int64_t active = 0;  // allocated, or freed with a stream use still pending
    int64_t active_requested = 0;
    for (const SegmentSnapshot& segment : snapshot.segments) {
      size_t tiled = 0;
      size_t segment_allocated = 0;
      uintptr_t next = segment.address;
      for (const BlockSnapshot& block : segment.blocks) {
        FUZZ_CHECK(block.address == next);  // address order, no gap, no overlap
        next += block.size;
        tiled += block.size;
        if (block.state == BlockState::kActiveAllocated) {
          ++allocated_blocks;
          segment_allocated += block.size;
          allocated_requested += static_cast<int64_t>(block.requested_size);
          const auto info = device_.allocator->Lookup(reinterpret_cast<void*>(block.address));
          FUZZ_CHECK(info.has_value() && info->size == block.size);
          FUZZ_CHECK(info->requested == block.requested_size);
        }
        if (block.state != BlockState::kInactive) {
          active += static_cast<int64_t>(block.size);
          active_requested += static_cast<int64_t>(block.requested_size);
        }
      }
      FUZZ_CHECK(tiled == segment.total_size);
      FUZZ_CHECK(segment_allocated == segment.allocated_size);
      reserved += static_cast<int64_t>(segment.total_size);
    }
    FUZZ_CHECK(allocated_blocks == live_.size());
    FUZZ_CHECK(allocated_requested == requested);
    // As in PyTorch, a block freed with stream uses pending stays active (and keeps counting as
    // requested) until its events complete.
    FUZZ_CHECK(stats.active_bytes.all().current == active);
    FUZZ_CHECK(stats.requested_bytes.all().current == active_requested);
    FUZZ_CHECK(stats.reserved_bytes.all().current == reserved);
    FUZZ_CHECK(device_.backend->bytes_in_use(0) == static_cast<size_t>(reserved));
    FUZZ_CHECK(static_cast<size_t>(reserved) <= kCapacity);
  }

  std::deque<std::array<uint8_t, kMark>> sources_;  // host side of queued kernel writes
  fuzz::FuzzDevice device_{kCapacity};              // after sources_: goes before them
  std::vector<Live> live_;
  std::deque<void*> freed_;  // recent frees, for double-free attempts
  std::vector<Quarantine> quarantine_;
  uint64_t next_id_ = 0;
};

}  // namespace
}  // namespace spillway

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  spillway::Harness harness;
  harness.Run(in);
  return 0;
}
