// Fuzzes the offload engine's spill/reload round trip. The input picks a policy (off, eager,
// auto) and its knobs, then runs a program on a 32 MiB simulated device with two streams: new
// storages with random contents (up to 1 MiB), more views of a storage, the program letting go
// of a storage or taking it back, policy runs, forward end, pinned-memory trims, acquires from
// either stream, keeper removal, the out-of-memory rescue, synchronisation, scratch allocations
// that put the device under pressure, configuration changes, and streams held busy so that
// copies provably have not run yet.
//
// What must hold:
//  - after Acquire, a read on the consumer stream sees every byte written at creation, and so
//    does the host after WaitResident;
//  - Acquire hands out the storage's own pointer and fails only with OutOfMemoryError (no fault
//    is injected here), leaving the entry spilled;
//  - no entry ever reaches the failed state; each entry's state agrees with whether its storage
//    holds device memory;
//  - statistics agree with the states: spilled bytes are the entries spilling or spilled, host
//    bytes those with a host copy, the allocator's live allocations are the storages holding
//    memory plus the scratch blocks;
//  - scratch blocks keep the marks written at allocation (a copy the engine queued into a block
//    the allocator has meanwhile handed out again would clobber them);
// All device writes and reads are stream-ordered copies on the stream that owns the block, as
// kernels would be: the allocator and the engine promise ordering on streams, not against the
// host, so a host access could fail a correct engine (for example a block a dropped prefetch
// still writes is handed out at once on its stream, which waits for that copy).
//  - at the end, with everything dropped, nothing is left: no entry, no host bytes, no
//    allocation.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/errors.h"
#include "offload/allocator_storage.h"
#include "offload/engine.h"
#include "tests/fuzz/fuzz_support.h"

namespace spillway {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kCapacity = 32 * kMiB;
constexpr size_t kMaxItems = 24;
constexpr size_t kMaxScratch = 8;
constexpr size_t kMark = 8;

// A storage over Spillway's allocator whose other holders the fuzzer controls.
using FuzzStorage = AllocatorStorage;

// Contents of a storage: cheap to regenerate, so nothing but the seed is kept.
void FillPattern(uint8_t* out, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i += 8) {
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(out + i, &z, std::min<size_t>(8, n - i));
  }
}

uint8_t MarkByte(uint64_t id, size_t offset) {
  uint64_t x = (id + 1) * 0x9E3779B97F4A7C15ull + offset * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  return static_cast<uint8_t>(x ^ (x >> 17));
}

struct Item {
  std::shared_ptr<FuzzStorage> storage;
  uint64_t seed;
  int stream;
  std::vector<KeeperId> keepers;
};

// Marks at both ends of a scratch block (overlapping when it is small), written and read by
// copies on its stream; the host side of the write stays alive until the check that follows it.
struct Scratch {
  uint8_t* ptr;
  size_t size;
  uint64_t id;
  int stream;
  std::unique_ptr<uint8_t[]> marks;  // head (kMark bytes), then tail (kMark bytes)
};

enum Op : uint8_t {
  kNew,
  kAddView,
  kSetHolders,
  kRunPolicy,
  kForwardEnd,
  kTrimHostMemory,
  kAcquire,
  kRemoveKeeper,
  kReleaseMemory,
  kSynchronize,
  kHold,
  kRelease,
  kScratchAlloc,
  kScratchFree,
  kSetConfig,
  kNumOps,
};

OffloadConfig ConsumeConfig(FuzzedDataProvider& in) {
  OffloadConfig config;
  const OffloadPolicy policies[] = {OffloadPolicy::kOff, OffloadPolicy::kEager,
                                    OffloadPolicy::kAuto};
  config.policy = policies[in.ConsumeIntegralInRange<int>(0, 2)];
  config.budget_bytes = (size_t{1} << in.ConsumeIntegralInRange<int>(1, 4)) * kMiB;  // 2..16 MiB
  const size_t min_bytes[] = {0, 4 * kKiB, 64 * kKiB, 512 * kKiB};
  config.min_bytes = min_bytes[in.ConsumeIntegralInRange<int>(0, 3)];
  // Unset: adaptive, the default.
  const std::optional<size_t> prefetch[] = {0, 512 * kKiB, 2 * kMiB, 8 * kMiB, std::nullopt};
  config.prefetch_bytes = prefetch[in.ConsumeIntegralInRange<int>(0, 4)];
  const size_t host_limit[] = {0, 2 * kMiB, 8 * kMiB};
  config.host_limit_bytes = host_limit[in.ConsumeIntegralInRange<int>(0, 2)];
  return config;
}

class Harness {
 public:
  explicit Harness(const OffloadConfig& config)
      : engine_(std::make_unique<OffloadEngine>(*device_.allocator, config)) {}
  ~Harness() {
    engine_.reset();
    items_.clear();
  }

