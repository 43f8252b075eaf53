// The caching allocator over the CUDA backend: what only a real device can show (stream-ordered
// reuse against a stream that is really busy). Skipped, and reported so, without a device.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>

#include "allocator/caching_allocator.h"
#include "tests/allocator/test_util.h"
#ifdef SPILLWAY_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "allocator/cuda_backend.h"
#endif

namespace spillway::testing {
namespace {

#ifdef SPILLWAY_HAVE_CUDA

// A host function enqueued on a stream holds the stream until it returns: a busy stream with no
// kernel to compile.
void CUDART_CB HoldTheStream(void* /*unused*/) {
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
}

class CudaAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA driver or device on this machine";
    allocator_ =
        std::make_unique<CachingAllocator>(std::make_shared<CudaBackend>(), AllocatorConfig{});
  }

  // Allocates `bytes` on the default stream, records a use on `side` while a host function holds
  // `side` busy, and frees it: the block stays pending until `side` is done.
  void* FreeWhileUsedOnABusyStream(size_t bytes, StreamRef side) {
    void* ptr = allocator_->Malloc(bytes, 0, nullptr);
    EXPECT_EQ(cudaLaunchHostFunc(static_cast<cudaStream_t>(side.handle), HoldTheStream, nullptr),
              cudaSuccess);
    allocator_->RecordStream(ptr, side);
    allocator_->Free(ptr);
    return ptr;
  }

  std::unique_ptr<CachingAllocator> allocator_;
};

TEST_F(CudaAllocatorTest, RecordedUseOnABusyStreamHoldsTheBlockBack) {
  Backend& backend = allocator_->backend();
  const StreamRef side = backend.create_stream(0);
  auto* const side_stream = static_cast<cudaStream_t>(side.handle);
  void* x = FreeWhileUsedOnABusyStream(kMiB, side);
  void* y = allocator_->Malloc(kMiB, 0, nullptr);
  EXPECT_NE(y, x) << "reused while the side stream still used it";
  EXPECT_EQ(cudaStreamQuery(side_stream), cudaErrorNotReady) << "the free waited on the host";
  (void)cudaGetLastError();  // "not ready" is an answer, not an error
  backend.synchronize_stream(0, side.handle);
  void* z = allocator_->Malloc(kMiB, 0, nullptr);
  EXPECT_EQ(z, x) << "once the side stream is done, the block is reused";
  allocator_->Free(y);
  allocator_->Free(z);
  backend.destroy_stream(0, side.handle);
}

// Under a watermark (the offload budget) the block a copy still reads is handed to the next
// request at once: the allocating stream waits for the copy, the host does not.
TEST_F(CudaAllocatorTest, UnderAWatermarkTheAllocatingStreamWaitsForTheCopyNotTheHost) {
  Backend& backend = allocator_->backend();
  // 12 MiB requests take a segment of exactly 12 MiB (nothing left over to serve the second one);
  // a second segment would reserve 24 MiB, past the watermark.
  constexpr size_t kBytes = 12 * kMiB;
  allocator_->SetWatermark(0, 16 * kMiB);
  const StreamRef side = backend.create_stream(0);
  auto* const side_stream = static_cast<cudaStream_t>(side.handle);
  void* x = FreeWhileUsedOnABusyStream(kBytes, side);
  void* y = allocator_->Malloc(kBytes, 0, nullptr);
  EXPECT_EQ(y, x) << "a new segment was taken past the watermark";
  EXPECT_EQ(cudaStreamQuery(side_stream), cudaErrorNotReady) << "the host waited";
  EXPECT_EQ(cudaStreamQuery(nullptr), cudaErrorNotReady) << "the default stream did not wait";
  (void)cudaGetLastError();  // "not ready" is an answer, not an error
  EXPECT_EQ(allocator_->FlatStats(0).at("num_sync_all_streams"), 0);
  backend.synchronize_stream(0, side.handle);
  allocator_->Free(y);
  backend.destroy_stream(0, side.handle);
}

#else

TEST(CudaAllocatorTest, RecordedUseOnABusyStreamHoldsTheBlockBack) {
  GTEST_SKIP() << "built without CUDA (SPILLWAY_HAVE_CUDA is not defined)";
}

TEST(CudaAllocatorTest, UnderAWatermarkTheAllocatingStreamWaitsForTheCopyNotTheHost) {
  GTEST_SKIP() << "built without CUDA (SPILLWAY_HAVE_CUDA is not defined)";
}

#endif

}  // namespace
}  // namespace spillway::testing
