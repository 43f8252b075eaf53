// The simulated device's own promises, beyond the Backend contract that
// backend_conformance_test.cc checks: asynchrony (an unordered read can see stale data, an ordered
// one never does), capacity and thread safety. Its test controls: sim_controls_test.cc.
#include "allocator/sim_backend.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/backend.h"
#include "allocator/backend_raii.h"
#include "allocator/errors.h"
#include "tests/allocator/test_util.h"
#include "tests/sanitizers.h"

// Reading memory that a worker may be writing is the point of the stale-data tests, and exactly
// what ThreadSanitizer rightly reports; those tests skip themselves under TSan.

namespace spillway::testing {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

TEST(SimBackendTest, EnqueueReturnsBeforeTheCopyRuns) {
  // Race-free evidence of asynchrony (valid under TSan): the completion counter and an event
  // recorded right after the copy still show it pending.
  SimBackend backend(JitterOptions(2ms));
  constexpr size_t kBytes = 4096;
  UniqueHostBuffer src = Unwrap(UniqueHostBuffer::Allocate(backend, kBytes));
  UniqueDeviceBuffer device = Unwrap(UniqueDeviceBuffer::Allocate(backend, 0, kBytes));
  UniqueEvent event(backend, 0);
  int pending_seen = 0;
  constexpr int kTrials = 10;
  for (int trial = 0; trial < kTrials; ++trial) {
    const int64_t copies_before = backend.num_copies();
    backend.memcpy_async(0, device.data(), src.data(), kBytes, CopyKind::kHostToDevice, nullptr);
    event.record(nullptr);
    if (backend.num_copies() == copies_before && !event.query()) ++pending_seen;
    event.synchronize();
    EXPECT_EQ(backend.num_copies(), copies_before + 1);
  }
  EXPECT_GE(pending_seen, 1) << "no copy was ever pending right after memcpy_async returned";
}

TEST(SimBackendTest, ReadWithoutWaitSeesStaleDataButWaitedReadNeverDoes) {
#ifdef SPILLWAY_UNDER_TSAN
  GTEST_SKIP() << "reads memory a worker may be writing on purpose; TSan would report that race";
#endif
  SimBackend backend(JitterOptions(2ms));
  constexpr size_t kBytes = 4096;
  UniqueHostBuffer src = Unwrap(UniqueHostBuffer::Allocate(backend, kBytes));
  UniqueHostBuffer dst = Unwrap(UniqueHostBuffer::Allocate(backend, kBytes));
  UniqueDeviceBuffer device = Unwrap(UniqueDeviceBuffer::Allocate(backend, 0, kBytes));
  UniqueStream stream(backend, 0);
  UniqueEvent copied(backend, 0);
  std::memset(src.data(), 0xAB, kBytes);
  backend.memcpy_async(0, device.data(), src.data(), kBytes, CopyKind::kHostToDevice, nullptr);
  backend.synchronize_stream(0, nullptr);

  constexpr int kTrials = 20;
  int stale_without_wait = 0;
  int stale_with_wait = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    // Without a wait: look at the destination right after enqueueing the copy.
    std::memset(dst.data(), 0, kBytes);
    backend.memcpy_async(0, dst.data(), device.data(), kBytes, CopyKind::kDeviceToHost,
                         stream.handle());
    const volatile uint8_t* const first = static_cast<const uint8_t*>(dst.data());
    if (*first != 0xAB) ++stale_without_wait;
    backend.synchronize_stream(0, stream.handle());

    // With a wait on an event recorded after the copy: always fresh.
    std::memset(dst.data(), 0, kBytes);
    backend.memcpy_async(0, dst.data(), device.data(), kBytes, CopyKind::kDeviceToHost,
                         stream.handle());
    copied.record(stream.handle());
    copied.synchronize();
    if (!AllBytesEqual(dst.data(), kBytes, 0xAB)) ++stale_with_wait;
  }
  EXPECT_GE(stale_without_wait, 1) << "the simulator behaved synchronously in every trial";
  EXPECT_EQ(stale_with_wait, 0);
}