  void Run(FuzzedDataProvider& in) {
    while (in.remaining_bytes() > 0) {
      Step(in);
      Check();
    }
    // Drop everything: nothing may be left behind.
    while (!items_.empty()) {
      Item& item = items_.back();
      while (!item.keepers.empty()) {
        engine_->RemoveKeeper(item.keepers.back());
        item.keepers.pop_back();
      }
      items_.pop_back();
    }
    while (!scratch_.empty()) FreeScratch(scratch_.size() - 1);
    engine_->Synchronize();
    device_.Settle();
    Check();
    const OffloadStats stats = engine_->stats();
    FUZZ_CHECK(stats.num_entries == 0);
    FUZZ_CHECK(stats.host_bytes.current == 0);
    FUZZ_CHECK(stats.spilled_bytes.current == 0);
    FUZZ_CHECK(device_.allocator->stats(0).allocated_bytes.all().current == 0);
  }

 private:
  void Step(FuzzedDataProvider& in) {
    switch (in.ConsumeIntegralInRange<uint8_t>(0, kNumOps - 1)) {
      case kNew:
        New(in);
        break;
      case kAddView:
        if (!items_.empty()) AddView(items_[PickItem(in)]);
        break;
      case kSetHolders:
        if (!items_.empty()) {
          Item& item = items_[PickItem(in)];
          item.storage->holders = in.ConsumeBool() ? 1 : 0;
          fuzz::Trace("SetHolders item %llu -> %lld", static_cast<unsigned long long>(item.seed),
                      static_cast<long long>(item.storage->holders.load()));
        }
        break;
      case kRunPolicy:
        fuzz::Trace("RunPolicy");
        engine_->RunPolicy();
        break;
      case kForwardEnd:
        fuzz::Trace("ForwardEnd");
        engine_->ForwardEnd();
        break;
      case kTrimHostMemory:
        fuzz::Trace("TrimHostMemory");
        engine_->TrimHostMemory();
        break;
      case kAcquire:
        if (!items_.empty()) Acquire(in);
        break;
      case kRemoveKeeper:
        if (!items_.empty()) RemoveKeeper(in);
        break;
      case kReleaseMemory: {
        const size_t bytes = in.ConsumeIntegralInRange<size_t>(0, 8 * kMiB);
        fuzz::Trace("ReleaseMemory %zu", bytes);
        engine_->ReleaseMemory(0, bytes);
        break;
      }
      case kSynchronize:
        fuzz::Trace("Synchronize");
        engine_->Synchronize();
        break;
      case kHold: {
        const int stream = in.ConsumeIntegralInRange<int>(0, 1);
        fuzz::Trace("Hold stream %d", stream);
        device_.backend->Hold(device_.streams[stream]);
        break;
      }
      case kRelease:
        fuzz::Trace("Release");
        device_.backend->ReleaseAll();
        break;
      case kScratchAlloc:
        AllocScratch(in);
        break;
      case kScratchFree:
        if (!scratch_.empty()) {
          FreeScratch(in.ConsumeIntegralInRange<size_t>(0, scratch_.size() - 1));
        }
        break;
      case kSetConfig:
        fuzz::Trace("SetConfig");
        engine_->SetConfig(ConsumeConfig(in));
        break;
    }
  }

  size_t PickItem(FuzzedDataProvider& in) {
    return in.ConsumeIntegralInRange<size_t>(0, items_.size() - 1);
  }

  void New(FuzzedDataProvider& in) {
    // Log-uniform up to 1 MiB: small storages keep executions fast and exercise the min_bytes
    // threshold; large ones fill the device quickly.
    const int log2 = in.ConsumeIntegralInRange<int>(0, 20);
    const size_t nbytes = std::min(
        kMiB, (size_t{1} << log2) + in.ConsumeIntegralInRange<size_t>(0, (size_t{1} << log2) - 1));
    const int stream = in.ConsumeIntegralInRange<int>(0, 1);
    const bool held = in.ConsumeBool();
    if (items_.size() >= kMaxItems) return;
    std::shared_ptr<FuzzStorage> storage;
    try {
      storage = std::make_shared<FuzzStorage>(*device_.allocator, nbytes, device_.streams[stream]);
    } catch (const OutOfMemoryError&) {
      return;  // the device is full of storages the program holds: legitimate
    }
    const uint64_t seed = next_seed_++;
    // The producing kernel. Waiting for it (which lets held streams go) gives every consumer
    // the bytes whatever stream it reads on: the engine orders consumers after its reloads, not
    // after producers.
    buffer_.resize(nbytes);
    FillPattern(buffer_.data(), nbytes, seed);
    device_.backend->memcpy_async(0, storage->data(), buffer_.data(), nbytes,
                                  CopyKind::kHostToDevice, device_.streams[stream].handle);
    device_.backend->synchronize_stream(0, device_.streams[stream].handle);
    fuzz::Trace("New item %llu: %zu bytes at %p on stream %d, holders %d",
                static_cast<unsigned long long>(seed), nbytes, storage->data(), stream, held);
    storage->holders = held ? 1 : 0;
    items_.push_back(Item{storage, seed, stream, {}});
    AddView(items_.back());
  }

