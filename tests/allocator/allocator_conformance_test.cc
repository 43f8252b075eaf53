// Conformance of every allocator of the project to what a stream-ordered caching allocator must
// do, whatever memory it serves: the device caching allocator (CachingAllocator over its
// DeviceAllocator cores) and the pinned host pool of the offload engine (offload/pinned_pool.h).
// Each one's own promises (the out-of-memory ladder, PyTorch's rounding, the pool's waste bound)
// are in its own test files.
//
// The suite is typed: each allocator comes as a Subject, an adapter to the few operations the
// properties need. A freed allocation's last use is "work on a stream": the device allocator hears
// of it through record_stream, the pool through Free's `last_use`. Streams are held busy with the
// simulated device's gates, so that "the work is not over yet" is a fact, not a timing guess.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"
#include "offload/pinned_pool.h"
#include "tests/allocator/test_util.h"

namespace spillway::testing {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<SimBackend> MakeBackend() {
  SimBackend::Options options;
  options.capacity_bytes = 256 * kMiB;
  return std::make_shared<SimBackend>(options);
}

// The device caching allocator of device 0, allocating for the device's default stream.
class DeviceCachingSubject {
 public:
  static constexpr size_t kAlignment = 512;
  static constexpr size_t kMaxBytes = kMaxRequest;
  // PyTorch's contract: a zero-byte allocation is nullptr, and allocates nothing.
  static constexpr bool kZeroBytesIsNull = true;
  // Blocks belong to the stream they were allocated for (the pool has no allocation stream).
  static constexpr bool kHasAllocationStreams = true;

  explicit DeviceCachingSubject(const std::shared_ptr<SimBackend>& backend)
      : allocator_(backend, AllocatorConfig{}), stream_(backend->default_stream(0)) {}

  void* Allocate(size_t bytes) { return allocator_.Malloc(bytes, 0, stream_); }
  void* AllocateOn(size_t bytes, StreamRef stream) { return allocator_.Malloc(bytes, 0, stream); }
  void Free(void* ptr) { allocator_.Free(ptr); }
  void FreeAfterUseOn(void* ptr, StreamRef use) {
    allocator_.RecordStream(ptr, use);
    allocator_.Free(ptr);
  }
  size_t UsableSize(const void* ptr) const { return allocator_.Lookup(ptr).value().size; }
  // Bytes handed out and not yet reusable (freed blocks whose stream uses are not over count).
  size_t InUseBytes() const { return Stat("active_bytes.all.current"); }
  size_t ReservedBytes() const { return Stat("reserved_bytes.all.current"); }
  size_t BackendAllocs() const { return Stat("num_device_alloc"); }
  void ReleaseCached() { allocator_.EmptyCache(); }

 private:
  size_t Stat(const std::string& name) const {
    return static_cast<size_t>(allocator_.FlatStats(0).at(name));
  }

  CachingAllocator allocator_;
  const StreamRef stream_;
};

// The pinned host pool, its events on device 0.
class PinnedPoolSubject {
 public:
  static constexpr size_t kAlignment = PinnedPool::kGranule;
  static constexpr size_t kMaxBytes = PinnedPool::kMaxBytes;
  static constexpr bool kZeroBytesIsNull = false;  // a caller's mistake: refused
  static constexpr bool kHasAllocationStreams = false;

  explicit PinnedPoolSubject(const std::shared_ptr<SimBackend>& backend)
      : backend_(backend), pool_(*backend, 0, PinnedPool::Options{.grow_bytes = 16 * kMiB}) {}

  void* Allocate(size_t bytes) { return Unwrap(pool_.Allocate(bytes)); }
  void* AllocateOn(size_t bytes, StreamRef /*stream*/) { return Allocate(bytes); }
  void Free(void* ptr) { pool_.Free(ptr); }
  void FreeAfterUseOn(void* ptr, StreamRef use) { pool_.Free(ptr, use); }
  size_t UsableSize(const void* ptr) const { return pool_.buffer_size(ptr); }
  size_t InUseBytes() const { return pool_.in_use_bytes(); }
  size_t ReservedBytes() const { return pool_.reserved_bytes(); }
  size_t BackendAllocs() const { return static_cast<size_t>(pool_.num_backend_allocs()); }
  void ReleaseCached() { pool_.Trim(); }