TEST(SimBackendTest, ConsumerStreamWithoutWaitSeesStaleDataWithWaitNever) {
#ifdef SPILLWAY_UNDER_TSAN
  GTEST_SKIP() << "the no-wait half races two workers on purpose; TSan would report that race";
#endif
  SimBackend backend(JitterOptions(2ms));
  constexpr size_t kBytes = 4096;
  UniqueHostBuffer fresh = Unwrap(UniqueHostBuffer::Allocate(backend, kBytes));
  UniqueHostBuffer zeros = Unwrap(UniqueHostBuffer::Allocate(backend, kBytes));
  UniqueHostBuffer out = Unwrap(UniqueHostBuffer::Allocate(backend, kBytes));
  UniqueDeviceBuffer a = Unwrap(UniqueDeviceBuffer::Allocate(backend, 0, kBytes));
  UniqueStream producer(backend, 0);
  UniqueStream consumer(backend, 0);
  UniqueEvent produced(backend, 0);
  std::memset(fresh.data(), 0x5A, kBytes);
  std::memset(zeros.data(), 0, kBytes);

  constexpr int kTrials = 20;
  for (const bool wait : {false, true}) {
    int stale = 0;
    for (int trial = 0; trial < kTrials; ++trial) {
      backend.memcpy_async(0, a.data(), zeros.data(), kBytes, CopyKind::kHostToDevice,
                           producer.handle());
      backend.synchronize_stream(0, producer.handle());
      backend.memcpy_async(0, a.data(), fresh.data(), kBytes, CopyKind::kHostToDevice,
                           producer.handle());
      produced.record(producer.handle());
      if (wait) backend.stream_wait_event(0, consumer.handle(), produced.handle());
      backend.memcpy_async(0, out.data(), a.data(), kBytes, CopyKind::kDeviceToHost,
                           consumer.handle());
      backend.synchronize_stream(0, consumer.handle());
      backend.synchronize_stream(0, producer.handle());
      if (!AllBytesEqual(out.data(), kBytes, 0x5A)) ++stale;
    }
    if (wait) {
      EXPECT_EQ(stale, 0) << "stream_wait_event did not order the consumer";
    } else {
      EXPECT_GE(stale, 1) << "streams never overlapped: they are not independent";
    }
  }
}

TEST(SimBackendTest, StreamWaitEventUsesTheRecordCurrentAtCallTime) {
  SimBackend backend(JitterOptions(2ms));
  UniqueStream producer(backend, 0);
  UniqueStream consumer(backend, 0);
  UniqueEvent event(backend, 0);
  UniqueEvent consumer_done(backend, 0);
  constexpr size_t kBytes = 4096;
  UniqueHostBuffer src = Unwrap(UniqueHostBuffer::Allocate(backend, kBytes));
  UniqueDeviceBuffer device = Unwrap(UniqueDeviceBuffer::Allocate(backend, 0, kBytes));

  event.record(producer.handle());  // Captures (almost) nothing.
  backend.stream_wait_event(0, consumer.handle(), event.handle());
  // Re-record after ~100 ms of producer work; the consumer's wait must not see this record.
  for (int i = 0; i < 100; ++i) {
    backend.memcpy_async(0, device.data(), src.data(), kBytes, CopyKind::kHostToDevice,
                         producer.handle());
  }
  event.record(producer.handle());
  consumer_done.record(consumer.handle());
  consumer_done.synchronize();
  EXPECT_FALSE(event.query()) << "consumer waited for a record made after its wait";
  event.synchronize();
}

