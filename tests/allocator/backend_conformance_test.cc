// Conformance of every `Backend` to the contract in allocator/backend.h, plus the simulated
// device's own promises (asynchrony, capacity, fault injection, thread safety).
//
// The typed suite runs once per backend ("Sim", "Cuda"); the CUDA instance skips itself when the
// build has no CUDA or the machine has no device, so ctest shows it as skipped, not passed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/backend.h"
#include "allocator/backend_raii.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"
#ifdef SPILLWAY_HAVE_CUDA
#include "allocator/cuda_backend.h"
#include "tests/sanitizers.h"
#endif

// Reading memory that a worker may be writing is the point of the stale-data test, and exactly what
// ThreadSanitizer rightly reports; that one test skips itself under TSan.

namespace spillway {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

constexpr size_t kMiB = size_t{1} << 20;

// Fails the current test (gtest reports the exception) instead of returning an unusable value.
template <typename T>
T Unwrap(absl::StatusOr<T> result) {
  if (!result.ok()) throw std::runtime_error("unexpected status: " + result.status().ToString());
  return std::move(*result);
}

uint8_t PatternByte(size_t i, uint8_t seed) { return static_cast<uint8_t>(i * 31 + seed); }

void FillPattern(void* data, size_t bytes, uint8_t seed) {
  auto* p = static_cast<uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) p[i] = PatternByte(i, seed);
}

// Index of the first byte that differs from the pattern, or -1.
int64_t FirstPatternMismatch(const void* data, size_t bytes, uint8_t seed) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    if (p[i] != PatternByte(i, seed)) return static_cast<int64_t>(i);
  }
  return -1;
}

bool AllBytesEqual(const void* data, size_t bytes, uint8_t value) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    if (p[i] != value) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Typed conformance suite.

struct SimTraits {
  static std::string SkipReason() { return ""; }
  static std::unique_ptr<Backend> Make() {
    SimBackend::Options options;
    options.devices = 2;
    options.capacity_bytes = 256 * kMiB;
    // Jitter makes the simulator's asynchrony visible to every conformance case.
    options.max_jitter = 300us;
    options.seed = 7;
    return std::make_unique<SimBackend>(options);
  }
  // Busy work: enough ops that a freshly enqueued tail is still pending when the host looks.
  static constexpr size_t kBusyBytes = 4 * kMiB;
  static constexpr int kBusyCopies = 32;
};

struct CudaTraits {
  static std::string SkipReason() {
#ifdef SPILLWAY_HAVE_CUDA
    return CudaDeviceAvailable() ? "" : "no CUDA driver or device on this machine";
#else
    return "built without CUDA (SPILLWAY_HAVE_CUDA is not defined)";
#endif
  }
  static std::unique_ptr<Backend> Make() {
#ifdef SPILLWAY_HAVE_CUDA
    return std::make_unique<CudaBackend>();
#else
    return nullptr;
#endif
  }
  static constexpr size_t kBusyBytes = 256 * kMiB;
  static constexpr int kBusyCopies = 32;
};

template <typename Traits>
class BackendConformanceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string reason = Traits::SkipReason(); !reason.empty()) {
      GTEST_SKIP() << reason;
    }
    backend_ = Traits::Make();
    ASSERT_NE(backend_, nullptr);
    ASSERT_GT(backend_->device_count(), 0);
  }

  Backend& backend() { return *backend_; }

  UniqueDeviceBuffer DeviceBuffer(size_t bytes, int device = 0) {
    return Unwrap(UniqueDeviceBuffer::Allocate(*backend_, device, bytes));
  }
  UniqueHostBuffer HostBuffer(size_t bytes) {
    return Unwrap(UniqueHostBuffer::Allocate(*backend_, bytes));
  }

  // Keeps `stream` busy for a while (many large device-to-device copies), so that work enqueued
  // right after is observably pending.
  void EnqueueBusyWork(StreamHandle stream) {
    if (!busy_a_.has_value()) {
      busy_a_.emplace(DeviceBuffer(Traits::kBusyBytes));
      busy_b_.emplace(DeviceBuffer(Traits::kBusyBytes));
    }
    for (int i = 0; i < Traits::kBusyCopies; ++i) {
      const bool forward = i % 2 == 0;
      void* const dst = forward ? busy_b_->data() : busy_a_->data();
      const void* const src = forward ? busy_a_->data() : busy_b_->data();
      backend_->memcpy_async(0, dst, src, Traits::kBusyBytes, CopyKind::kDeviceToDevice, stream);
    }
  }

  // Declared first so that it outlives the buffers below.
  std::unique_ptr<Backend> backend_;
  std::optional<UniqueDeviceBuffer> busy_a_;
  std::optional<UniqueDeviceBuffer> busy_b_;
};

class BackendNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    if constexpr (std::is_same_v<T, SimTraits>) return "Sim";
    if constexpr (std::is_same_v<T, CudaTraits>) return "Cuda";
    return "Unknown";
  }
};

using BackendTypes = ::testing::Types<SimTraits, CudaTraits>;
TYPED_TEST_SUITE(BackendConformanceTest, BackendTypes, BackendNames);

TYPED_TEST(BackendConformanceTest, MallocAndFreeAreReflectedInMemInfo) {
  Backend& backend = this->backend();
  const MemInfo before = backend.mem_info(0);
  ASSERT_GT(before.total_bytes, 0u);
  ASSERT_LE(before.free_bytes, before.total_bytes);

  constexpr size_t kBytes = 64 * kMiB;
  void* const ptr = Unwrap(backend.device_malloc(0, kBytes));
  ASSERT_NE(ptr, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(ptr) % 256, 0u) << "device memory must be 256-aligned";
  const MemInfo during = backend.mem_info(0);
  EXPECT_EQ(during.total_bytes, before.total_bytes);
  EXPECT_LE(during.free_bytes + kBytes, before.free_bytes);

  backend.device_free(0, ptr);
  const MemInfo after = backend.mem_info(0);
  EXPECT_GE(after.free_bytes, during.free_bytes + kBytes);
}

TYPED_TEST(BackendConformanceTest, ZeroByteMallocReturnsNullAndFreeOfNullIsNoOp) {
  EXPECT_EQ(Unwrap(this->backend().device_malloc(0, 0)), nullptr);
  EXPECT_NO_THROW(this->backend().device_free(0, nullptr));
}

TYPED_TEST(BackendConformanceTest, AbsurdDeviceMallocIsResourceExhaustedAndRecoverable) {
  Backend& backend = this->backend();
  constexpr size_t kAbsurd = size_t{1} << 50;  // 1 PiB.
  const absl::StatusOr<void*> result = backend.device_malloc(0, kAbsurd);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("1125899906842624"));
  EXPECT_THAT(result.status().message(), HasSubstr("device 0"));
  // The failure must leave no error behind: ordinary work still succeeds.
  UniqueDeviceBuffer buffer = this->DeviceBuffer(kMiB);
  EXPECT_NO_THROW(backend.synchronize_stream(0, nullptr));
}

