// Multi-threaded stress test: four threads hammer one CachingAllocator on a jittered SimBackend
// with malloc, free and record_stream on streams they share and streams of their own, with copies
// in flight on other streams at free time. Every allocation carries a byte pattern unique to it,
// checked before it is freed and by copies that read it back on other streams; at the end every
// statistic returns to zero, and to zero reserved after EmptyCache. Meant to run under
// ThreadSanitizer as well (it then does fewer operations).
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "allocator/backend.h"
#include "allocator/caching_allocator.h"
#include "allocator/config.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "gtest/gtest.h"
#include "tests/allocator/byte_pattern.h"
#include "tests/allocator/test_util.h"
#include "tests/sanitizers.h"

namespace spillway {
namespace {

using testing::kKiB;
using testing::kMiB;
constexpr int kThreads = 4;
constexpr int kSharedStreams = 3;  // the default stream and two created ones
#if defined(SPILLWAY_UNDER_TSAN)
constexpr int kOpsPerThread = 1500;
#else
constexpr int kOpsPerThread = 5000;
#endif
constexpr size_t kMaxCopyBytes = 16 * kKiB;
constexpr size_t kMaxLiveBytesPerThread = 48 * kMiB;

// Raised by any failed expectation in any thread, so the workers stop early. (Asking gtest whether
// the test has failed is not safe while other threads report failures.)
class FailureFlag : public ::testing::EmptyTestEventListener {
 public:
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed()) failed_.store(true);
  }
  bool failed() const { return failed_.load(); }

 private:
  std::atomic<bool> failed_{false};
};

// Installs a FailureFlag for the lifetime of this object.
class ScopedFailureFlag {
 public:
  ScopedFailureFlag() { ::testing::UnitTest::GetInstance()->listeners().Append(flag_); }
  ~ScopedFailureFlag() {
    ::testing::UnitTest::GetInstance()->listeners().Release(flag_);
    delete flag_;
  }
  ScopedFailureFlag(const ScopedFailureFlag&) = delete;
  ScopedFailureFlag& operator=(const ScopedFailureFlag&) = delete;
  bool failed() const { return flag_->failed(); }

 private:
  FailureFlag* flag_ = new FailureFlag;
};

struct Shared {
  const ScopedFailureFlag* failures;
  std::shared_ptr<SimBackend> backend;
  CachingAllocator* alloc;
  std::array<StreamRef, kSharedStreams> streams;
  std::atomic<int64_t> mallocs{0};
  std::atomic<int64_t> ooms{0};
  std::atomic<int64_t> pending_frees{0};
};

class Worker {
 public:
  Worker(Shared& shared, int index) : s_(shared), index_(index), rng_(1000 + index) {}

  void Run() {
    own_ = s_.backend->create_stream(0);
    for (int op = 0; op < kOpsPerThread && !s_.failures->failed(); ++op) {
      const uint64_t r = Uniform(0, 999);
      if (live_.empty() || (live_bytes_ < kMaxLiveBytesPerThread && r < 450)) {
        Malloc();
      } else if (r < 800) {
        FreeAt(Uniform(0, live_.size() - 1));
      } else if (r < 900) {
        UseOnOtherStreamAndFree();
      } else if (r < 950) {
        Live& a = live_[Uniform(0, live_.size() - 1)];
        s_.alloc->RecordStream(a.ptr, RandomStream());  // freed later, like any other
      } else if (r < 975) {
        s_.alloc->ProcessEvents(0);
        CheckStatsSane();
      } else if (r < 995) {
        CheckSnapshotSane();
      } else {
        s_.alloc->EmptyCache();
      }
      RetireCopies(/*wait=*/false);
      if (op % 200 == 199) {
        for (const Live& a : live_) VerifyPattern(a);
      }
    }
    while (!live_.empty()) FreeAt(live_.size() - 1);
    RetireCopies(/*wait=*/true);
    // Blocks of this stream stay cached under its id; events recorded on it stay queryable.
    s_.backend->destroy_stream(0, own_.handle);
  }

 private:
  struct Live {
    void* ptr;
    size_t size;
    uint64_t tag;
  };
  struct Copy {
    EventHandle done;
    std::unique_ptr<unsigned char[]> host;
    size_t bytes;
    uint64_t tag;
  };