TEST(SimBackendTest, DeviceCapacityIsEnforcedPerDevice) {
  SimBackend::Options options;
  options.devices = 2;
  options.capacity_bytes = kMiB;
  SimBackend backend(options);

  void* const whole = Unwrap(backend.device_malloc(0, kMiB));
  EXPECT_EQ(backend.bytes_in_use(0), kMiB);
  EXPECT_EQ(backend.mem_info(0).free_bytes, 0u);
  EXPECT_EQ(backend.mem_info(0).total_bytes, kMiB);

  const absl::StatusOr<void*> over = backend.device_malloc(0, 1);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("requested 1 bytes"));
  EXPECT_THAT(over.status().message(), HasSubstr("device 0"));
  EXPECT_THAT(over.status().message(), HasSubstr("1048576 of 1048576 bytes in use"));
  EXPECT_EQ(backend.num_failed_device_mallocs(), 1);

  // The other device has its own capacity.
  void* const other = Unwrap(backend.device_malloc(1, kMiB));
  EXPECT_EQ(backend.bytes_in_use(1), kMiB);

  backend.device_free(0, whole);
  EXPECT_EQ(backend.bytes_in_use(0), 0u);
  void* const again = Unwrap(backend.device_malloc(0, kMiB / 2));
  void* const rest = Unwrap(backend.device_malloc(0, kMiB / 2));
  EXPECT_FALSE(backend.device_malloc(0, 1).ok());
  backend.device_free(0, again);
  backend.device_free(0, rest);
  backend.device_free(1, other);
  EXPECT_EQ(backend.num_device_mallocs(), 4);
  EXPECT_EQ(backend.num_device_frees(), 4);
  EXPECT_THROW(backend.bytes_in_use(2), InvalidArgumentError);
}

TEST(SimBackendTest, DeviceMemoryIsAlignedTo512Bytes) {
  SimBackend backend;
  std::vector<UniqueDeviceBuffer> buffers;
  for (const size_t bytes : {1, 7, 511, 513, 4097}) {
    buffers.push_back(Unwrap(UniqueDeviceBuffer::Allocate(backend, 0, bytes)));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffers.back().data()) % 512, 0u) << bytes;
  }
}

TEST(SimBackendTest, HostCapacityIsEnforcedWhenSet) {
  SimBackend::Options options;
  options.host_capacity_bytes = kMiB;
  SimBackend backend(options);
  void* const ptr = Unwrap(backend.host_malloc(kMiB));
  EXPECT_EQ(backend.host_bytes_in_use(), kMiB);
  const absl::StatusOr<void*> over = backend.host_malloc(1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("requested 1 bytes"));
  backend.host_free(ptr);
  EXPECT_EQ(backend.host_bytes_in_use(), 0u);
  backend.host_free(Unwrap(backend.host_malloc(kMiB)));
}

TEST(SimBackendTest, FreeingUnknownPointersThrows) {
  SimBackend::Options options;
  options.devices = 2;
  SimBackend backend(options);
  int on_stack = 0;
  void* const ptr = Unwrap(backend.device_malloc(0, 4096));
  EXPECT_THROW(backend.device_free(0, &on_stack), BackendError);
  EXPECT_THROW(backend.device_free(0, static_cast<char*>(ptr) + 512), BackendError);  // Interior.
  EXPECT_THROW(backend.device_free(1, ptr), BackendError);  // Wrong device.
  EXPECT_THROW(backend.device_free(2, ptr), InvalidArgumentError);
  backend.device_free(0, ptr);
  EXPECT_THROW(backend.device_free(0, ptr), BackendError);  // Double free.

  void* const host = Unwrap(backend.host_malloc(4096));
  EXPECT_THROW(backend.host_free(&on_stack), BackendError);
  backend.host_free(host);
  EXPECT_THROW(backend.host_free(host), BackendError);
  EXPECT_EQ(backend.num_device_frees(), 1);
}