 private:
  std::shared_ptr<SimBackend> backend_;  // outlives the pool
  PinnedPool pool_;
};

template <typename Subject>
class AllocatorConformanceTest : public ::testing::Test {
 protected:
  std::shared_ptr<SimBackend> backend_ = MakeBackend();
  Subject subject_{backend_};
};

using Subjects = ::testing::Types<DeviceCachingSubject, PinnedPoolSubject>;

class SubjectNames {
 public:
  template <typename T>
  static std::string GetName(int /*index*/) {
    return std::is_same_v<T, DeviceCachingSubject> ? "DeviceCaching" : "PinnedPool";
  }
};

TYPED_TEST_SUITE(AllocatorConformanceTest, Subjects, SubjectNames);

bool Overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto a0 = reinterpret_cast<uintptr_t>(a);
  const auto b0 = reinterpret_cast<uintptr_t>(b);
  return a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

TYPED_TEST(AllocatorConformanceTest, AllocationsAreAlignedAndAtLeastTheRequestedSize) {
  std::vector<void*> live;
  for (const size_t bytes : {size_t{1}, size_t{7}, size_t{511}, size_t{512}, size_t{513},
                             size_t{4097}, kMiB + 3, 3 * kMiB, 21 * kMiB + 1}) {
    void* const ptr = this->subject_.Allocate(bytes);
    ASSERT_NE(ptr, nullptr) << bytes;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(ptr) % TypeParam::kAlignment, 0u)
        << bytes << " bytes at " << ptr;
    EXPECT_GE(this->subject_.UsableSize(ptr), bytes);
    EXPECT_EQ(this->subject_.UsableSize(ptr) % TypeParam::kAlignment, 0u) << bytes;
    live.push_back(ptr);
  }
  for (void* ptr : live) this->subject_.Free(ptr);
}

// Random sizes, allocated and freed in random order: no live allocation ever shares a byte with
// another (each spans its whole usable size).
TYPED_TEST(AllocatorConformanceTest, LiveAllocationsNeverOverlap) {
  std::mt19937_64 rng(38);
  std::uniform_int_distribution<size_t> small(1, 64 * kKiB);
  std::uniform_int_distribution<size_t> large(kMiB, 6 * kMiB);
  std::map<uintptr_t, size_t> live;  // address -> usable size
  const auto check_and_insert = [&](void* ptr) {
    const size_t usable = this->subject_.UsableSize(ptr);
    const auto address = reinterpret_cast<uintptr_t>(ptr);
    const auto next = live.lower_bound(address);
    if (next != live.end()) {
      EXPECT_FALSE(Overlap(ptr, usable, reinterpret_cast<void*>(next->first), next->second))
          << ptr << " overlaps the live allocation at " << reinterpret_cast<void*>(next->first);
    }
    if (next != live.begin()) {
      const auto prev = std::prev(next);
      EXPECT_FALSE(Overlap(ptr, usable, reinterpret_cast<void*>(prev->first), prev->second))
          << ptr << " overlaps the live allocation at " << reinterpret_cast<void*>(prev->first);
    }
    live.emplace(address, usable);
  };
  for (int step = 0; step < 600; ++step) {
    if (!live.empty() && rng() % 2 == 0) {
      auto victim = live.begin();
      std::advance(victim, static_cast<std::ptrdiff_t>(rng() % live.size()));
      this->subject_.Free(reinterpret_cast<void*>(victim->first));
      live.erase(victim);
      continue;
    }
    const size_t bytes = rng() % 8 == 0 ? large(rng) : small(rng);
    check_and_insert(this->subject_.Allocate(bytes));
  }
  for (const auto& [address, usable] : live) this->subject_.Free(reinterpret_cast<void*>(address));
}

// Memory freed with no work pending on it is reused by the next request it serves, without
// asking the backend for more.
TYPED_TEST(AllocatorConformanceTest, FreedMemoryIsReusedWithoutNewBackendMemory) {
  void* const first = this->subject_.Allocate(256 * kKiB);
  const size_t allocs = this->subject_.BackendAllocs();
  const size_t reserved = this->subject_.ReservedBytes();
  this->subject_.Free(first);
  void* const again = this->subject_.Allocate(256 * kKiB);
  EXPECT_EQ(again, first);
  EXPECT_EQ(this->subject_.BackendAllocs(), allocs);
  EXPECT_EQ(this->subject_.ReservedBytes(), reserved);
  this->subject_.Free(again);
}

// Memory whose last use is work on another stream is not handed out again while that work is
// not over (the stream is held), and is once it is.
TYPED_TEST(AllocatorConformanceTest, FreedMemoryWaitsForItsLastUseOnAnotherStream) {
  const StreamRef side = this->backend_->create_stream(0);
  void* const used = this->subject_.Allocate(256 * kKiB);
  const size_t usable = this->subject_.UsableSize(used);
  {
    // Work enqueued on `side` from now on (the event the free records there) waits for the gate.
    const auto hold = this->backend_->hold_stream(0, side.handle);
    this->subject_.FreeAfterUseOn(used, side);
    EXPECT_GE(this->subject_.InUseBytes(), usable) << "freed memory still read counts as in use";
    void* const other = this->subject_.Allocate(256 * kKiB);
    EXPECT_FALSE(Overlap(other, this->subject_.UsableSize(other), used, usable))
        << "memory still read by a held stream was handed out again";
    this->subject_.Free(other);
  }
  this->backend_->synchronize_stream(0, side.handle);
  void* const reused = this->subject_.Allocate(256 * kKiB);
  EXPECT_EQ(reused, used) << "memory whose last use is over was not reused";
  this->subject_.Free(reused);
  this->backend_->destroy_stream(0, side.handle);
}