  void AddView(Item& item) {
    if (item.keepers.size() >= 4) return;
    ViewInfo view;
    view.sizes = {static_cast<int64_t>(item.storage->nbytes())};
    view.strides = {1};
    bool made = false;
    const std::shared_ptr<FuzzStorage> storage = item.storage;
    const std::optional<KeeperId> id = engine_->AddKeeper(
        storage.get(),
        [&] {
          made = true;
          return storage;
        },
        view, device_.streams[item.stream]);
    // A storage of ours is always Spillway's and never empty, so it is always taken; the
    // factory runs for the first view only (one entry per storage).
    FUZZ_CHECK(id.has_value());
    FUZZ_CHECK(made == item.keepers.empty());
    item.keepers.push_back(*id);
  }

  void Acquire(FuzzedDataProvider& in) {
    Item& item = items_[PickItem(in)];
    const KeeperId id = item.keepers[in.ConsumeIntegralInRange<size_t>(0, item.keepers.size() - 1)];
    const StreamRef consumer = device_.streams[in.ConsumeIntegralInRange<int>(0, 1)];
    fuzz::Trace("Acquire item %llu keeper %llu on stream %llu (%s)",
                static_cast<unsigned long long>(item.seed), static_cast<unsigned long long>(id),
                static_cast<unsigned long long>(consumer.id),
                std::string(ResidencyName(engine_->DescribeKeeper(id)->residency)).c_str());
    void* ptr = nullptr;
    try {
      ptr = engine_->Acquire(id, consumer);
    } catch (const OutOfMemoryError&) {
      // Only when the device is full of memory nobody can give back; the bytes stay on the host.
      const Residency r = engine_->DescribeKeeper(id)->residency;
      FUZZ_CHECK(r == Residency::kSpilled || r == Residency::kSpilling);
      return;
    }
    FUZZ_CHECK(ptr != nullptr && ptr == item.storage->data());
    const size_t n = item.storage->nbytes();
    // The consuming kernel, ordered by Acquire alone, then a host consumer after WaitResident.
    buffer_.resize(n);
    device_.backend->memcpy_async(0, buffer_.data(), ptr, n, CopyKind::kDeviceToHost,
                                  consumer.handle);
    engine_->WaitResident(id);
    FUZZ_CHECK(engine_->DescribeKeeper(id)->residency == Residency::kResident);
    expected_.resize(n);
    FillPattern(expected_.data(), n, item.seed);
    FUZZ_CHECK(std::memcmp(ptr, expected_.data(), n) == 0);
    device_.backend->synchronize_stream(0, consumer.handle);
    FUZZ_CHECK(buffer_ == expected_);
  }