TEST(SimBackendTest, CopiesOutsideLiveDeviceAllocationsThrow) {
  SimBackend backend;
  constexpr size_t kBytes = 4096;
  UniqueHostBuffer host = Unwrap(UniqueHostBuffer::Allocate(backend, kBytes));
  void* const device = Unwrap(backend.device_malloc(0, kBytes));
  char* const end = static_cast<char*>(device) + kBytes;
  EXPECT_THROW(backend.memcpy_async(0, end - 10, host.data(), 20, CopyKind::kHostToDevice, nullptr),
               BackendError);
  EXPECT_THROW(
      backend.memcpy_async(0, host.data(), host.data(), 16, CopyKind::kDeviceToHost, nullptr),
      BackendError);
  EXPECT_THROW(backend.memcpy_async(0, device, static_cast<char*>(device) + 8, 64,
                                    CopyKind::kDeviceToDevice, nullptr),
               BackendError);  // Overlap.
  backend.memcpy_async(0, end - 10, host.data(), 10, CopyKind::kHostToDevice, nullptr);
  backend.device_free(0, device);
  EXPECT_THROW(backend.memcpy_async(0, host.data(), device, 16, CopyKind::kDeviceToHost, nullptr),
               BackendError);  // Use after free.
  // The call's own error, not one of earlier work: callers must not blame copies in flight.
  try {
    backend.memcpy_async(0, nullptr, host.data(), 16, CopyKind::kHostToDevice, nullptr);
    ADD_FAILURE() << "a copy to null was accepted";
  } catch (const BackendError& e) {
    EXPECT_FALSE(e.earlier_work());
  }
}

TEST(SimBackendTest, StreamMisuseThrows) {
  SimBackend::Options options;
  options.devices = 2;
  SimBackend backend(options);
  EXPECT_THROW(backend.destroy_stream(0, nullptr), BackendError);
  const StreamRef on_one = backend.create_stream(1);
  EXPECT_THROW(backend.synchronize_stream(0, on_one.handle), BackendError);
  backend.destroy_stream(1, on_one.handle);
  EXPECT_THROW(backend.destroy_stream(1, on_one.handle), BackendError);
  EXPECT_THROW(backend.resolve_stream(1, on_one.handle), BackendError);
  EXPECT_NE(backend.default_stream(0).id, backend.default_stream(1).id);

  const EventHandle event = backend.create_event(0);
  backend.destroy_event(0, event);
  EXPECT_THROW(backend.query_event(0, event), BackendError);
  EXPECT_THROW(backend.destroy_event(0, event), BackendError);
}

TEST(SimBackendTest, DestroyStreamRunsQueuedWorkFirst) {
  SimBackend backend(JitterOptions(1ms));
  constexpr size_t kBytes = 4096;
  constexpr int kCopies = 10;
  UniqueHostBuffer src = Unwrap(UniqueHostBuffer::Allocate(backend, kBytes));
  UniqueHostBuffer dst = Unwrap(UniqueHostBuffer::Allocate(backend, kBytes));
  UniqueDeviceBuffer device = Unwrap(UniqueDeviceBuffer::Allocate(backend, 0, kBytes));
  FillPattern(src.data(), kBytes, 77);
  std::memset(dst.data(), 0, kBytes);
  const StreamRef stream = backend.create_stream(0);
  for (int i = 0; i < kCopies - 1; ++i) {
    backend.memcpy_async(0, device.data(), src.data(), kBytes, CopyKind::kHostToDevice,
                         stream.handle);
  }
  backend.memcpy_async(0, dst.data(), device.data(), kBytes, CopyKind::kDeviceToHost,
                       stream.handle);
  backend.destroy_stream(0, stream.handle);
  EXPECT_EQ(backend.num_copies(), kCopies);
  EXPECT_EQ(FirstPatternMismatch(dst.data(), kBytes, 77), -1);
}

TEST(SimBackendTest, CopyCountersCountBytesPerKind) {
  SimBackend backend;
  UniqueHostBuffer host = Unwrap(UniqueHostBuffer::Allocate(backend, 1000));
  UniqueDeviceBuffer a = Unwrap(UniqueDeviceBuffer::Allocate(backend, 0, 1000));
  UniqueDeviceBuffer b = Unwrap(UniqueDeviceBuffer::Allocate(backend, 0, 1000));
  backend.memcpy_async(0, a.data(), host.data(), 100, CopyKind::kHostToDevice, nullptr);
  backend.memcpy_async(0, a.data(), host.data(), 200, CopyKind::kHostToDevice, nullptr);
  backend.memcpy_async(0, b.data(), a.data(), 300, CopyKind::kDeviceToDevice, nullptr);
  backend.memcpy_async(0, host.data(), b.data(), 400, CopyKind::kDeviceToHost, nullptr);
  backend.synchronize_stream(0, nullptr);
  EXPECT_EQ(backend.num_copies(), 4);
  EXPECT_EQ(backend.bytes_copied(CopyKind::kHostToDevice), 300u);
  EXPECT_EQ(backend.bytes_copied(CopyKind::kDeviceToDevice), 300u);
  EXPECT_EQ(backend.bytes_copied(CopyKind::kDeviceToHost), 400u);
}

