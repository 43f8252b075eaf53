// Bad input gets a clear error and changes nothing.
#include <string>

#include "tests/allocator/sim_fixture.h"

namespace spillway::testing {
namespace {

using BadInputTest = SimAllocatorTest;

std::string MessageOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  return "<no InvalidArgumentError>";
}

TEST_F(BadInputTest, ForeignPointerIsRejected) {
  int local = 0;
  const std::string what = MessageOf([&] { allocator_->Free(&local); });
  EXPECT_NE(what.find("not allocated by Spillway"), std::string::npos) << what;
}

TEST_F(BadInputTest, DoubleFreeIsRejectedAndHarmless) {
  void* p = Alloc(4096);
  void* keep = Alloc(4096);
  allocator_->Free(p);
  const std::string what = MessageOf([&] { allocator_->Free(p); });
  EXPECT_NE(what.find("double free"), std::string::npos) << what;
  EXPECT_EQ(Stat("allocation.all.current"), 1);
  void* q = Alloc(4096);
  EXPECT_NE(q, keep);  // the live block was not handed out twice
  allocator_->Free(q);
  allocator_->Free(keep);
}

TEST_F(BadInputTest, InteriorPointerIsRejected) {
  char* p = static_cast<char*>(Alloc(4096));
  const std::string what = MessageOf([&] { allocator_->Free(p + 16); });
  EXPECT_NE(what.find("points 16 bytes into the allocated block"), std::string::npos) << what;
  allocator_->Free(p);
}

// A block freed while another stream still uses it is neither allocated nor free: a second free,
// or a pointer into it, says which (it read "a free block awaiting stream events block", and
// "free" for an interior pointer).
TEST_F(BadInputTest, PointersIntoABlockAwaitingItsStreamUsesNameItsState) {
  const StreamRef side = backend_->create_stream(0);
  auto hold = backend_->hold_stream(0, side.handle);
  char* p = static_cast<char*>(Alloc(4096));
  allocator_->RecordStream(p, side);
  allocator_->Free(p);
  std::string what = MessageOf([&] { allocator_->Free(p); });
  EXPECT_NE(what.find("is a freed (awaiting stream uses) block on device 0 (double free"),
            std::string::npos)
      << what;
  what = MessageOf([&] { allocator_->Free(p + 16); });
  EXPECT_NE(what.find("points 16 bytes into the freed (awaiting stream uses) block"),
            std::string::npos)
      << what;
  hold->Open();
}

TEST_F(BadInputTest, WrongDeviceIndexIsRejected) {
  for (int device : {-1, 1, 1000}) {
    const std::string what = MessageOf([&] { allocator_->Malloc(64, device, stream_); });
    EXPECT_NE(what.find("device index " + std::to_string(device) + " is out of range"),
              std::string::npos)
        << what;
  }
  EXPECT_THROW(allocator_->stats(7), InvalidArgumentError);
  EXPECT_THROW(allocator_->SetMemoryFraction(0.5, -3), InvalidArgumentError);
}

// With no device at all (no GPU visible) the message says so, not "valid indices are 0..-1".
TEST(BadInputNoDevice, AnyIndexIsRejectedNamingTheMissingDevice) {
  CachingAllocator allocator(std::make_shared<SimBackend>(SimBackend::Options{.devices = 0}),
                             AllocatorConfig{});
  const std::string what = MessageOf([&] { allocator.stats(0); });
  EXPECT_NE(what.find("device index 0 is out of range: the sim backend has no device"),
            std::string::npos)
      << what;
}

TEST_F(BadInputTest, AbsurdSizesAreRejected) {
  for (size_t size : {kMaxRequest + 1, static_cast<size_t>(-1), static_cast<size_t>(-512)}) {
    const std::string what = MessageOf([&] { Alloc(size); });
    EXPECT_NE(what.find("larger than any device"), std::string::npos) << what;
  }
  EXPECT_EQ(Stat("num_ooms"), 0);
  EXPECT_EQ(backend_->num_device_mallocs(), 0);
}

TEST_F(BadInputTest, MemoryFractionOutOfRangeIsRejected) {
  for (double f : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    const std::string what = MessageOf([&] { allocator_->SetMemoryFraction(f, 0); });
    EXPECT_NE(what.find("out of range"), std::string::npos) << what;
  }
  EXPECT_EQ(allocator_->memory_limit(0), 0u);
}

TEST(BadInputConfig, AnAllocatorRefusesAConfigurationOutOfRange) {
  AllocatorConfig config;
  config.max_split_size = size_t{1} << 20;  // a small segment could never be reused
  const std::string what =
      MessageOf([&] { CachingAllocator allocator(std::make_shared<SimBackend>(), config); });
  EXPECT_NE(what.find("AllocatorConfig.max_split_size"), std::string::npos) << what;
}

TEST_F(BadInputTest, RecordStreamOnUnknownPointerIsRejected) {
  int local = 0;
  EXPECT_THROW(allocator_->RecordStream(&local, stream_), InvalidArgumentError);
}

}  // namespace
}  // namespace spillway::testing