  uint64_t Uniform(uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_);
  }

  StreamRef RandomStream() {
    const uint64_t i = Uniform(0, kSharedStreams);
    return i == kSharedStreams ? own_ : s_.streams[i];
  }

  size_t RandomSize() {
    const uint64_t r = Uniform(0, 999);
    if (r < 500) return Uniform(1, 4 * kKiB);
    if (r < 900) return Uniform(4 * kKiB, 256 * kKiB);
    if (r < 980) return Uniform(256 * kKiB, 2 * kMiB);
    return Uniform(2 * kMiB, 12 * kMiB);
  }

  void Malloc() {
    const size_t size = RandomSize();
    const StreamRef stream = RandomStream();
    void* p = nullptr;
    try {
      // Both entry points: by stream identity and by raw handle.
      p = Uniform(0, 1) == 0 ? s_.alloc->Malloc(size, 0, stream)
                             : s_.alloc->Malloc(size, 0, stream.handle);
    } catch (const OutOfMemoryError& e) {
      s_.ooms.fetch_add(1);
      ADD_FAILURE() << "thread " << index_ << ": " << e.what();
      return;
    }
    ASSERT_NE(p, nullptr);
    const std::optional<AllocationInfo> info = s_.alloc->Lookup(p);
    ASSERT_TRUE(info.has_value());
    EXPECT_EQ(info->requested, size);
    EXPECT_GE(info->size, size);
    EXPECT_EQ(info->stream.id, stream.id);
    const uint64_t tag = (static_cast<uint64_t>(index_ + 1) << 40) | next_tag_++;
    testing::BytePattern(tag).Fill(p, 0, size);
    live_.push_back(Live{p, size, tag});
    live_bytes_ += size;
    s_.mallocs.fetch_add(1, std::memory_order_relaxed);
  }

  void VerifyPattern(const Live& a) {
    EXPECT_EQ(testing::BytePattern(a.tag).FirstMismatch(a.ptr, 0, a.size), a.size)
        << "thread " << index_ << ": allocation at " << a.ptr << " (" << a.size
        << " bytes) was overwritten while live";
  }

  void FreeAt(size_t i) {
    const Live a = live_[i];
    live_[i] = live_.back();
    live_.pop_back();
    live_bytes_ -= a.size;
    VerifyPattern(a);
    if (Uniform(0, 1) == 0) {
      s_.alloc->Free(a.ptr);
    } else {
      s_.alloc->Free(a.ptr, 0);
    }
  }

  // Reads the block back on another stream, records that stream and frees at once: the block may
  // only be handed out again after the copy ran, or the copy sees someone else's pattern.
  void UseOnOtherStreamAndFree() {
    const size_t i = Uniform(0, live_.size() - 1);
    const Live a = live_[i];
    const std::optional<AllocationInfo> info = s_.alloc->Lookup(a.ptr);
    ASSERT_TRUE(info.has_value());
    StreamRef use = RandomStream();
    if (use.id == info->stream.id) return;  // never copy on the allocation stream itself
    Copy c{nullptr, nullptr, std::min(a.size, kMaxCopyBytes), a.tag};
    c.host = std::make_unique<unsigned char[]>(c.bytes);
    s_.backend->memcpy_async(0, c.host.get(), a.ptr, c.bytes, CopyKind::kDeviceToHost, use.handle);
    c.done = s_.backend->create_event(0);
    s_.backend->record_event(0, c.done, use.handle);
    copies_.push_back(std::move(c));
    s_.alloc->RecordStream(a.ptr, use);
    s_.pending_frees.fetch_add(1, std::memory_order_relaxed);
    FreeAt(i);
  }

  void RetireCopies(bool wait) {
    for (auto it = copies_.begin(); it != copies_.end();) {
      if (wait) {
        s_.backend->synchronize_event(0, it->done);
      } else if (!s_.backend->query_event(0, it->done)) {
        ++it;
        continue;
      }
      EXPECT_EQ(testing::BytePattern(it->tag).FirstMismatch(it->host.get(), 0, it->bytes),
                it->bytes)
          << "thread " << index_ << ": a copy on another stream read a block after it was reused";
      s_.backend->destroy_event(0, it->done);
      it = copies_.erase(it);
    }
  }

  void CheckStatsSane() {
    const DeviceStats stats = s_.alloc->stats(0);
    EXPECT_GE(stats.allocation.all().current, static_cast<int64_t>(live_.size()));
    EXPECT_GE(stats.allocated_bytes.all().current, static_cast<int64_t>(live_bytes_));
    EXPECT_LE(stats.allocated_bytes.all().current, stats.active_bytes.all().current);
    EXPECT_LE(stats.active_bytes.all().current, stats.reserved_bytes.all().current);
    EXPECT_GE(stats.allocated_bytes.all().peak, stats.allocated_bytes.all().current);
  }

  // Snapshots taken while other threads allocate must still be self-consistent, and contain
  // every allocation of this thread.
  void CheckSnapshotSane() {
    const Snapshot snap = s_.alloc->TakeSnapshot();
    std::vector<uintptr_t> allocated;
    for (const SegmentSnapshot& seg : snap.segments) {
      uintptr_t cursor = seg.address;
      for (const BlockSnapshot& b : seg.blocks) {
        EXPECT_EQ(b.address, cursor);
        cursor += b.size;
        if (b.state == BlockState::kActiveAllocated) allocated.push_back(b.address);
      }
      EXPECT_EQ(cursor, seg.address + seg.total_size);
    }
    std::sort(allocated.begin(), allocated.end());
    for (const Live& a : live_) {
      EXPECT_TRUE(std::binary_search(allocated.begin(), allocated.end(),
                                     reinterpret_cast<uintptr_t>(a.ptr)))
          << "thread " << index_ << ": live allocation missing from the snapshot";
    }
  }

  Shared& s_;
  const int index_;
  std::mt19937_64 rng_;
  StreamRef own_;
  std::vector<Live> live_;
  size_t live_bytes_ = 0;
  std::vector<Copy> copies_;
  uint64_t next_tag_ = 1;
};