// A block belongs to the stream it was allocated for: freed, it is not handed to a request for
// another stream, whose work is not ordered after the block's last use.
TYPED_TEST(AllocatorConformanceTest, FreedMemoryIsNotHandedToAnotherAllocationStream) {
  if constexpr (!TypeParam::kHasAllocationStreams) {
    GTEST_SKIP() << "no allocation streams: reuse follows the last use alone (see above)";
  } else {
    const StreamRef own = this->backend_->default_stream(0);
    const StreamRef other = this->backend_->create_stream(0);
    void* const first = this->subject_.AllocateOn(4096, own);
    this->subject_.Free(first);
    void* const elsewhere = this->subject_.AllocateOn(4096, other);
    EXPECT_NE(elsewhere, first);
    void* const back = this->subject_.AllocateOn(4096, own);
    EXPECT_EQ(back, first);
    this->subject_.Free(elsewhere);
    this->subject_.Free(back);
    this->subject_.ReleaseCached();
    this->backend_->destroy_stream(0, other.handle);
  }
}

TYPED_TEST(AllocatorConformanceTest, StatsAddUpAndComeBackAfterFree) {
  EXPECT_EQ(this->subject_.InUseBytes(), 0u);
  std::vector<void*> live;
  size_t usable_total = 0;
  for (const size_t bytes : {size_t{100}, 4 * kKiB, 300 * kKiB, 2 * kMiB + 5}) {
    live.push_back(this->subject_.Allocate(bytes));
    usable_total += this->subject_.UsableSize(live.back());
    EXPECT_EQ(this->subject_.InUseBytes(), usable_total);
    EXPECT_GE(this->subject_.ReservedBytes(), this->subject_.InUseBytes());
  }
  const size_t reserved = this->subject_.ReservedBytes();
  for (void* ptr : live) {
    const size_t usable = this->subject_.UsableSize(ptr);
    this->subject_.Free(ptr);
    usable_total -= usable;
    EXPECT_EQ(this->subject_.InUseBytes(), usable_total);
  }
  EXPECT_EQ(this->subject_.ReservedBytes(), reserved) << "a free keeps its memory cached";
  this->subject_.ReleaseCached();
  EXPECT_EQ(this->subject_.ReservedBytes(), 0u) << "wholly free memory goes back on release";
  EXPECT_EQ(this->subject_.InUseBytes(), 0u);
}

TYPED_TEST(AllocatorConformanceTest, BadSizesAreRefusedWithTheSizeNamed) {
  for (const size_t bytes : {TypeParam::kMaxBytes + 1, std::numeric_limits<size_t>::max()}) {
    try {
      this->subject_.Allocate(bytes);
      ADD_FAILURE() << "an allocation of " << bytes << " bytes was made";
    } catch (const InvalidArgumentError& e) {
      EXPECT_THAT(e.what(), HasSubstr(std::to_string(bytes) + " bytes"));
    }
  }
  if constexpr (TypeParam::kZeroBytesIsNull) {
    EXPECT_EQ(this->subject_.Allocate(0), nullptr);
  } else {
    try {
      this->subject_.Allocate(0);
      ADD_FAILURE() << "an allocation of 0 bytes was made";
    } catch (const InvalidArgumentError& e) {
      EXPECT_THAT(e.what(), HasSubstr("0 bytes"));
    }
  }
  EXPECT_EQ(this->subject_.InUseBytes(), 0u);
  EXPECT_EQ(this->subject_.ReservedBytes(), 0u) << "a refused request took memory";
}

// A pointer that is no live allocation (foreign, interior, freed already) is refused, and the
// allocator is as before: the live allocation next to it stays live.
TYPED_TEST(AllocatorConformanceTest, FreeingWhatIsNoLiveAllocationIsRefused) {
  void* const live = this->subject_.Allocate(8 * kKiB);
  void* const freed = this->subject_.Allocate(8 * kKiB);
  this->subject_.Free(freed);
  const size_t in_use = this->subject_.InUseBytes();
  int on_the_stack = 0;
  for (void* const bad :
       {static_cast<void*>(&on_the_stack),
        static_cast<void*>(static_cast<char*>(live) + TypeParam::kAlignment), freed}) {
    EXPECT_THROW(this->subject_.Free(bad), InvalidArgumentError) << bad;
  }
  EXPECT_EQ(this->subject_.InUseBytes(), in_use);
  EXPECT_EQ(this->subject_.UsableSize(live), 8 * kKiB);
  this->subject_.Free(live);
  EXPECT_THROW(this->subject_.Free(live), InvalidArgumentError) << "a double free was accepted";
}

}  // namespace
}  // namespace spillway::testing
