// Lasting streams are resolved once per thread (StreamMemo): the hot path makes no backend call
// for them, and the identities it hands out are the backend's own.
#include "allocator/stream_memo.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "allocator/backend_raii.h"
#include "allocator/caching_allocator.h"
#include "allocator/errors.h"
#include "allocator/sim_backend.h"

namespace spillway {
namespace {

// Counts resolve_stream calls: on CUDA each is a device guard and a cudaStreamGetId.
class ResolveCountingBackend : public SimBackend {
 public:
  explicit ResolveCountingBackend(int devices = 1) : SimBackend(Options{.devices = devices}) {}
  StreamRef resolve_stream(int device, StreamHandle stream) override {
    ++resolves;
    return SimBackend::resolve_stream(device, stream);
  }
  std::atomic<int> resolves{0};
};

TEST(StreamMemo, ALastingStreamIsResolvedOncePerThread) {
  ResolveCountingBackend backend(2);
  UniqueStream side(backend, 0);
  StreamMemo memo(backend);
  const StreamRef expected = backend.resolve_stream(0, side.handle());
  const StreamRef default0 = backend.resolve_stream(0, nullptr);
  const StreamRef default1 = backend.resolve_stream(1, nullptr);
  backend.resolves = 0;
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(memo.ResolveLasting(0, side.handle()).id, expected.id);
    EXPECT_EQ(memo.ResolveLasting(0, side.handle()).handle, side.handle());
    EXPECT_EQ(memo.ResolveLasting(0, nullptr).id, default0.id);
    // The same handle on another device is another stream.
    EXPECT_EQ(memo.ResolveLasting(1, nullptr).id, default1.id);
  }
  EXPECT_EQ(backend.resolves, 3) << "one question per stream, then none";

  // Another thread asks for itself: its slots are its own.
  std::thread other([&] {
    for (int i = 0; i < 10; ++i) EXPECT_EQ(memo.ResolveLasting(0, side.handle()).id, expected.id);
  });
  other.join();
  EXPECT_EQ(backend.resolves, 4);
}

// A memo never answers from what a thread remembered for another memo, whatever the backend:
// the same handle (the default stream) of another backend is another stream.
TEST(StreamMemo, MemosDoNotShareWhatTheyRemember) {
  ResolveCountingBackend first;
  ResolveCountingBackend second;
  const auto first_memo = std::make_unique<StreamMemo>(first);
  const auto second_memo = std::make_unique<StreamMemo>(second);
  first_memo->ResolveLasting(0, nullptr);
  EXPECT_EQ(first.resolves, 1);
  EXPECT_EQ(second_memo->ResolveLasting(0, nullptr), second.resolve_stream(0, nullptr));
  EXPECT_EQ(second.resolves, 2) << "the second memo answered from the first one's slot";
  first_memo->ResolveLasting(0, nullptr);
  EXPECT_EQ(first.resolves, 1);
}

// More streams than slots: every answer stays right, and the oldest is asked again.
TEST(StreamMemo, MoreStreamsThanSlotsStillAnswerRight) {
  ResolveCountingBackend backend;
  std::vector<std::unique_ptr<UniqueStream>> streams;
  streams.reserve(6);
  for (int i = 0; i < 6; ++i) streams.push_back(std::make_unique<UniqueStream>(backend, 0));
  StreamMemo memo(backend);
  for (int round = 0; round < 3; ++round) {
    for (const auto& s : streams) EXPECT_EQ(memo.ResolveLasting(0, s->handle()), s->ref());
  }
  EXPECT_GT(backend.resolves, 6) << "six streams cannot all stay in four slots";
}

// A failed resolution is not remembered: asked again, the backend is asked again.
TEST(StreamMemo, AFailureIsNotRemembered) {
  ResolveCountingBackend backend;
  StreamMemo memo(backend);
  int bogus = 0;
  EXPECT_THROW(memo.ResolveLasting(0, &bogus), BackendError);
  EXPECT_THROW(memo.ResolveLasting(0, &bogus), BackendError);
  EXPECT_EQ(backend.resolves, 2);
}

// Through the allocator: its hot path for a lasting stream asks the backend once, and a bad
// device is refused before the backend hears of it.
TEST(StreamMemo, TheAllocatorsLastingStreamsAreResolvedOnce) {
  auto backend = std::make_shared<ResolveCountingBackend>();
  CachingAllocator allocator(backend, AllocatorConfig{});
  UniqueStream side(*backend, 0);
  backend->resolves = 0;
  std::vector<void*> live;
  for (int i = 0; i < 50; ++i) {
    live.push_back(allocator.Malloc(4096, 0, allocator.ResolveLastingStream(0, side.handle())));
    EXPECT_EQ(allocator.Lookup(live.back())->stream, side.ref());
  }
  EXPECT_EQ(backend->resolves, 1);
  EXPECT_THROW(allocator.ResolveLastingStream(3, nullptr), InvalidArgumentError);
  EXPECT_EQ(backend->resolves, 1);
  for (void* p : live) allocator.Free(p);
}

}  // namespace
}  // namespace spillway