TYPED_TEST(BackendConformanceTest, BadDeviceIndexIsInvalidArgument) {
  Backend& backend = this->backend();
  const int count = backend.device_count();
  for (const int device : {-1, count}) {
    SCOPED_TRACE(device);
    EXPECT_EQ(backend.device_malloc(device, kMiB).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_THROW(backend.mem_info(device), InvalidArgumentError);
    EXPECT_THROW(backend.create_stream(device), InvalidArgumentError);
    EXPECT_THROW(backend.default_stream(device), InvalidArgumentError);
    EXPECT_THROW(backend.create_event(device), InvalidArgumentError);
    EXPECT_THROW(backend.synchronize_stream(device, nullptr), InvalidArgumentError);
  }
}

TYPED_TEST(BackendConformanceTest, HostToDeviceToDeviceToHostRoundTripPreservesBytes) {
  Backend& backend = this->backend();
  constexpr size_t kBytes = kMiB + 123;  // Deliberately not a multiple of anything.
  UniqueHostBuffer src = this->HostBuffer(kBytes);
  UniqueHostBuffer dst = this->HostBuffer(kBytes);
  UniqueDeviceBuffer d1 = this->DeviceBuffer(kBytes);
  UniqueDeviceBuffer d2 = this->DeviceBuffer(kBytes);
  FillPattern(src.data(), kBytes, 11);
  std::memset(dst.data(), 0, kBytes);
  UniqueStream stream(backend, 0);

  backend.memcpy_async(0, d1.data(), src.data(), kBytes, CopyKind::kHostToDevice, stream.handle());
  backend.memcpy_async(0, d2.data(), d1.data(), kBytes, CopyKind::kDeviceToDevice, stream.handle());
  backend.memcpy_async(0, dst.data(), d2.data(), kBytes, CopyKind::kDeviceToHost, stream.handle());
  backend.synchronize_stream(0, stream.handle());

  EXPECT_EQ(FirstPatternMismatch(dst.data(), kBytes, 11), -1);
}

TYPED_TEST(BackendConformanceTest, StreamRunsOpsInFifoOrder) {
  Backend& backend = this->backend();
  UniqueStream stream(backend, 0);
  constexpr size_t kBytes = size_t{256} * 1024;

  // A chain where each copy reads what the previous one wrote: any reordering reads garbage.
  constexpr int kLinks = 8;
  UniqueHostBuffer src = this->HostBuffer(kBytes);
  UniqueHostBuffer out = this->HostBuffer(kBytes);
  FillPattern(src.data(), kBytes, 42);
  std::memset(out.data(), 0, kBytes);
  std::vector<UniqueDeviceBuffer> chain;
  chain.reserve(kLinks);
  for (int i = 0; i < kLinks; ++i) chain.push_back(this->DeviceBuffer(kBytes));
  backend.memcpy_async(0, chain[0].data(), src.data(), kBytes, CopyKind::kHostToDevice,
                       stream.handle());
  for (int i = 1; i < kLinks; ++i) {
    backend.memcpy_async(0, chain[i].data(), chain[i - 1].data(), kBytes, CopyKind::kDeviceToDevice,
                         stream.handle());
  }
  backend.memcpy_async(0, out.data(), chain.back().data(), kBytes, CopyKind::kDeviceToHost,
                       stream.handle());

  // Successive overwrites of one buffer: the last one enqueued must win.
  constexpr int kWrites = 16;
  std::vector<UniqueHostBuffer> sources;
  UniqueDeviceBuffer target = this->DeviceBuffer(kBytes);
  UniqueHostBuffer last = this->HostBuffer(kBytes);
  for (int i = 0; i < kWrites; ++i) {
    sources.push_back(this->HostBuffer(kBytes));
    std::memset(sources.back().data(), i + 1, kBytes);
    backend.memcpy_async(0, target.data(), sources.back().data(), kBytes, CopyKind::kHostToDevice,
                         stream.handle());
  }
  backend.memcpy_async(0, last.data(), target.data(), kBytes, CopyKind::kDeviceToHost,
                       stream.handle());
  backend.synchronize_stream(0, stream.handle());

  EXPECT_EQ(FirstPatternMismatch(out.data(), kBytes, 42), -1);
  EXPECT_TRUE(AllBytesEqual(last.data(), kBytes, kWrites));
}

TYPED_TEST(BackendConformanceTest, NeverRecordedEventIsComplete) {
  UniqueEvent event(this->backend(), 0);
  EXPECT_TRUE(event.query());
  EXPECT_NO_THROW(event.synchronize());
}

TYPED_TEST(BackendConformanceTest, QueryDoesNotBlockAndSynchronizeWaitsForCapturedWork) {
  Backend& backend = this->backend();
  UniqueStream stream(backend, 0);
  UniqueEvent event(backend, 0);
  constexpr size_t kBytes = size_t{64} * 1024;
  UniqueHostBuffer src = this->HostBuffer(kBytes);
  UniqueHostBuffer dst = this->HostBuffer(kBytes);
  UniqueDeviceBuffer device = this->DeviceBuffer(kBytes);
  FillPattern(src.data(), kBytes, 3);
  std::memset(dst.data(), 0, kBytes);

  this->EnqueueBusyWork(stream.handle());
  backend.memcpy_async(0, device.data(), src.data(), kBytes, CopyKind::kHostToDevice,
                       stream.handle());
  backend.memcpy_async(0, dst.data(), device.data(), kBytes, CopyKind::kDeviceToHost,
                       stream.handle());
  event.record(stream.handle());

  // A blocking query would only return once the work is done, i.e. true.
  EXPECT_FALSE(event.query()) << "query returned true while the stream was still busy";
  event.synchronize();
  EXPECT_TRUE(event.query());
  EXPECT_EQ(FirstPatternMismatch(dst.data(), kBytes, 3), -1);
}

TYPED_TEST(BackendConformanceTest, RerecordingAnEventReplacesWhatItCaptures) {
  Backend& backend = this->backend();
  UniqueStream stream(backend, 0);
  UniqueEvent event(backend, 0);
  event.record(stream.handle());
  event.synchronize();
  ASSERT_TRUE(event.query());

  this->EnqueueBusyWork(stream.handle());
  event.record(stream.handle());
  EXPECT_FALSE(event.query()) << "the second record must capture the busy work";
  event.synchronize();
  EXPECT_TRUE(event.query());
}

TYPED_TEST(BackendConformanceTest, StreamWaitEventOrdersConsumerAfterSlowProducer) {
  Backend& backend = this->backend();
  UniqueStream producer(backend, 0);
  UniqueStream consumer(backend, 0);
  UniqueEvent produced(backend, 0);
  constexpr size_t kBytes = size_t{512} * 1024;
  UniqueHostBuffer src = this->HostBuffer(kBytes);
  UniqueHostBuffer out = this->HostBuffer(kBytes);
  UniqueDeviceBuffer a = this->DeviceBuffer(kBytes);
  UniqueDeviceBuffer b = this->DeviceBuffer(kBytes);

  // Start from zeros everywhere, so a consumer that runs early copies zeros.
  std::memset(src.data(), 0, kBytes);
  std::memset(out.data(), 0xEE, kBytes);
  backend.memcpy_async(0, a.data(), src.data(), kBytes, CopyKind::kHostToDevice, nullptr);
  backend.memcpy_async(0, b.data(), src.data(), kBytes, CopyKind::kHostToDevice, nullptr);
  backend.synchronize_stream(0, nullptr);
  FillPattern(src.data(), kBytes, 99);

  this->EnqueueBusyWork(producer.handle());
  backend.memcpy_async(0, a.data(), src.data(), kBytes, CopyKind::kHostToDevice, producer.handle());
  produced.record(producer.handle());

  backend.stream_wait_event(0, consumer.handle(), produced.handle());
  // The host returned from the wait while the producer is still busy: it did not block.
  EXPECT_FALSE(produced.query());
  backend.memcpy_async(0, b.data(), a.data(), kBytes, CopyKind::kDeviceToDevice, consumer.handle());
  backend.memcpy_async(0, out.data(), b.data(), kBytes, CopyKind::kDeviceToHost, consumer.handle());

  // Only the consumer is synchronized: ordering must come from the wait alone.
  backend.synchronize_stream(0, consumer.handle());
  EXPECT_EQ(FirstPatternMismatch(out.data(), kBytes, 99), -1);
  EXPECT_TRUE(produced.query());
}

TYPED_TEST(BackendConformanceTest, StreamIdsAreUniqueAndNeverReused) {
  Backend& backend = this->backend();
  std::set<uint64_t> ids;
  ids.insert(backend.default_stream(0).id);
  for (int i = 0; i < 32; ++i) {
    // Each stream is destroyed before the next is created, so handles get recycled; ids must not.
    UniqueStream stream(backend, 0);
    EXPECT_TRUE(ids.insert(stream.ref().id).second) << "id " << stream.ref().id << " reused";
    EXPECT_EQ(backend.resolve_stream(0, stream.handle()).id, stream.ref().id);
  }
  // Two live streams at once are distinct too.
  UniqueStream first(backend, 0);
  UniqueStream second(backend, 0);
  EXPECT_NE(first.ref().id, second.ref().id);
  EXPECT_FALSE(first.ref() == second.ref());
}

TYPED_TEST(BackendConformanceTest, NullHandleResolvesToDefaultStream) {
  Backend& backend = this->backend();
  for (int device = 0; device < backend.device_count(); ++device) {
    SCOPED_TRACE(device);
    const StreamRef by_default = backend.default_stream(device);
    const StreamRef resolved = backend.resolve_stream(device, nullptr);
    EXPECT_EQ(resolved.handle, nullptr);
    EXPECT_EQ(resolved.id, by_default.id);
    EXPECT_TRUE(resolved == by_default);
    // Stable across calls.
    EXPECT_EQ(backend.default_stream(device).id, by_default.id);
  }
  UniqueStream other(backend, 0);
  EXPECT_NE(other.ref().id, backend.default_stream(0).id);

  // Work enqueued with a null handle runs on, and is synchronized by, the default stream.
  constexpr size_t kBytes = 4096;
  UniqueHostBuffer src = this->HostBuffer(kBytes);
  UniqueHostBuffer dst = this->HostBuffer(kBytes);
  UniqueDeviceBuffer device = this->DeviceBuffer(kBytes);
  FillPattern(src.data(), kBytes, 5);
  std::memset(dst.data(), 0, kBytes);
  backend.memcpy_async(0, device.data(), src.data(), kBytes, CopyKind::kHostToDevice, nullptr);
  backend.memcpy_async(0, dst.data(), device.data(), kBytes, CopyKind::kDeviceToHost, nullptr);
  backend.synchronize_stream(0, nullptr);
  EXPECT_EQ(FirstPatternMismatch(dst.data(), kBytes, 5), -1);
}

TYPED_TEST(BackendConformanceTest, EventOutlivesTheStreamItWasRecordedOn) {
  Backend& backend = this->backend();
  constexpr size_t kBytes = size_t{64} * 1024;
  UniqueHostBuffer src = this->HostBuffer(kBytes);
  UniqueHostBuffer dst = this->HostBuffer(kBytes);
  UniqueDeviceBuffer device = this->DeviceBuffer(kBytes);
  FillPattern(src.data(), kBytes, 8);
  std::memset(dst.data(), 0, kBytes);
  UniqueEvent done(backend, 0);
  {
    UniqueStream stream(backend, 0);
    backend.memcpy_async(0, device.data(), src.data(), kBytes, CopyKind::kHostToDevice,
                         stream.handle());
    backend.memcpy_async(0, dst.data(), device.data(), kBytes, CopyKind::kDeviceToHost,
                         stream.handle());
    done.record(stream.handle());
  }
  done.synchronize();
  EXPECT_TRUE(done.query());
  EXPECT_EQ(FirstPatternMismatch(dst.data(), kBytes, 8), -1);
}

// ---------------------------------------------------------------------------------------------
// Simulated device only.

SimBackend::Options JitterOptions(std::chrono::microseconds jitter) {
  SimBackend::Options options;
  options.capacity_bytes = 64 * kMiB;
  options.max_jitter = jitter;
  options.seed = 1234;
  return options;
}

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

TEST(SimBackendTest, FailDeviceMallocAfterFailsExactlyTheNthCall) {
  SimBackend backend;
  backend.fail_device_malloc_after(3);
  void* const first = Unwrap(backend.device_malloc(0, 4096));
  void* const second = Unwrap(backend.device_malloc(0, 4096));
  const absl::StatusOr<void*> third = backend.device_malloc(0, 4096);
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("injected"));
  EXPECT_THAT(third.status().message(), HasSubstr("requested 4096 bytes on device 0"));
  void* const fourth = Unwrap(backend.device_malloc(0, 4096));  // One-shot.
  EXPECT_EQ(backend.num_failed_device_mallocs(), 1);
  EXPECT_EQ(backend.bytes_in_use(0), 3 * 4096u);

  backend.fail_device_malloc_after(1);
  backend.fail_device_malloc_after(-1);  // Disarms.
  void* const fifth = Unwrap(backend.device_malloc(0, 4096));

  // Calls with a bad device index do not count.
  backend.fail_device_malloc_after(1);
  EXPECT_EQ(backend.device_malloc(5, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend.device_malloc(0, 1).status().code(), absl::StatusCode::kResourceExhausted);

  EXPECT_THROW(backend.fail_device_malloc_after(0), InvalidArgumentError);
  for (void* ptr : {first, second, fourth, fifth}) backend.device_free(0, ptr);
}

TEST(SimBackendTest, FailHostMallocFailsTheNextNCalls) {
  SimBackend backend;
  backend.fail_host_malloc(2);
  EXPECT_EQ(backend.host_malloc(64).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(backend.host_malloc(64).status().code(), absl::StatusCode::kResourceExhausted);
  UniqueHostBuffer ok = Unwrap(UniqueHostBuffer::Allocate(backend, 64));
  EXPECT_EQ(backend.host_bytes_in_use(), 64u);
  backend.fail_host_malloc(5);
  backend.fail_host_malloc(0);  // Disarms.
  UniqueHostBuffer also_ok = Unwrap(UniqueHostBuffer::Allocate(backend, 64));
  EXPECT_THROW(backend.fail_host_malloc(-1), InvalidArgumentError);
}

// Fixture for the sticky copy-failure rule: a source, a destination holding zeros, and a stream.
class SimCopyFailureTest : public ::testing::Test {
 protected:
  static constexpr size_t kBytes = 4096;

  void SetUp() override {
    std::memset(src_.data(), 0x11, kBytes);
    std::memset(zeros_.data(), 0, kBytes);
    backend_.memcpy_async(0, device_.data(), zeros_.data(), kBytes, CopyKind::kHostToDevice,
                          stream_.handle());
    backend_.synchronize_stream(0, stream_.handle());
  }

  void CopyIn() {
    backend_.memcpy_async(0, device_.data(), src_.data(), kBytes, CopyKind::kHostToDevice,
                          stream_.handle());
  }

  // Reads the device buffer back; true when it still holds zeros.
  bool DeviceStillZero() {
    UniqueHostBuffer out = Unwrap(UniqueHostBuffer::Allocate(backend_, kBytes));
    backend_.memcpy_async(0, out.data(), device_.data(), kBytes, CopyKind::kDeviceToHost,
                          stream_.handle());
    backend_.synchronize_stream(0, stream_.handle());
    return AllBytesEqual(out.data(), kBytes, 0);
  }

  // Waits until the stream has run everything, without consuming its sticky error: device_free
  // drains like cudaFree and is not one of the calls that report it.
  void DrainWithoutReporting() { backend_.device_free(0, Unwrap(backend_.device_malloc(0, 512))); }

  SimBackend backend_{JitterOptions(500us)};
  UniqueHostBuffer src_ = Unwrap(UniqueHostBuffer::Allocate(backend_, kBytes));
  UniqueHostBuffer zeros_ = Unwrap(UniqueHostBuffer::Allocate(backend_, kBytes));
  UniqueDeviceBuffer device_ = Unwrap(UniqueDeviceBuffer::Allocate(backend_, 0, kBytes));
  UniqueStream stream_{backend_, 0};
};

void ExpectInjectedCopyFailure(const std::function<void()>& call) {
  try {
    call();
    ADD_FAILURE() << "expected the injected copy failure to be reported";
  } catch (const BackendError& e) {
    EXPECT_EQ(e.operation(), "memcpy_async");
    EXPECT_THAT(e.detail(), HasSubstr("injected copy failure"));
  }
}

TEST_F(SimCopyFailureTest, NthCopyFailsAndSynchronizeStreamReportsItOnce) {
  backend_.fail_copy_after(2);
  UniqueHostBuffer other = Unwrap(UniqueHostBuffer::Allocate(backend_, kBytes));
  backend_.memcpy_async(0, other.data(), device_.data(), kBytes, CopyKind::kDeviceToHost,
                        stream_.handle());  // 1st: succeeds.
  CopyIn();                                 // 2nd: fails on the worker.
  ExpectInjectedCopyFailure([&] { backend_.synchronize_stream(0, stream_.handle()); });
  EXPECT_NO_THROW(backend_.synchronize_stream(0, stream_.handle())) << "reported twice";
  EXPECT_TRUE(DeviceStillZero()) << "a failed copy must not write its destination";
  EXPECT_EQ(backend_.num_copies(), 3);  // Setup copy, 1st copy, read-back; not the failed one.
}

TEST_F(SimCopyFailureTest, SynchronizeEventReportsIt) {
  backend_.fail_copy_after(1);
  CopyIn();
  UniqueEvent event(backend_, 0);
  event.record(stream_.handle());
  ExpectInjectedCopyFailure([&] { event.synchronize(); });
  EXPECT_TRUE(event.query());
  EXPECT_NO_THROW(backend_.synchronize_stream(0, stream_.handle()));
}

TEST_F(SimCopyFailureTest, NonBlockingCallsReportItOnceTheCopyHasRun) {
  UniqueEvent event(backend_, 0);
  backend_.fail_copy_after(1);
  CopyIn();
  DrainWithoutReporting();
  ExpectInjectedCopyFailure([&] { CopyIn(); });
  CopyIn();  // Cleared: this one succeeds.
  EXPECT_NO_THROW(backend_.synchronize_stream(0, stream_.handle()));
  EXPECT_FALSE(DeviceStillZero());

  backend_.fail_copy_after(1);
  CopyIn();
  DrainWithoutReporting();
  ExpectInjectedCopyFailure([&] { event.record(stream_.handle()); });
  EXPECT_TRUE(event.query()) << "a record that threw must not have recorded";

  event.record(stream_.handle());  // Before the failing copy: a later record could report it.
  backend_.fail_copy_after(1);
  CopyIn();
  DrainWithoutReporting();
  ExpectInjectedCopyFailure([&] { event.query(); });
  EXPECT_TRUE(event.query());
}

TEST_F(SimCopyFailureTest, OtherStreamsAreUnaffectedAndMinusOneDisarms) {
  UniqueStream other(backend_, 0);
  backend_.fail_copy_after(1);
  CopyIn();
  DrainWithoutReporting();
  EXPECT_NO_THROW(backend_.synchronize_stream(0, other.handle()));
  EXPECT_NO_THROW(backend_.synchronize_stream(0, nullptr));
  ExpectInjectedCopyFailure([&] { backend_.synchronize_stream(0, stream_.handle()); });

  backend_.fail_copy_after(1);
  backend_.fail_copy_after(-1);
  CopyIn();
  EXPECT_NO_THROW(backend_.synchronize_stream(0, stream_.handle()));
  EXPECT_FALSE(DeviceStillZero());
  EXPECT_THROW(backend_.fail_copy_after(0), InvalidArgumentError);
}

TEST(SimBackendTest, FailEventAfterFailsTheNthCreateOrRecord) {
  SimBackend backend;
  backend.fail_event_after(2);
  const EventHandle event = backend.create_event(0);  // 1st.
  try {
    backend.record_event(0, event, nullptr);  // 2nd.
    ADD_FAILURE() << "record_event should have failed";
  } catch (const BackendError& e) {
    EXPECT_EQ(e.operation(), "record_event");
  }
  EXPECT_TRUE(backend.query_event(0, event)) << "the failed record must have no effect";
  backend.record_event(0, event, nullptr);  // One-shot.
  backend.synchronize_event(0, event);

  backend.fail_event_after(1);
  try {
    backend.create_event(0);
    ADD_FAILURE() << "create_event should have failed";
  } catch (const BackendError& e) {
    EXPECT_EQ(e.operation(), "create_event");
  }
  backend.fail_event_after(1);
  backend.fail_event_after(-1);
  backend.destroy_event(0, backend.create_event(0));
  backend.destroy_event(0, event);
  EXPECT_THROW(backend.fail_event_after(0), InvalidArgumentError);
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
}  // namespace spillway
