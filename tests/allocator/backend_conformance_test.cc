// Conformance of every `Backend` to the contract in allocator/backend.h. The simulated device's
// own promises (asynchrony, capacity, fault injection, thread safety) are in sim_backend_test.cc.
//
// The typed suite runs once per backend ("Sim", "Cuda"); the CUDA instance skips itself when the
// build has no CUDA or the machine has no device, so ctest shows it as skipped, not passed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
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
#include "tests/allocator/test_util.h"
#ifdef SPILLWAY_HAVE_CUDA
#include "allocator/cuda_backend.h"
#endif

namespace spillway::testing {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

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
  // Whether other processes may allocate on the device meanwhile (free memory moves on its own).
  static constexpr bool kSharedDevice = false;
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
  static constexpr bool kSharedDevice = true;
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

  // On a GPU other processes may create or destroy CUDA contexts (hundreds of MiB each) while
  // this runs, e.g. under `ctest -j`: there the allocation is a quarter of what is free, to dwarf
  // them, and at least half of it must show in each direction. The simulated device is exact.
  constexpr bool kShared = TypeParam::kSharedDevice;
  const size_t bytes =
      kShared ? std::max(64 * kMiB, before.free_bytes / 4 / kMiB * kMiB) : 64 * kMiB;
  void* const ptr = Unwrap(backend.device_malloc(0, bytes));
  ASSERT_NE(ptr, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(ptr) % 256, 0u) << "device memory must be 256-aligned";
  const MemInfo during = backend.mem_info(0);
  EXPECT_EQ(during.total_bytes, before.total_bytes);
  const auto drop =
      static_cast<int64_t>(before.free_bytes) - static_cast<int64_t>(during.free_bytes);

  backend.device_free(0, ptr);
  const MemInfo after = backend.mem_info(0);
  const auto rise =
      static_cast<int64_t>(after.free_bytes) - static_cast<int64_t>(during.free_bytes);
  if (kShared) {
    EXPECT_GE(drop, static_cast<int64_t>(bytes / 2)) << "malloc of " << bytes << " bytes";
    EXPECT_GE(rise, static_cast<int64_t>(bytes / 2)) << "free of " << bytes << " bytes";
  } else {
    EXPECT_EQ(drop, static_cast<int64_t>(bytes));
    EXPECT_EQ(rise, static_cast<int64_t>(bytes));
  }
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

}  // namespace
}  // namespace spillway::testing
