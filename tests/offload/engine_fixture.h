// Shared pieces of the offload engine tests: a storage over Spillway's allocator on the
// simulated device, and helpers that read device bytes the way a kernel on a stream would.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/sim_backend.h"
#include "offload/allocator_storage.h"
#include "offload/engine.h"
#include "tests/poll_until.h"
#include "tests/sanitizers.h"

namespace spillway::testing {

inline constexpr size_t kKiB = size_t{1} << 10;
inline constexpr size_t kMiB = size_t{1} << 20;

// A storage whose "other holders" the test controls; the forward pass holds it at first.
using TestStorage = AllocatorStorage;

// A whole storage of `nbytes` seen as one contiguous float vector.
inline ViewInfo FloatView(size_t nbytes) {
  ViewInfo view;
  view.sizes = {static_cast<int64_t>(nbytes / 4)};
  view.strides = {1};
  view.element_size = 4;
  return view;
}

class OffloadEngineTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(OffloadConfig{}, size_t{256} << 20, std::chrono::microseconds{0}); }

  // Set before Make: the simulated device then orders every access by its stream, as a GPU
  // does (by default the program's CPU kernels touch memory from the host thread).
  bool accesses_follow_streams_ = false;

  void Make(OffloadConfig config, size_t capacity, std::chrono::microseconds jitter,
            AllocatorConfig allocator_config = {}) {
    engine_.reset();
    storages_.clear();
    allocator_.reset();
    SimBackend::Options options;
    options.capacity_bytes = capacity;
    options.max_jitter = jitter;
    options.accesses_follow_streams = accesses_follow_streams_;
    backend_ = NewBackend(options);
    allocator_ = std::make_unique<CachingAllocator>(backend_, allocator_config);
    compute_ = backend_->default_stream(0);
    engine_ = std::make_unique<OffloadEngine>(*allocator_, config);
  }

  // The device Make builds on: a fixture may give a simulated device that answers differently.
  virtual std::shared_ptr<SimBackend> NewBackend(const SimBackend::Options& options) {
    return std::make_shared<SimBackend>(options);
  }

  void TearDown() override {
    engine_.reset();
    storages_.clear();
  }

  // A storage of `nbytes` filled with bytes derived from `seed`, written through the compute
  // stream as a kernel would.
  std::shared_ptr<TestStorage> NewStorage(size_t nbytes, uint32_t seed) {
    auto s = std::make_shared<TestStorage>(*allocator_, nbytes, compute_);
    const std::vector<uint8_t> bytes = Pattern(nbytes, seed);
    backend_->memcpy_async(0, s->data(), bytes.data(), nbytes, CopyKind::kHostToDevice,
                           compute_.handle);
    backend_->synchronize_stream(0, compute_.handle);
    storages_.push_back(s);
    return s;
  }

  // Bytes unique to `seed`, eight per generator step (sanitizer builds check many MiB).
  static std::vector<uint8_t> Pattern(size_t nbytes, uint32_t seed) {
    std::vector<uint8_t> out(nbytes);
    std::mt19937_64 gen(seed);
    for (size_t i = 0; i < nbytes; i += 8) {
      const uint64_t word = gen();
      std::memcpy(out.data() + i, &word, std::min<size_t>(8, nbytes - i));
    }
    return out;
  }

  // Reads the storage on `stream` after everything enqueued there, as a kernel would.
  std::vector<uint8_t> ReadOn(StreamRef stream, const void* ptr, size_t nbytes) {
    std::vector<uint8_t> out(nbytes);
    backend_->memcpy_async(0, out.data(), ptr, nbytes, CopyKind::kDeviceToHost, stream.handle);
    backend_->synchronize_stream(0, stream.handle);
    return out;
  }

  KeeperId Save(const std::shared_ptr<TestStorage>& s, int64_t offset = 0,
                std::optional<SaveSettings> settings = std::nullopt,
                SavePhase phase = SavePhase::kForward) {
    ViewInfo view = FloatView(s->nbytes());
    view.offset = offset;
    auto id = engine_->AddKeeper(
        s.get(), [&] { return s; }, view, compute_, settings, phase);
    EXPECT_TRUE(id.has_value());
    return id.value_or(0);
  }

  // The program lets `storages` go, so that only their saves keep them, and the forward ends
  // (where eager spills them); returns once every copy issued is done.
  void EndForwardSavesOnly(std::initializer_list<std::shared_ptr<TestStorage>> storages) {
    for (const std::shared_ptr<TestStorage>& s : storages) s->holders = 0;
    engine_->ForwardEnd();
    engine_->Synchronize();
  }

  Residency StateOf(const std::shared_ptr<TestStorage>& s) {
    return engine_->Describe(s.get()).value().residency;
  }
  // Waits (for up to kPollLimit) until a host thread is blocked on `stream`'s work: the thread a
  // test started has reached its wait there.
  bool AwaitHostWaiter(StreamRef stream) {
    return PollUntil([&] { return backend_->host_waiters(0, stream.handle) != 0; });
  }
  // Acquires on the compute stream and reads the bytes back there, as a kernel would.
  std::vector<uint8_t> AcquireAndRead(KeeperId id, size_t nbytes) {
    void* ptr = engine_->Acquire(id, compute_);
    return ReadOn(compute_, ptr, nbytes);
  }
  int64_t EngineStat(const std::string& name) { return engine_->stats().Flatten().at(name); }
  int64_t AllocStat(const std::string& name) { return allocator_->FlatStats(0).at(name); }

  std::shared_ptr<SimBackend> backend_;
  std::unique_ptr<CachingAllocator> allocator_;
  std::unique_ptr<OffloadEngine> engine_;
  std::vector<std::shared_ptr<TestStorage>> storages_;
  StreamRef compute_;
};

// Fixture `Base` on a simulated device of type `Sim` (one that answers differently), which the
// tests reach, typed, as `sim_`.
template <typename Base, typename Sim>
class WithSimBackend : public Base {
 protected:
  std::shared_ptr<SimBackend> NewBackend(const SimBackend::Options& options) override {
    sim_ = std::make_shared<Sim>(options);
    return sim_;
  }
  std::shared_ptr<Sim> sim_;
};

inline OffloadConfig Policy(OffloadPolicy policy, size_t min_bytes = 0) {
  OffloadConfig config;
  config.policy = policy;
  config.min_bytes = min_bytes;
  return config;
}

}  // namespace spillway::testing