TEST(AllocatorStressTest, FourThreadsSharedAndOwnStreams) {
  ScopedFailureFlag failures;
  Shared shared;
  shared.failures = &failures;
  shared.backend = std::make_shared<SimBackend>(
      SimBackend::Options{.devices = 1,
                          .capacity_bytes = size_t{1} << 30,
                          .max_jitter = std::chrono::microseconds(30)});
  CachingAllocator alloc(shared.backend, AllocatorConfig{});
  shared.alloc = &alloc;
  shared.streams[0] = shared.backend->default_stream(0);
  for (int i = 1; i < kSharedStreams; ++i) shared.streams[i] = shared.backend->create_stream(0);

  {
    std::vector<std::unique_ptr<Worker>> workers;
    std::vector<std::thread> threads;
    workers.reserve(kThreads);
    threads.reserve(kThreads);
    for (int t = 0; t < kThreads; ++t) workers.push_back(std::make_unique<Worker>(shared, t));
    for (int t = 0; t < kThreads; ++t) threads.emplace_back([&w = *workers[t]] { w.Run(); });
    for (std::thread& t : threads) t.join();
  }
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_EQ(shared.ooms.load(), 0);
  EXPECT_GT(shared.pending_frees.load(), 100) << "the run must exercise frees with stream uses";

  // Every use recorded on a shared stream completes once that stream is drained; uses on the
  // threads' own streams completed when those streams were destroyed.
  for (const StreamRef& s : shared.streams) shared.backend->synchronize_stream(0, s.handle);
  alloc.ProcessEvents(0);
  DeviceStats stats = alloc.stats(0);
  EXPECT_EQ(stats.allocation.all().current, 0);
  EXPECT_EQ(stats.allocation.all().allocated, shared.mallocs.load());
  EXPECT_EQ(stats.allocation.all().freed, shared.mallocs.load());
  EXPECT_EQ(stats.allocated_bytes.all().current, 0);
  EXPECT_EQ(stats.requested_bytes.all().current, 0);
  EXPECT_EQ(stats.active.all().current, 0);
  EXPECT_EQ(stats.active_bytes.all().current, 0);
  EXPECT_GT(stats.reserved_bytes.all().current, 0);
  for (const SegmentSnapshot& seg : alloc.TakeSnapshot().segments) {
    EXPECT_EQ(seg.blocks.size(), 1u) << "free neighbours not merged";
    for (const BlockSnapshot& b : seg.blocks) EXPECT_EQ(BlockStateName(b.state), "inactive");
  }

  alloc.EmptyCache();
  stats = alloc.stats(0);
  EXPECT_EQ(stats.reserved_bytes.all().current, 0);
  EXPECT_EQ(stats.segment.all().current, 0);
  EXPECT_EQ(stats.inactive_split.all().current, 0);
  EXPECT_EQ(stats.inactive_split_bytes.all().current, 0);
  EXPECT_EQ(stats.num_device_alloc, stats.num_device_free);
  EXPECT_EQ(shared.backend->bytes_in_use(0), 0u);
  EXPECT_TRUE(alloc.TakeSnapshot().segments.empty());
}

}  // namespace
}  // namespace spillway
