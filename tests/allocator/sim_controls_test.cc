// The simulated device's test controls (sim_backend_controls.cc): fault injection (failed
// allocations, events and copies, and how a failed copy is reported) and held streams.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/backend.h"
#include "allocator/backend_raii.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"
#include "tests/allocator/test_util.h"
#include "tests/poll_until.h"

namespace spillway::testing {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

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
    EXPECT_TRUE(e.earlier_work()) << "an earlier copy's failure must be told apart";
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
  // The copy runs once the host waits for the event: run before the record (the worker's jitter
  // allows it), its failure was reported by the record instead (seen 2026-12-05, 1 run in ~300).
  const auto hold =
      backend_.hold_stream(0, stream_.handle(), SimBackend::HoldRelease::kWhenHostWaits);
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

// An event found complete has reported every failure of the work before it, whenever the look
// falls. query_event once took the stream's error and then, separately, asked whether the event
// was reached: a worker that ran the failing copy and the event's own op between the two made
// the event complete with its copy's failure left unreported, and the allocator that polled it
// freed the block and never looked at the stream again (ci33, 2026-12-07: the observer heard
// nothing for 20 s). Here looks race the worker as the gate opens, with no jitter: a look
// waiting for the stream's lock between the two steps let the worker, which takes the lock back
// at once after each op, run both ops first.
TEST(SimBackendTest, AnEventFoundCompleteHasReportedTheFailureBeforeIt) {
  SimBackend backend;
  UniqueStream stream(backend, 0);
  UniqueDeviceBuffer device = Unwrap(UniqueDeviceBuffer::Allocate(backend, 0, 4096));
  std::vector<char> host(4096);
  UniqueEvent event(backend, 0);
  constexpr int kRounds = 2000;
  int unreported = 0;
  for (int round = 0; round < kRounds; ++round) {
    auto hold = backend.hold_stream(0, stream.handle());
    backend.fail_copy_after(1);
    backend.memcpy_async(0, device.data(), host.data(), host.size(), CopyKind::kHostToDevice,
                         stream.handle());
    event.record(stream.handle());
    std::thread opener([&] { hold->Open(); });
    bool reported = false;
    for (;;) {
      try {
        if (event.query()) break;
      } catch (const BackendError& e) {
        EXPECT_THAT(e.detail(), HasSubstr("injected copy failure"));
        reported = true;
      }
    }
    opener.join();
    if (!reported) {
      ++unreported;
      // Left on the stream: take it, so that the next round starts clean.
      EXPECT_THROW(backend.synchronize_stream(0, stream.handle()), BackendError);
    }
  }
  EXPECT_EQ(unreported, 0) << "of " << kRounds << " events found complete";
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

// A hold released by waits opens when something blocks on the work behind it, and only then:
// kWhenHostWaits for the host's waits, kWhenWaitedFor for another stream's too. What tests
// rely on to learn, without timing, whether a wait they expect was made.
TEST(SimBackendTest, AHoldReleasedByWaitsOpensWhenWaitedFor) {
  SimBackend sim;
  const StreamRef held = sim.create_stream(0);
  const StreamRef waiter = sim.create_stream(0);
  {
    auto hold = sim.hold_stream(0, held.handle, SimBackend::HoldRelease::kWhenHostWaits);
    const EventHandle behind = sim.create_event(0);
    sim.record_event(0, behind, held.handle);
    sim.stream_wait_event(0, waiter.handle, behind);  // a stream's wait: not the host's
    const EventHandle after_wait = sim.create_event(0);
    sim.record_event(0, after_wait, waiter.handle);
    // Another stream waits: this hold stays shut, and so does the waiting stream. (A few of the
    // gate's 1 ms looks first, so that a hold that took the stream's wait for the host's would
    // have opened; under load this may look too early, never wrongly.)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(sim.query_event(0, after_wait));
    EXPECT_FALSE(hold->opened_by_wait());
    sim.synchronize_event(0, behind);  // the host waits: the hold opens
    EXPECT_TRUE(hold->opened_by_wait());
    sim.synchronize_event(0, after_wait);
    sim.destroy_event(0, behind);
    sim.destroy_event(0, after_wait);
  }
  {
    auto hold = sim.hold_stream(0, held.handle, SimBackend::HoldRelease::kWhenWaitedFor);
    const EventHandle behind = sim.create_event(0);
    sim.record_event(0, behind, held.handle);
    sim.stream_wait_event(0, waiter.handle, behind);
    sim.synchronize_stream(0, waiter.handle);  // returns once the wait opened the hold
    EXPECT_TRUE(hold->opened_by_wait());
    sim.destroy_event(0, behind);
  }
  {
    // Nothing waits: it stays shut until its owner opens it.
    auto hold = sim.hold_stream(0, held.handle, SimBackend::HoldRelease::kWhenWaitedFor);
    const EventHandle behind = sim.create_event(0);
    sim.record_event(0, behind, held.handle);
    EXPECT_FALSE(sim.query_event(0, behind));
    EXPECT_FALSE(hold->opened_by_wait());
    hold->Open();
    sim.synchronize_event(0, behind);
    EXPECT_FALSE(hold->opened_by_wait());
    sim.destroy_event(0, behind);
  }
  sim.destroy_stream(0, held.handle);
  sim.destroy_stream(0, waiter.handle);
}

// host_waiters and stream_waiters count the threads blocked on a stream's work, each its own:
// the host's waits, and other streams' waits on one of its events. A thread counts no more once
// its wait is over.
TEST(SimBackendTest, WaitersAreCountedByWhoWaits) {
  SimBackend sim;
  const StreamRef held = sim.create_stream(0);
  const StreamRef waiter = sim.create_stream(0);
  auto hold = sim.hold_stream(0, held.handle);
  const EventHandle behind = sim.create_event(0);
  sim.record_event(0, behind, held.handle);
  sim.stream_wait_event(0, waiter.handle, behind);
  PollUntil([&] { return sim.stream_waiters(0, held.handle) != 0; });
  EXPECT_EQ(sim.stream_waiters(0, held.handle), 1);
  EXPECT_EQ(sim.host_waiters(0, held.handle), 0) << "a stream's wait counted as the host's";
  std::thread host([&] { sim.synchronize_event(0, behind); });
  PollUntil([&] { return sim.host_waiters(0, held.handle) != 0; });
  EXPECT_EQ(sim.host_waiters(0, held.handle), 1);
  EXPECT_EQ(sim.stream_waiters(0, held.handle), 1) << "the host's wait counted as a stream's";
  EXPECT_EQ(sim.host_waiters(0, waiter.handle), 0);
  hold->Open();
  host.join();
  sim.synchronize_stream(0, waiter.handle);
  EXPECT_EQ(sim.host_waiters(0, held.handle), 0);
  EXPECT_EQ(sim.stream_waiters(0, held.handle), 0);
  EXPECT_THROW(sim.host_waiters(1, held.handle), InvalidArgumentError);  // no device 1
  int not_a_stream = 0;
  EXPECT_THROW(sim.stream_waiters(0, &not_a_stream), BackendError);
  sim.destroy_event(0, behind);
  sim.destroy_stream(0, held.handle);
  sim.destroy_stream(0, waiter.handle);
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

}  // namespace
}  // namespace spillway::testing
