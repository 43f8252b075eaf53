// The simulated device's link (allocator/sim_link.h): the schedule it books, read off fixed clock
// values, and, through the simulated device, that a copy is not done, nor its bytes landed, before
// they could have crossed (a lower bound only: a loaded machine makes copies later, never earlier).
#include "allocator/sim_link.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "allocator/backend.h"
#include "allocator/backend_factory.h"
#include "allocator/backend_raii.h"
#include "allocator/config.h"
#include "allocator/sim_backend.h"
#include "tests/allocator/test_util.h"
#include "tests/sanitizers.h"

namespace spillway::testing {
namespace {

using namespace std::chrono_literals;
using Lane = SimLink::Lane;
using Clock = SimLink::Clock;

constexpr uint64_t kGBps = 1'000'000'000;  // 1 byte a nanosecond.

TEST(SimLinkTest, ACopyOnAnIdleLaneTakesItsBytesOverTheBandwidth) {
  SimLink link(1, kGBps);
  const Clock::time_point t0 = Clock::now();
  EXPECT_EQ(link.Reserve(0, Lane::kDeviceToHost, 4096, t0), t0 + 4096ns);
  // Rounded up: a copy never takes less than its bytes need.
  SimLink slow(1, 3);
  EXPECT_EQ(slow.Reserve(0, Lane::kDeviceToHost, 1, t0), t0 + 333'333'334ns);
}

TEST(SimLinkTest, CopiesInOneDirectionQueueBehindEachOther) {
  SimLink link(1, kGBps);
  const Clock::time_point t0 = Clock::now();
  EXPECT_EQ(link.Reserve(0, Lane::kDeviceToHost, 1000, t0), t0 + 1000ns);
  // Ready before the first is done: it waits for the lane, then takes its own time.
  EXPECT_EQ(link.Reserve(0, Lane::kDeviceToHost, 500, t0 + 10ns), t0 + 1500ns);
  // Ready after the lane went idle: it starts when ready; the idle time is no credit.
  EXPECT_EQ(link.Reserve(0, Lane::kDeviceToHost, 100, t0 + 5000ns), t0 + 5100ns);
}

TEST(SimLinkTest, TheTwoDirectionsAndTheDevicesHaveLanesOfTheirOwn) {
  SimLink link(2, kGBps);
  const Clock::time_point t0 = Clock::now();
  EXPECT_EQ(link.Reserve(0, Lane::kDeviceToHost, 1000, t0), t0 + 1000ns);
  EXPECT_EQ(link.Reserve(0, Lane::kHostToDevice, 1000, t0), t0 + 1000ns);
  EXPECT_EQ(link.Reserve(1, Lane::kDeviceToHost, 1000, t0), t0 + 1000ns);
  EXPECT_EQ(link.Reserve(0, Lane::kDeviceToHost, 1000, t0), t0 + 2000ns);
}

TEST(SimLinkTest, BandwidthZeroIsUnlimited) {
  SimLink link(1, 0);
  const Clock::time_point t0 = Clock::now();
  EXPECT_EQ(link.Reserve(0, Lane::kDeviceToHost, size_t{1} << 40, t0), t0);
  EXPECT_EQ(link.Reserve(0, Lane::kDeviceToHost, size_t{1} << 40, t0), t0);
}

TEST(SimLinkTest, ALargeCopyDoesNotOverflow) {
  // 1 TiB at 1 GB/s: about 1100 s (bytes * 1e9 would wrap 64 bits).
  SimLink link(1, kGBps);
  const Clock::time_point t0 = Clock::now();
  EXPECT_EQ(link.Reserve(0, Lane::kHostToDevice, size_t{1} << 40, t0) - t0,
            std::chrono::nanoseconds(int64_t{1} << 40));
}

// Through the simulated device, configured as a user would: two 2 MiB copies to the host at
// 100 MiB/s, on two streams, share the device-to-host lane, so both are done no sooner than 40 ms
// after they start, however the workers are scheduled (without the link: well under 1 ms).
TEST(SimLinkTest, TheSimulatedDevicesCopiesTakeAtLeastTheLinksTime) {
  constexpr size_t kBytes = 2 << 20;
  const std::shared_ptr<Backend> backend =
      MakeBackend(Unwrap(ParseConfig("device:sim,capacity_mb:64,sim_link_mb_per_s:100")));
  const auto* sim = dynamic_cast<const SimBackend*>(backend.get());
  ASSERT_NE(sim, nullptr);
  EXPECT_EQ(sim->options().link_bytes_per_second, 100u << 20);
  UniqueHostBuffer host = Unwrap(UniqueHostBuffer::Allocate(*backend, 2 * kBytes));
  UniqueDeviceBuffer device = Unwrap(UniqueDeviceBuffer::Allocate(*backend, 0, 2 * kBytes));
  UniqueStream side(*backend, 0);
  auto* h = static_cast<std::byte*>(host.data());
  auto* d = static_cast<std::byte*>(device.data());

  const Clock::time_point start = Clock::now();
  backend->memcpy_async(0, h, d, kBytes, CopyKind::kDeviceToHost, nullptr);
  backend->memcpy_async(0, h + kBytes, d + kBytes, kBytes, CopyKind::kDeviceToHost, side.handle());
  backend->synchronize_stream(0, nullptr);
  backend->synchronize_stream(0, side.handle());
  EXPECT_GE(Clock::now() - start, 40ms);
}

// The bytes land when they have crossed, not when the copy starts: a host reader that does not
// wait for the copy sees the old bytes (the test that a consumer's missing wait is caught), one
// that waits sees the new. 2 MiB at 8 MiB/s: 250 ms in which the destination must not change (read
// 50 ms in; under TSan only the copy's event is asked then).
TEST(SimLinkTest, ACopysBytesLandWhenTheyHaveCrossed) {
  constexpr size_t kBytes = 2 << 20;
  const std::shared_ptr<Backend> backend =
      MakeBackend(Unwrap(ParseConfig("device:sim,capacity_mb:64,sim_link_mb_per_s:8")));
  UniqueHostBuffer host = Unwrap(UniqueHostBuffer::Allocate(*backend, kBytes));
  UniqueDeviceBuffer device = Unwrap(UniqueDeviceBuffer::Allocate(*backend, 0, kBytes));
  auto* h = static_cast<std::byte*>(host.data());
  auto* d = static_cast<std::byte*>(device.data());
  std::memset(h, 0x11, kBytes);
  std::memset(d, 0x22, kBytes);

  backend->memcpy_async(0, h, d, kBytes, CopyKind::kDeviceToHost, nullptr);
  UniqueEvent copied(*backend, 0);
  copied.record(nullptr);
  // Long enough for a worker to have started the copy and a memcpy to have finished it.
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(copied.query());  // race-free, so valid under TSan too: the copy is not done
  if (!kThreadSanitizer) {
    // Reads what the worker writes later, unordered with it on purpose: TSan rightly reports it.
    EXPECT_EQ(h[0], std::byte{0x11});
    EXPECT_EQ(h[kBytes - 1], std::byte{0x11});
  }
  backend->synchronize_stream(0, nullptr);
  EXPECT_EQ(h[0], std::byte{0x22});
  EXPECT_EQ(h[kBytes - 1], std::byte{0x22});
}

}  // namespace
}  // namespace spillway::testing
