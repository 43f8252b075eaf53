// The fixture of the randomized differential test (differential_test.cc): its constants, the
// device, allocator and reference model it drives, its randomness helpers, and the declarations of
// its operations (differential_ops.cc) and checks (differential_checks.cc).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <vector>

#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "allocator/config.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"
#include "allocator/size_policy.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "gtest/gtest.h"
#include "tests/allocator/byte_pattern.h"
#include "tests/allocator/differential_model.h"
#include "tests/allocator/test_util.h"
#include "tests/sanitizers.h"

namespace spillway::testing {

inline constexpr int kNumStreams = 3;  // the streams random operations use
// A fourth stream only the least-segment probe allocates on: it holds no segment between probes,
// so the probe's request always needs a fresh one.
inline constexpr int kProbeStream = kNumStreams;
inline constexpr int kAllStreams = kNumStreams + 1;
inline constexpr size_t kCapacity = 256 * kMiB;
// Copies on other streams touch at most this prefix of a block (keeps the test fast).
inline constexpr size_t kMaxCopyBytes = 64 * kKiB;

// ---- Byte patterns ------------------------------------------------------------------------------

#if defined(SPILLWAY_UNDER_TSAN)
// ThreadSanitizer shadows every byte copied or compared, which makes patterns over hundreds of
// MiB take minutes: there the pattern covers each allocation's first and last 64 KiB only.
inline constexpr size_t kPatternSpan = 64 * kKiB;
inline constexpr int kStepsPerSeed = 2500;
#else
inline constexpr size_t kPatternSpan = testing::kWholePattern;
inline constexpr int kStepsPerSeed = 5000;
#endif
inline constexpr int kProbeEvery = 1000;  // steps between least-segment probes

// (Not named FillPattern: test_util.h has a FillPattern of its own in this namespace.)
inline void FillAllocPattern(void* p, size_t n, uint64_t tag) {
  testing::FillEnds(p, n, tag, kPatternSpan);
}

inline size_t AllocPatternMismatch(const void* p, size_t n, uint64_t tag) {
  return testing::EndsMismatch(p, n, tag, kPatternSpan);
}

// ---- The test ----------------------------------------------------------------------------------

// An asynchronous copy on another stream and the host buffer it uses, kept until it ran.
struct InflightCopy {
  EventHandle done = nullptr;  // recorded on the stream right after the copy
  std::unique_ptr<unsigned char[]> host;
  size_t bytes = 0;
  bool verify = false;  // device-to-host: the buffer must hold `tag`'s pattern
  uint64_t tag = 0;
};

struct DiffParam {
  const char* name;
  uint64_t seed;
  AllocatorConfig config;
};

inline void PrintTo(const DiffParam& p, std::ostream* os) { *os << p.name << " seed " << p.seed; }

class AllocatorDifferentialTest : public ::testing::TestWithParam<DiffParam> {
 protected:
  AllocatorDifferentialTest()
      : rng_(GetParam().seed),
        policy_(GetParam().config),
        backend_(std::make_shared<SimBackend>(
            SimBackend::Options{.devices = 1,
                                .capacity_bytes = kCapacity,
                                .host_capacity_bytes = 0,
                                .max_jitter = std::chrono::microseconds(150),
                                .seed = GetParam().seed})),
        alloc_(backend_, GetParam().config) {
    streams_[0] = backend_->default_stream(0);
    for (int s = 1; s < kAllStreams; ++s) streams_[s] = backend_->create_stream(0);
  }

  ~AllocatorDifferentialTest() override {
    // Let every queued copy finish before host buffers and events go away.
    for (int s = 0; s < kAllStreams; ++s) backend_->synchronize_stream(0, streams_[s].handle);
    for (InflightCopy& c : inflight_) backend_->destroy_event(0, c.done);
    for (auto& [addr, p] : model_.pending) {
      for (EventHandle e : p.markers) backend_->destroy_event(0, e);
    }
  }

  // ---- Randomness ----

  uint64_t Uniform(uint64_t lo, uint64_t hi) {  // inclusive
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_);
  }
  bool Chance(int percent) { return Uniform(0, 99) < static_cast<uint64_t>(percent); }

  size_t RandomSize();

  int RandomStream() { return static_cast<int>(Uniform(0, kNumStreams - 1)); }
  int OtherStream(int s) {
    return (s + 1 + static_cast<int>(Uniform(0, kNumStreams - 2))) % kNumStreams;
  }

