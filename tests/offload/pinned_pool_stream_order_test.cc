// The pinned host memory pool's stream-ordered frees: a buffer freed with a stream is reused,
// coalesced or given back only once its last use there is over (an event, or a wait on the host
// when no event can be recorded), and one whose stream cannot be waited on stays quarantined; the
// destructor; the history in PyTorch's terms; threads. Placement, sizing, limits and failures:
// pinned_pool_blocks_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "allocator/backend_raii.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"
#include "offload/pinned_pool.h"
#include "tests/offload/pinned_pool_test_util.h"

namespace spillway::testing {
namespace {

// A stream kept busy by the simulated device's jitter: each op sleeps a random 0..20 ms before it
// runs, so a chain of ops keeps the stream working for a while. With the fixed seed the sleeps
// are the same on every run; each test still checks that the stream really was busy.
class OffloadPinnedPoolEvents : public ::testing::Test {
 protected:
  static SimBackend::Options Jittery() {
    SimBackend::Options options;
    options.max_jitter = std::chrono::milliseconds(20);
    return options;
  }
  void KeepBusy() {
    for (int i = 0; i < 16; ++i) scratch_.record(stream_.handle());
  }

  SimBackend backend_{Jittery()};
  UniqueStream stream_{backend_, 0};
  UniqueEvent scratch_{backend_, 0};
};

TEST_F(OffloadPinnedPoolEvents, BufferIsReusedOnlyAfterItsLastUseCompletes) {
  PinnedPool pool(backend_, 0, Grow(0));
  absl::StatusOr<UniqueDeviceBuffer> device = UniqueDeviceBuffer::Allocate(backend_, 0, 64 * kKiB);
  ASSERT_TRUE(device.ok()) << device.status();
  void* p = Take(pool, 64 * kKiB);
  KeepBusy();
  // The last use: a device-to-host copy into p, still queued behind the busy work.
  backend_.memcpy_async(0, p, device->data(), 64 * kKiB, CopyKind::kDeviceToHost, stream_.handle());
  UniqueEvent copied(backend_, 0);
  copied.record(stream_.handle());
  pool.Free(p, stream_.ref());
  EXPECT_EQ(pool.in_use_bytes(), 64 * kKiB);
  pool.Trim();
  EXPECT_EQ(pool.reserved_bytes(), 64 * kKiB) << "a chunk with a pending copy was returned";

  ASSERT_FALSE(copied.query()) << "precondition: the stream finished too early for this test";
  void* q = Take(pool, 64 * kKiB);
  EXPECT_NE(q, p) << "buffer handed out while a copy into it was still queued";
  EXPECT_EQ(pool.num_backend_allocs(), 2);

  backend_.synchronize_stream(0, stream_.handle());
  EXPECT_EQ(backend_.num_copies(), 1);
  void* r = Take(pool, 64 * kKiB);
  EXPECT_EQ(r, p) << "buffer not reused after its last use completed";
  EXPECT_EQ(pool.num_backend_allocs(), 2);
  pool.Free(q);
  pool.Free(r);
}

TEST_F(OffloadPinnedPoolEvents, PendingBufferDoesNotCoalesceUntilItsEventCompletes) {
  PinnedPool pool(backend_, 0, Grow(kMiB));
  void* a = Take(pool, 512 * kKiB);
  void* b = Take(pool, 512 * kKiB);
  ASSERT_EQ(b, Offset(a, 512 * kKiB));
  KeepBusy();
  UniqueEvent marker(backend_, 0);
  marker.record(stream_.handle());
  pool.Free(a, stream_.ref());
  pool.Free(b);

  ASSERT_FALSE(marker.query()) << "precondition: the stream finished too early for this test";
  void* other = Take(pool, kMiB);
  EXPECT_NE(other, a) << "a pending buffer was merged into a free neighbour";
  EXPECT_EQ(pool.num_backend_allocs(), 2);

  backend_.synchronize_stream(0, stream_.handle());
  EXPECT_EQ(Take(pool, kMiB), a);  // a completed, merged with b: the whole first chunk
  EXPECT_EQ(pool.num_backend_allocs(), 2);
}

TEST_F(OffloadPinnedPoolEvents, FreeWaitsOnTheHostWhenNoEventCanBeRecorded) {
  PinnedPool pool(backend_, 0, Grow(kMiB));
  void* p = Take(pool, 4 * kKiB);
  KeepBusy();
  UniqueEvent marker(backend_, 0);
  marker.record(stream_.handle());
  backend_.fail_event_after(1);  // the pool's first create_event
  pool.Free(p, stream_.ref());
  EXPECT_TRUE(marker.query()) << "Free released the buffer before the stream's work completed";
  EXPECT_EQ(pool.in_use_bytes(), 0u);
  EXPECT_EQ(Take(pool, 4 * kKiB), p);
}

// No event for the free, and the host wait reports an earlier copy's failure: the wait drained
// the stream all the same, so the buffer goes back (and the failure is passed on, naming it).
TEST(OffloadPinnedPool, ABufferComesBackWhenTheHostWaitHearsAnEarlierFailure) {
  SimBackend backend(SimBackend::Options{});
  PinnedPool pool(backend, 0, Grow(kMiB));
  UniqueStream stream(backend, 0);
  absl::StatusOr<UniqueDeviceBuffer> device = UniqueDeviceBuffer::Allocate(backend, 0, 4 * kKiB);
  ASSERT_TRUE(device.ok()) << device.status();
  void* p = Take(pool, 4 * kKiB);
  backend.fail_copy_after(1);
  backend.memcpy_async(0, p, device->data(), 4 * kKiB, CopyKind::kDeviceToHost, stream.handle());
  backend.fail_event_after(1);  // the pool's create_event: no event, a host wait instead
  try {
    pool.Free(p, stream.ref());
    ADD_FAILURE() << "the copy's failure was not passed on";
  } catch (const PinnedPool::StreamFailure& e) {
    EXPECT_EQ(e.stream_id(), stream.ref().id);
  }
  backend.fail_event_after(-1);
  EXPECT_EQ(pool.in_use_bytes(), 0u) << "a buffer whose stream had drained stayed quarantined";
  EXPECT_EQ(Take(pool, 4 * kKiB), p);
}

TEST(OffloadPinnedPool, BufferStaysQuarantinedWhenItsStreamCannotBeWaitedOn) {
  SimBackend::Options options;
  options.devices = 2;
  SimBackend backend(options);
  PinnedPool pool(backend, 0, Grow(kMiB));
  UniqueStream foreign(backend, 1);  // the pool's events live on device 0
  void* p = Take(pool, 4 * kKiB);
  EXPECT_THROW(pool.Free(p, foreign.ref()), BackendError);
  EXPECT_EQ(pool.in_use_bytes(), 4 * kKiB);
  EXPECT_NE(Take(pool, 4 * kKiB), p) << "a buffer whose last use is unknown was reused";
  EXPECT_THROW(pool.Free(p), InvalidArgumentError);
}

TEST_F(OffloadPinnedPoolEvents, DestructorReturnsEveryChunk) {
  {
    PinnedPool pool(backend_, 0, Grow(kMiB));
    Take(pool, 4 * kKiB);  // never freed
    void* pending = Take(pool, 2 * kMiB);
    KeepBusy();
    pool.Free(pending, stream_.ref());
    EXPECT_EQ(backend_.host_bytes_in_use(), 3 * kMiB);
  }
  EXPECT_EQ(backend_.host_bytes_in_use(), 0u);
}

// The history snapshots show as torch 2.14's host_traces, and the chunks as its host_segments
// (hooks/snapshot.cc): chunks taken and given back, buffers handed out, freed, and reusable,
// the last only once a freed buffer's last use is over.
TEST(OffloadPinnedPool, RecordsItsHistoryAndShowsItsChunksInPyTorchsTerms) {
  SimBackend backend;
  UniqueStream stream(backend, 0);
  PinnedPool pool(backend, 0, Grow(kMiB));
  pool.Free(Take(pool, 4 * kKiB));  // history off: nothing recorded
  EXPECT_FALSE(pool.history_enabled());
  EXPECT_TRUE(pool.history().empty());

  pool.RecordHistory(true, 100);
  void* a = Take(pool, 4 * kKiB);                          // from the cached chunk
  void* big = Take(pool, 2 * kMiB);                        // a chunk of its own
  const uintptr_t first = reinterpret_cast<uintptr_t>(a);  // the first chunk's base
  const uintptr_t second = reinterpret_cast<uintptr_t>(big);
  // Held until the host waits for the stream: freeing a chunk does (cudaFreeHost synchronizes).
  std::unique_ptr<SimBackend::StreamHold> hold =
      backend.hold_stream(0, stream.handle(), SimBackend::HoldRelease::kWhenHostWaits);
  pool.Free(a, stream.ref());  // its last use is held back: pending

  const std::vector<SegmentSnapshot> chunks = pool.Chunks();
  ASSERT_EQ(chunks.size(), 2u);
  for (const SegmentSnapshot& c : chunks) {
    EXPECT_EQ(c.device, -1);
    EXPECT_EQ(c.stream, 0u);
    EXPECT_EQ(c.requested_size, c.total_size);
    if (c.address == first) {
      EXPECT_EQ(c.total_size, kMiB);
      EXPECT_EQ(c.allocated_size, 0u);
      EXPECT_EQ(c.active_size, 4 * kKiB);
      ASSERT_EQ(c.blocks.size(), 2u);
      EXPECT_EQ(c.blocks[0].address, first);
      EXPECT_EQ(c.blocks[0].size, 4 * kKiB);
      EXPECT_EQ(c.blocks[0].state, BlockState::kActivePendingFree);
      EXPECT_EQ(c.blocks[1].address, first + 4 * kKiB);
      EXPECT_EQ(c.blocks[1].size, kMiB - 4 * kKiB);
      EXPECT_EQ(c.blocks[1].state, BlockState::kInactive);
    } else {
      EXPECT_EQ(c.address, second);
      EXPECT_EQ(c.total_size, 2 * kMiB);
      EXPECT_EQ(c.allocated_size, 2 * kMiB);
      EXPECT_EQ(c.active_size, 2 * kMiB);
      ASSERT_EQ(c.blocks.size(), 1u);
      EXPECT_EQ(c.blocks[0].state, BlockState::kActiveAllocated);
      EXPECT_EQ(c.blocks[0].requested_size, 2 * kMiB);
    }
  }

  pool.Free(big);  // no last use: reusable at once
  // a is still pending when the first Trim looks, so only the second chunk goes; giving it back
  // waits for the stream, and the second Trim finds a's last use over: it and its chunk go too.
  pool.Trim();
  EXPECT_TRUE(hold->opened_by_wait());
  pool.Trim();

  using Step = std::tuple<TraceAction, uintptr_t, size_t>;
  std::vector<Step> steps;
  int64_t previous_time = 0;
  for (const TraceEntry& e : pool.history()) {
    steps.emplace_back(e.action, e.addr, e.size);
    EXPECT_EQ(e.device, -1);
    EXPECT_EQ(e.stream, 0u);
    EXPECT_EQ(e.context, nullptr);
    EXPECT_GE(e.time_us, previous_time);
    previous_time = e.time_us;
  }
  const std::vector<Step> expected = {
      {TraceAction::kAlloc, first, 4 * kKiB},
      {TraceAction::kSegmentAlloc, second, 2 * kMiB},
      {TraceAction::kAlloc, second, 2 * kMiB},
      {TraceAction::kFreeRequested, first, 4 * kKiB},
      {TraceAction::kFreeRequested, second, 2 * kMiB},
      {TraceAction::kFreeCompleted, second, 2 * kMiB},
      {TraceAction::kSegmentFree, second, 2 * kMiB},
      {TraceAction::kFreeCompleted, first, 4 * kKiB},
      {TraceAction::kSegmentFree, first, kMiB},
  };
  EXPECT_EQ(steps, expected);
  EXPECT_TRUE(pool.Chunks().empty());

  pool.RecordHistory(false, 100);  // stopping forgets, as the allocator's history does
  EXPECT_FALSE(pool.history_enabled());
  EXPECT_TRUE(pool.history().empty());
  pool.Free(Take(pool, 4 * kKiB));
  EXPECT_TRUE(pool.history().empty());
}

TEST(OffloadPinnedPool, MultiThreadedSmoke) {
  SimBackend backend;
  PinnedPool pool(backend, 0, Grow(4 * kMiB));
  constexpr int kThreads = 4;
  constexpr int kTagsPerThread = 50;  // 4 * 50 tags fit in a byte
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&pool, &backend, t] {
      UniqueStream stream(backend, 0);
      std::mt19937_64 rng(static_cast<uint64_t>(t) + 1);
      struct Live {
        void* ptr;
        size_t bytes;
        unsigned char tag;
      };
      std::vector<Live> live;
      int next_tag = 0;
      auto release = [&](size_t i) {
        const Live buffer = live[i];
        const auto* bytes = static_cast<const unsigned char*>(buffer.ptr);
        EXPECT_TRUE(std::all_of(bytes, bytes + buffer.bytes, [&](unsigned char b) {
          return b == buffer.tag;
        })) << "a buffer was overwritten while live: buffers overlap";
        pool.Free(buffer.ptr,
                  rng() % 2 == 0 ? std::optional<StreamRef>(stream.ref()) : std::nullopt);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      };
      for (int i = 0; i < 400; ++i) {
        if (live.size() < 8 && rng() % 2 == 0) {
          const size_t bytes = 1 + rng() % (128 * kKiB);
          absl::StatusOr<void*> ptr = pool.Allocate(bytes);
          if (!ptr.ok()) {
            ADD_FAILURE() << ptr.status();
            continue;
          }
          const auto tag = static_cast<unsigned char>(t * kTagsPerThread + next_tag);
          next_tag = (next_tag + 1) % kTagsPerThread;
          std::memset(*ptr, tag, bytes);
          live.push_back(Live{*ptr, bytes, tag});
        } else if (!live.empty()) {
          release(rng() % live.size());
        }
      }
      while (!live.empty()) release(live.size() - 1);
      backend.synchronize_stream(0, stream.handle());
    });
  }
  for (std::thread& thread : threads) thread.join();
  pool.Trim();  // also completes the pending frees, whose streams are drained
  EXPECT_EQ(pool.in_use_bytes(), 0u);
  EXPECT_EQ(pool.reserved_bytes(), 0u);
  EXPECT_EQ(backend.host_bytes_in_use(), 0u);
  EXPECT_GE(pool.peak_reserved_bytes(), 4 * kMiB);
}

}  // namespace
}  // namespace spillway::testing
