// The pinned host memory pool's blocks: caching across steps, best fit, split and coalesce, exact
// sizing, the host limit, backend failures, Trim and bad pointers. Frees that wait on a stream,
// the history and threads: pinned_pool_stream_order_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"
#include "offload/pinned_pool.h"
#include "tests/offload/pinned_pool_test_util.h"

namespace spillway::testing {
namespace {

size_t RoundUp512(size_t bytes) { return (bytes + 511) / 512 * 512; }

::testing::AssertionResult Mentions(const absl::Status& status, const std::string& text) {
  const std::string message(status.message());
  if (message.find(text) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "\"" << message << "\" does not mention \"" << text << "\"";
}

TEST(OffloadPinnedPool, ReusesBufferAcrossSteps) {
  SimBackend backend;
  PinnedPool pool(backend, 0, PinnedPool::Options{});
  const std::vector<size_t> step_sizes = {3 * kMiB, kKiB + 7, 10 * kMiB, 256 * kKiB, 5 * kMiB};
  std::vector<void*> first_step;
  for (int step = 0; step < 50; ++step) {
    std::vector<void*> buffers;
    buffers.reserve(step_sizes.size());
    for (size_t bytes : step_sizes) buffers.push_back(Take(pool, bytes));
    if (step == 0) first_step = buffers;
    EXPECT_EQ(buffers, first_step) << "step " << step << " did not reuse the cached buffers";
    // Alternate the free order so both merge directions are exercised.
    if (step % 2 == 1) std::reverse(buffers.begin(), buffers.end());
    for (void* buffer : buffers) pool.Free(buffer);
    EXPECT_EQ(pool.in_use_bytes(), 0u);
  }
  EXPECT_EQ(pool.num_backend_allocs(), 1);
  EXPECT_EQ(pool.reserved_bytes(), 64 * kMiB);
  EXPECT_EQ(backend.host_bytes_in_use(), 64 * kMiB);
}

TEST(OffloadPinnedPool, BestFitPicksSmallestSufficientFreeBlock) {
  SimBackend backend;
  // grow 0: every chunk is exactly one request, so each free block below is its own chunk.
  PinnedPool pool(backend, 0, Grow(0));
  void* large = Take(pool, 64 * kKiB);
  void* small = Take(pool, 32 * kKiB);
  void* middle = Take(pool, 48 * kKiB);
  pool.Free(small);
  pool.Free(large);
  pool.Free(middle);

  EXPECT_EQ(Take(pool, 40 * kKiB), middle);  // 32 KiB is too small; 48 KiB beats 64 KiB
  EXPECT_EQ(Take(pool, 30 * kKiB), small);
  EXPECT_EQ(Take(pool, 64 * kKiB), large);
  EXPECT_EQ(pool.num_backend_allocs(), 3);
}

TEST(OffloadPinnedPool, SplitsAndCoalescesNeighbours) {
  SimBackend backend;
  PinnedPool pool(backend, 0, Grow(kMiB));
  void* a = Take(pool, 256 * kKiB);
  void* b = Take(pool, 256 * kKiB);
  void* c = Take(pool, 256 * kKiB);
  ASSERT_EQ(b, Offset(a, 256 * kKiB)) << "the chunk was not split front to back";
  ASSERT_EQ(c, Offset(b, 256 * kKiB));
  EXPECT_EQ(pool.buffer_size(a), 256 * kKiB);

  pool.Free(b);
  pool.Free(a);  // merges forward with b
  void* ab = Take(pool, 512 * kKiB);
  EXPECT_EQ(ab, a) << "a and b were not coalesced";
  EXPECT_EQ(pool.buffer_size(ab), 512 * kKiB);

  pool.Free(ab);
  pool.Free(c);  // merges backward with a+b and forward with the chunk's unused tail
  void* whole = Take(pool, kMiB);
  EXPECT_EQ(whole, a) << "the chunk did not coalesce back into one block";
  EXPECT_EQ(pool.num_backend_allocs(), 1);
  pool.Free(whole);
}

// Hands out pinned chunks back to back from one arena, so that consecutive chunks are adjacent
// in memory, as separate cudaHostAlloc calls can be. Everything else is the simulated device.
class AdjacentChunksBackend : public SimBackend {
 public:
  explicit AdjacentChunksBackend(size_t arena_bytes) : arena_(arena_bytes) {}

  absl::StatusOr<void*> host_malloc(size_t bytes) override {
    std::lock_guard lock(mu_);
    if (bytes > arena_.size() - used_) return absl::ResourceExhaustedError("arena exhausted");
    void* chunk = arena_.data() + used_;
    used_ += bytes;
    live_.push_back(chunk);
    return chunk;
  }
  void host_free(void* ptr) override {
    std::lock_guard lock(mu_);
    const auto it = std::find(live_.begin(), live_.end(), ptr);
    if (it == live_.end()) throw BackendError("host_free", "not the start of a live chunk");
    live_.erase(it);
  }
  size_t live_chunks() const {
    std::lock_guard lock(mu_);
    return live_.size();
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::byte> arena_;
  size_t used_ = 0;
  std::vector<void*> live_;
};

TEST(OffloadPinnedPool, NeverCoalescesAcrossAdjacentChunks) {
  AdjacentChunksBackend backend(2 * kMiB);
  PinnedPool pool(backend, 0, Grow(kMiB));
  void* first = Take(pool, kMiB);
  void* second = Take(pool, kMiB);
  ASSERT_EQ(second, Offset(first, kMiB)) << "precondition: the chunks must be adjacent";
  pool.Free(second);
  pool.Free(first);  // its next neighbour in memory is free, but belongs to another chunk
  const absl::StatusOr<void*> spanning = pool.Allocate(2 * kMiB);
  EXPECT_FALSE(spanning.ok()) << "a buffer spans two chunks";
  pool.Trim();
  EXPECT_EQ(pool.reserved_bytes(), 0u);
  EXPECT_EQ(backend.live_chunks(), 0u) << "each chunk must go back to the backend whole";
}

TEST(OffloadPinnedPool, NoPowerOfTwoRounding) {
  SimBackend backend;
  PinnedPool pool(backend, 0, Grow(0));
  void* p = Take(pool, 65 * kMiB + 1);
  EXPECT_LT(pool.reserved_bytes(), 66 * kMiB);
  EXPECT_EQ(pool.reserved_bytes(), 65 * kMiB + 512);
  EXPECT_EQ(pool.buffer_size(p), 65 * kMiB + 512);
  EXPECT_EQ(backend.host_bytes_in_use(), 65 * kMiB + 512);
  pool.Free(p);
}

TEST(OffloadPinnedPool, SplitsOnlyRemaindersOfAtLeastOneSixtyFourth) {
  SimBackend backend;
  PinnedPool pool(backend, 0, Grow(kMiB));
  // Remainder 8 KiB < (1 MiB - 8 KiB) / 64 = 15.9 KiB: kept with the buffer.
  void* unsplit = Take(pool, kMiB - 8 * kKiB);
  EXPECT_EQ(pool.buffer_size(unsplit), kMiB);
  pool.Free(unsplit);
  // Remainder 16 KiB >= (1 MiB - 16 KiB) / 64 = 15.75 KiB: split off and usable.
  void* split = Take(pool, kMiB - 16 * kKiB);
  EXPECT_EQ(pool.buffer_size(split), kMiB - 16 * kKiB);
  EXPECT_EQ(Take(pool, 16 * kKiB), Offset(split, kMiB - 16 * kKiB));
  EXPECT_EQ(pool.num_backend_allocs(), 1);

  // Small buffers: any 512-byte remainder is split off.
  PinnedPool small_pool(backend, 0, Grow(4 * kKiB));
  void* small = Take(small_pool, 3 * kKiB + 1);
  EXPECT_EQ(small_pool.buffer_size(small), 3 * kKiB + 512);
  EXPECT_EQ(Take(small_pool, 512), Offset(small, 3 * kKiB + 512));
  EXPECT_EQ(small_pool.num_backend_allocs(), 1);
}

TEST(OffloadPinnedPool, WasteIsBoundedByOneSixtyFourth) {
  SimBackend backend;
  PinnedPool pool(backend, 0, Grow(8 * kMiB));
  std::mt19937_64 rng(7);
  std::vector<std::pair<void*, size_t>> live;
  for (int i = 0; i < 2000; ++i) {
    if (live.size() < 24 && rng() % 3 != 0) {
      const size_t bytes = 1 + rng() % (2 * kMiB);
      void* p = Take(pool, bytes);
      ASSERT_NE(p, nullptr);
      const size_t rounded = RoundUp512(bytes);
      const size_t size = pool.buffer_size(p);
      EXPECT_GE(size, rounded);
      EXPECT_LT(size - rounded, std::max<size_t>(512, rounded / 64)) << "request " << bytes;
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % PinnedPool::kGranule, 0u);
      live.emplace_back(p, bytes);
    } else if (!live.empty()) {
      const size_t victim = rng() % live.size();
      pool.Free(live[victim].first);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(victim));
    }
  }
  for (const auto& [p, bytes] : live) pool.Free(p);
  EXPECT_EQ(pool.in_use_bytes(), 0u);
}

TEST(OffloadPinnedPool, HostLimitGivesResourceExhausted) {
  SimBackend backend;
  PinnedPool pool(backend, 0, Grow(64 * kMiB, 4 * kMiB));
  void* a = Take(pool, kMiB);
  EXPECT_EQ(pool.reserved_bytes(), kMiB) << "a 64 MiB chunk breaks the limit: expected exact size";
  void* b = Take(pool, 3 * kMiB);
  EXPECT_EQ(pool.reserved_bytes(), 4 * kMiB);

  const absl::StatusOr<void*> over = pool.Allocate(kKiB);
  ASSERT_TRUE(absl::IsResourceExhausted(over.status())) << over.status();
  EXPECT_TRUE(Mentions(over.status(), "1024 bytes"));
  EXPECT_TRUE(Mentions(over.status(), "4.00 MiB of pinned memory reserved"));
  EXPECT_TRUE(Mentions(over.status(), "limit is 4.00 MiB"));
  EXPECT_TRUE(absl::IsResourceExhausted(pool.Allocate(5 * kMiB).status()));
  EXPECT_EQ(pool.num_backend_allocs(), 2);

  // a's wholly free chunk is returned, but that is not room enough for 1.5 MiB next to b.
  pool.Free(a);
  EXPECT_TRUE(absl::IsResourceExhausted(pool.Allocate(3 * kMiB / 2).status()));
  EXPECT_EQ(pool.reserved_bytes(), 3 * kMiB);
  EXPECT_EQ(backend.host_bytes_in_use(), 3 * kMiB);
  // b's chunk is too small for 3.5 MiB; returning it makes room under the limit.
  pool.Free(b);
  void* c = Take(pool, 7 * kMiB / 2);
  EXPECT_EQ(pool.reserved_bytes(), 7 * kMiB / 2);
  EXPECT_EQ(backend.host_bytes_in_use(), 7 * kMiB / 2);
  EXPECT_EQ(pool.num_backend_allocs(), 3);
  EXPECT_EQ(pool.peak_reserved_bytes(), 4 * kMiB);
  pool.Free(c);
}

// The limit can change while buffers are out: lowered, the wholly free chunks go back at once and
// the pool grows again only once enough came back; lifted, it grows freely again.
TEST(OffloadPinnedPool, AHostLimitSetLaterTakesEffect) {
  SimBackend backend;
  PinnedPool pool(backend, 0, Grow(kMiB));
  void* a = Take(pool, 2 * kMiB);
  void* b = Take(pool, 2 * kMiB);
  ASSERT_EQ(pool.reserved_bytes(), 4 * kMiB);
  pool.Free(a);
  pool.SetLimit(2 * kMiB);
  EXPECT_EQ(pool.reserved_bytes(), 2 * kMiB) << "a's free chunk was kept over the new limit";
  EXPECT_EQ(backend.host_bytes_in_use(), 2 * kMiB);
  const absl::StatusOr<void*> over = pool.Allocate(kKiB);
  ASSERT_TRUE(absl::IsResourceExhausted(over.status())) << over.status();
  EXPECT_TRUE(Mentions(over.status(), "limit is 2.00 MiB"));
  pool.Free(b);
  void* c = Take(pool, 2 * kMiB);  // b's chunk serves again
  EXPECT_TRUE(absl::IsResourceExhausted(pool.Allocate(kMiB).status()));
  pool.SetLimit(0);
  void* d = Take(pool, 8 * kMiB);
  EXPECT_EQ(pool.reserved_bytes(), 10 * kMiB);
  pool.Free(c);
  pool.Free(d);
}

TEST(OffloadPinnedPool, BackendFailureGivesUnavailableAndPoolKeepsWorking) {
  SimBackend backend;
  PinnedPool pool(backend, 0, Grow(kMiB));
  backend.fail_host_malloc(2);  // the 1 MiB chunk and the exact-size retry
  const absl::StatusOr<void*> failed = pool.Allocate(4 * kKiB);
  ASSERT_TRUE(absl::IsUnavailable(failed.status())) << failed.status();
  EXPECT_TRUE(Mentions(failed.status(), "injected failure"));
  EXPECT_EQ(pool.reserved_bytes(), 0u);
  EXPECT_EQ(pool.num_backend_allocs(), 0);

  void* p = Take(pool, 4 * kKiB);
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(pool.reserved_bytes(), kMiB);
  EXPECT_EQ(pool.in_use_bytes(), 4 * kKiB);
  pool.Free(p);
}

TEST(OffloadPinnedPool, FallsBackToExactSizeWhenLargeChunkFails) {
  SimBackend backend;
  PinnedPool pool(backend, 0, Grow(kMiB));
  backend.fail_host_malloc(1);
  void* p = Take(pool, 4 * kKiB);
  EXPECT_EQ(pool.reserved_bytes(), 4 * kKiB);
  EXPECT_EQ(pool.num_backend_allocs(), 1);
  pool.Free(p);
}

TEST(OffloadPinnedPool, ReturnsFreeChunksWhenBackendIsShort) {
  SimBackend::Options options;
  options.host_capacity_bytes = 3 * kMiB;
  SimBackend backend(options);
  PinnedPool pool(backend, 0, Grow(0));
  void* a = Take(pool, 2 * kMiB);
  pool.Free(a);
  // The cached 2 MiB chunk is too small and leaves no room for 2.5 MiB: it must go back.
  void* b = Take(pool, 5 * kMiB / 2);
  EXPECT_EQ(pool.reserved_bytes(), 5 * kMiB / 2);
  EXPECT_EQ(pool.num_backend_allocs(), 2);

  const absl::StatusOr<void*> failed = pool.Allocate(kMiB);
  ASSERT_TRUE(absl::IsUnavailable(failed.status())) << failed.status();
  EXPECT_TRUE(Mentions(failed.status(), "out of pinned memory"));
  pool.Free(b);
}

TEST(OffloadPinnedPool, TrimReturnsWholeFreeChunks) {
  SimBackend backend;
  PinnedPool pool(backend, 0, Grow(kMiB));
  void* a = Take(pool, kMiB);        // chunk 1, whole
  void* b = Take(pool, 512 * kKiB);  // chunk 2, split
  void* c = Take(pool, 2 * kMiB);    // chunk 3, whole
  EXPECT_EQ(pool.reserved_bytes(), 4 * kMiB);
  pool.Free(a);
  pool.Free(c);
  pool.Trim();
  EXPECT_EQ(pool.reserved_bytes(), kMiB) << "chunk 2 holds a live buffer and must stay";
  EXPECT_EQ(backend.host_bytes_in_use(), kMiB);
  EXPECT_EQ(pool.buffer_size(b), 512 * kKiB);

  pool.Free(b);
  pool.Trim();
  EXPECT_EQ(pool.reserved_bytes(), 0u);
  EXPECT_EQ(backend.host_bytes_in_use(), 0u);
  EXPECT_EQ(pool.peak_reserved_bytes(), 4 * kMiB);
}

TEST(OffloadPinnedPool, FreeingUnknownPointerThrows) {
  SimBackend backend;
  PinnedPool pool(backend, 0, Grow(kMiB));
  int local = 0;
  EXPECT_THROW(pool.Free(&local), InvalidArgumentError);
  void* p = Take(pool, 4 * kKiB);
  EXPECT_THROW(pool.Free(Offset(p, 512)), InvalidArgumentError);
  pool.Free(p);
  try {
    pool.Free(p);
    ADD_FAILURE() << "a double free was accepted";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("already freed"), std::string::npos) << e.what();
  }
  EXPECT_THROW(pool.buffer_size(p), InvalidArgumentError);
  EXPECT_THROW((void)pool.Allocate(0), InvalidArgumentError);
  EXPECT_THROW((void)pool.Allocate(PinnedPool::kMaxBytes + 1), InvalidArgumentError);
  EXPECT_EQ(Take(pool, 4 * kKiB), p) << "the pool was damaged by the rejected calls";
  EXPECT_EQ(pool.in_use_bytes(), 4 * kKiB);
}

}  // namespace
}  // namespace spillway::testing