  void RemoveKeeper(FuzzedDataProvider& in) {
    const size_t i = PickItem(in);
    Item& item = items_[i];
    const size_t k = in.ConsumeIntegralInRange<size_t>(0, item.keepers.size() - 1);
    fuzz::Trace(
        "RemoveKeeper item %llu keeper %llu (%s, %zu keepers)",
        static_cast<unsigned long long>(item.seed),
        static_cast<unsigned long long>(item.keepers[k]),
        std::string(ResidencyName(engine_->DescribeKeeper(item.keepers[k])->residency)).c_str(),
        item.keepers.size());
    engine_->RemoveKeeper(item.keepers[k]);
    item.keepers.erase(item.keepers.begin() + static_cast<std::ptrdiff_t>(k));
    // The saved tensor was the program's last reference too: the storage goes with the entry.
    if (item.keepers.empty()) items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  void AllocScratch(FuzzedDataProvider& in) {
    const int log2 = in.ConsumeIntegralInRange<int>(0, 23);
    const size_t size =
        (size_t{1} << log2) + in.ConsumeIntegralInRange<size_t>(0, (size_t{1} << log2) - 1);
    const int stream = in.ConsumeIntegralInRange<int>(0, 1);
    if (scratch_.size() >= kMaxScratch) return;
    void* p = nullptr;
    try {
      p = device_.allocator->Malloc(size, 0, device_.streams[stream]);
    } catch (const OutOfMemoryError&) {
      return;
    }
    const uint64_t id = next_seed_++;
    Scratch s{static_cast<uint8_t*>(p), size, id, stream, std::make_unique<uint8_t[]>(2 * kMark)};
    const size_t n = std::min(size, kMark);
    for (size_t i = 0; i < n; ++i) {
      s.marks[i] = MarkByte(id, i);
      s.marks[kMark + i] = MarkByte(id, size - n + i);
    }
    device_.backend->memcpy_async(0, s.ptr, s.marks.get(), n, CopyKind::kHostToDevice,
                                  device_.streams[stream].handle);
    device_.backend->memcpy_async(0, s.ptr + size - n, s.marks.get() + kMark, n,
                                  CopyKind::kHostToDevice, device_.streams[stream].handle);
    fuzz::Trace("Scratch %llu: %zu bytes at %p on stream %d", static_cast<unsigned long long>(id),
                size, p, stream);
    scratch_.push_back(std::move(s));
  }

  // Checks the marks on the block's stream before freeing it.
  void FreeScratch(size_t i) {
    Scratch& s = scratch_[i];
    fuzz::Trace("FreeScratch %llu", static_cast<unsigned long long>(s.id));
    const size_t n = std::min(s.size, kMark);
    uint8_t got[2 * kMark];
    const StreamHandle stream = device_.streams[s.stream].handle;
    device_.backend->memcpy_async(0, got, s.ptr, n, CopyKind::kDeviceToHost, stream);
    device_.backend->memcpy_async(0, got + kMark, s.ptr + s.size - n, n, CopyKind::kDeviceToHost,
                                  stream);
    device_.backend->synchronize_stream(0, stream);
    FUZZ_CHECK(std::memcmp(got, s.marks.get(), n) == 0);
    FUZZ_CHECK(std::memcmp(got + kMark, s.marks.get() + kMark, n) == 0);
    device_.allocator->Free(s.ptr);
    scratch_[i] = std::move(scratch_.back());
    scratch_.pop_back();
  }

  void Check() {
    const OffloadStats stats = engine_->stats();
    FUZZ_CHECK(stats.num_entries == static_cast<int64_t>(items_.size()));
    int64_t spilled = 0;
    int64_t host = 0;
    int64_t with_memory = 0;
    for (const Item& item : items_) {
      const std::optional<EntryInfo> info = engine_->Describe(item.storage.get());
      FUZZ_CHECK(info.has_value());
      FUZZ_CHECK(info->nbytes == item.storage->nbytes());
      FUZZ_CHECK(info->keepers.size() == item.keepers.size());
      const auto n = static_cast<int64_t>(info->nbytes);
      const bool has_memory = item.storage->data() != nullptr;
      switch (info->residency) {
        case Residency::kResident:
        case Residency::kReloading:
          FUZZ_CHECK(has_memory);
          break;
        case Residency::kSpilling:
        case Residency::kSpilled:
          FUZZ_CHECK(!has_memory);
          spilled += n;
          break;
        case Residency::kFailed:
          FUZZ_CHECK(!"an entry failed although no fault was injected");
      }
      if (info->prefetched) {
        FUZZ_CHECK(info->residency == Residency::kResident ||
                   info->residency == Residency::kReloading);
      }
      // Every state between a spill and the end of its reload keeps the host copy; a resident
      // entry keeps none, but for a prefetch not read yet, which keeps its own (one taken back
      // while its spill was still copying has none).
      if (info->residency != Residency::kResident) FUZZ_CHECK(info->host_copy);
      if (info->residency == Residency::kResident && !info->prefetched) {
        FUZZ_CHECK(!info->host_copy);
      }
      if (info->host_copy) host += n;
      if (has_memory) ++with_memory;
    }
    FUZZ_CHECK(stats.spilled_bytes.current == spilled);
    FUZZ_CHECK(stats.host_bytes.current == host);
    FUZZ_CHECK(stats.host_reserved_bytes >= host);
    FUZZ_CHECK(device_.allocator->stats(0).allocation.all().current ==
               with_memory + static_cast<int64_t>(scratch_.size()));
  }

  std::vector<uint8_t> buffer_;  // host side of the producing and consuming kernels
  std::vector<uint8_t> expected_;
  std::vector<Scratch> scratch_;  // their marks are the host side of queued copies too
  // After the host buffers queued copies read or write: the backend, which joins its stream
  // workers, goes before them.
  fuzz::FuzzDevice device_{kCapacity};
  std::unique_ptr<OffloadEngine> engine_;
  std::vector<Item> items_;
  uint64_t next_seed_ = 1;
};

}  // namespace
}  // namespace spillway

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const spillway::OffloadConfig config = spillway::ConsumeConfig(in);
  spillway::Harness harness(config);
  harness.Run(in);
  return 0;
}