TEST(SimBackendTest, ConcurrentAllocationsCopiesAndEventsAreSafe) {
  SimBackend::Options options = JitterOptions(50us);
  options.devices = 2;
  SimBackend backend(options);
  constexpr int kThreads = 4;
  constexpr int kIterations = 40;
  constexpr size_t kBytes = 4096;
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const int device = t % 2;
      UniqueStream stream(backend, device);
      UniqueEvent event(backend, device);
      UniqueHostBuffer src = Unwrap(UniqueHostBuffer::Allocate(backend, kBytes));
      UniqueHostBuffer dst = Unwrap(UniqueHostBuffer::Allocate(backend, kBytes));
      for (int i = 0; i < kIterations; ++i) {
        const auto seed = static_cast<uint8_t>(t * 50 + i);
        FillPattern(src.data(), kBytes, seed);
        UniqueDeviceBuffer a = Unwrap(UniqueDeviceBuffer::Allocate(backend, device, kBytes));
        UniqueDeviceBuffer b = Unwrap(UniqueDeviceBuffer::Allocate(backend, device, kBytes));
        backend.memcpy_async(device, a.data(), src.data(), kBytes, CopyKind::kHostToDevice,
                             stream.handle());
        backend.memcpy_async(device, b.data(), a.data(), kBytes, CopyKind::kDeviceToDevice,
                             stream.handle());
        backend.memcpy_async(device, dst.data(), b.data(), kBytes, CopyKind::kDeviceToHost,
                             stream.handle());
        event.record(stream.handle());
        event.query();
        event.synchronize();
        if (FirstPatternMismatch(dst.data(), kBytes, seed) != -1) ++mismatches;
        backend.mem_info(device);
        (void)backend.num_copies();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();

  EXPECT_EQ(mismatches.load(), 0);
  constexpr int64_t kAllocations = int64_t{kThreads} * kIterations * 2;
  EXPECT_EQ(backend.num_device_mallocs(), kAllocations);
  EXPECT_EQ(backend.num_device_frees(), kAllocations);
  EXPECT_EQ(backend.bytes_in_use(0), 0u);
  EXPECT_EQ(backend.bytes_in_use(1), 0u);
  EXPECT_EQ(backend.host_bytes_in_use(), 0u);
  EXPECT_EQ(backend.num_copies(), int64_t{kThreads} * kIterations * 3);
  EXPECT_EQ(backend.bytes_copied(CopyKind::kHostToDevice),
            static_cast<size_t>(kThreads) * kIterations * kBytes);
}

TEST(SimBackendTest, DestructorJoinsWorkersAndReleasesEverythingStillOwned) {
  // Leaves streams with queued jittered work, live events and memory to the destructor; under
  // ASan/TSan a missed join, leak or use-after-free fails this test.
  constexpr size_t kBytes = 4096;
  std::vector<uint8_t> host(kBytes, 0x33);
  {
    SimBackend backend(JitterOptions(1ms));
    void* const device = Unwrap(backend.device_malloc(0, kBytes));
    Unwrap(backend.host_malloc(kBytes));
    const StreamRef stream = backend.create_stream(0);
    const EventHandle event = backend.create_event(0);
    for (int i = 0; i < 5; ++i) {
      backend.memcpy_async(0, device, host.data(), kBytes, CopyKind::kHostToDevice, stream.handle);
    }
    backend.record_event(0, event, stream.handle);
    EXPECT_EQ(backend.bytes_in_use(0), kBytes);
  }
  SUCCEED();
}

}  // namespace
}  // namespace spillway::testing