  std::map<uintptr_t, LiveAlloc>::iterator RandomLive() {
    return std::next(model_.live.begin(),
                     static_cast<std::ptrdiff_t>(Uniform(0, model_.live.size() - 1)));
  }

  // ---- Operations (differential_ops.cc) ----

  // Returns true when the allocator may have processed stream events during the step.
  bool DoMalloc(size_t size) { return DoMalloc(size, RandomStream()); }
  bool DoMalloc(size_t size, int s);
  // `verify`: check the pattern first (not while copies may be writing the block).
  void DoFree(std::map<uintptr_t, LiveAlloc>::iterator it, bool verify = true);
  // Enqueues on stream `u` a copy of the first bytes of `addr` into a host buffer; verified once
  // the copy ran.
  void EnqueueReadBack(uintptr_t addr, const LiveAlloc& a, int u);
  // Enqueues on stream `u` a write of the block's own pattern: harmless while the block is ours,
  // corrupts the next owner if the block is handed out before the copy ran.
  void EnqueueRewrite(uintptr_t addr, const LiveAlloc& a, int u);
  void DoRecordStream();
  // A use on another stream right before the free: the pattern must survive until the copies ran.
  // The rewrite goes on the stream of any earlier read-back, so the two never run concurrently.
  void DoUseAndFree();
  void DoSynchronize(int s);
  // Returns true when the allocator may have processed stream events.
  bool DoPressure();

  // ---- The least-segment probe (differential_ops.cc) ----

  // PyTorch's segment size, unless what it leaves beside the request is a block no request below
  // max_split_size may take (max_split_size under 20 MiB): then the least segment, in steps of
  // 2 MiB, that the request may take whole or that splits into it and a usable remainder.
  size_t FullSegmentSize(size_t rounded) const;
  // Directed: a mid-size request (PyTorch gives it a 20 MiB segment) under a memory limit that
  // leaves room only for the least segment that holds it must get exactly that segment. Random
  // steps reach this edge only now and then, and how often depends on when pending frees happen
  // to be released, so every run also probes it on purpose, amid whatever the random steps left.
  void DoLeastSegmentProbe();

  // ---- Checks (differential_checks.cc) ----

  void CheckOutOfMemory(const OutOfMemoryError& e, int s, size_t rounded, PoolKind pool,
                        size_t segment_size, const DeviceStats& before);
  // Retires copies that have run, checking what the read-backs saw.
  void RetireCopies();
  void VerifyPattern(uintptr_t addr, const LiveAlloc& a);
  void VerifyAllPatterns();
  // Compares snapshot and statistics with the model (differential_model.h) and the backend.
  // `events_processed`: the step may have completed pending frees. Returns how many pending
  // frees were completed.
  int CheckAll(bool events_processed);
  // Best fit, checked after the snapshot told whether pending frees were released.
  void CheckMallocPlacement(int released);

  // ---- Driving the test (Run: differential_test.cc, Finish: differential_checks.cc) ----

  void Run(int steps);
  // Frees everything, waits for every stream, empties the cache: all statistics return to zero.
  void Finish();

  struct MallocCheck {
    uintptr_t addr;
    size_t rounded;
    size_t segment_size;
    bool full_segment_fits;
    std::optional<uintptr_t> predicted;
    std::set<uintptr_t> old_segments;
    int64_t retries_before;
  };
  struct Counts {
    int mallocs = 0, frees = 0, pending_frees = 0, pending_released = 0, ooms = 0, copies = 0,
        syncs = 0, reused = 0, new_segments = 0, empty_caches = 0, drains = 0, limits = 0,
        cross_pool = 0, least_segments = 0, probes = 0;
  };

  std::mt19937_64 rng_;
  const SizePolicy policy_;
  std::shared_ptr<SimBackend> backend_;
  CachingAllocator alloc_;
  std::array<StreamRef, kAllStreams> streams_;

  testing::ReferenceModel model_;
  std::vector<InflightCopy> inflight_;
  Snapshot last_;
  std::optional<MallocCheck> malloc_check_;
  uint64_t next_tag_ = 1;
  size_t limit_ = 0;
  int limit_steps_left_ = 0;
  Counts counts_;
};

}  // namespace spillway::testing
