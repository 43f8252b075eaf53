// Stream-ordered reuse: blocks are reused only on their allocation stream, and a block used on
// other streams (record_stream) is reused only after those streams' work up to the free is done.
#include <atomic>
#include <future>
#include <mutex>
#include <new>
#include <thread>

#include "tests/allocator/sim_fixture.h"
#include "tests/poll_until.h"

namespace spillway::testing {
namespace {

class StreamReuseTest : public SimAllocatorTest {
 protected:
  void SetUp() override {
    SimAllocatorTest::SetUp();
    other_ = backend_->create_stream(0);
  }

  // Frees a block whose use on other_ is a copy that fails: the failure waits, unheard, for the
  // first look at the block's pending free after this returns. (Held until then: run before the
  // free, the copy's failure was found by the free itself, on this thread.)
  void FreeAfterAFailingCopyOnOther() {
    void* p = Alloc(4096, stream_);
    auto hold = backend_->hold_stream(0, other_.handle);
    backend_->fail_copy_after(1);
    backend_->memcpy_async(0, copy_target_.data(), p, 4096, CopyKind::kDeviceToHost, other_.handle);
    allocator_->RecordStream(p, other_);
    allocator_->Free(p);
  }

  StreamRef other_;
  std::vector<char> copy_target_ = std::vector<char>(4096);  // outlives the copy
};

TEST_F(StreamReuseTest, FreedBlockIsNotHandedToAnotherStream) {
  void* p = Alloc(4096, stream_);
  allocator_->Free(p);
  void* q = Alloc(4096, other_);
  EXPECT_NE(q, p);
  void* r = Alloc(4096, stream_);
  EXPECT_EQ(r, p);
  allocator_->Free(q);
  allocator_->Free(r);
}

// Blocks name their stream by a small slot that is reused once the stream's last segment is
// gone: a slot passed on to another stream must never lead its new owner to the old stream's
// free blocks, or the old stream to the new one's.
TEST_F(StreamReuseTest, AStreamSlotPassedOnKeepsBlocksOnTheirOwnStream) {
  allocator_->Free(Alloc(4096, stream_));
  allocator_->EmptyCache();  // stream_'s only segment goes: its slot is free
  EXPECT_EQ(Stat("segment.all.current"), 0);
  void* on_other = Alloc(4096, other_);  // other_ takes the slot
  allocator_->Free(on_other);
  void* back = Alloc(4096, stream_);
  EXPECT_NE(back, on_other) << "stream_ was handed other_'s free block";
  EXPECT_EQ(allocator_->Lookup(back)->stream.id, stream_.id);
  EXPECT_EQ(Stat("segment.all.current"), 2);
  void* again = Alloc(4096, other_);
  EXPECT_EQ(again, on_other);  // other_ still finds its own block
  EXPECT_EQ(allocator_->Lookup(again)->stream.id, other_.id);
  allocator_->Free(back);
  allocator_->Free(again);
}

TEST_F(StreamReuseTest, RecordStreamDefersReuseUntilThatStreamCatchesUp) {
  auto gate = backend_->hold_stream(0, other_.handle);  // work on `other_` waits for the gate
  void* p = Alloc(4096, stream_);
  allocator_->RecordStream(p, other_);
  allocator_->Free(p);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("active.all.current"), 1);  // pending free is still active
  const Snapshot pending = allocator_->TakeSnapshot();
  EXPECT_EQ(pending.segments.at(0).blocks.at(0).state, BlockState::kActivePendingFree);

  void* q = Alloc(4096, stream_);
  EXPECT_NE(q, p) << "block reused while another stream may still be using it";

  gate->Open();
  backend_->synchronize_stream(0, other_.handle);
  allocator_->Free(q);
  void* r = Alloc(4096, stream_);  // malloc polls the event; now p is free again
  EXPECT_TRUE(r == p || r == q);
  EXPECT_EQ(Stat("active.all.current"), 1);
  allocator_->Free(r);
}

TEST_F(StreamReuseTest, RecordStreamOnAllocationStreamIsIgnored) {
  void* p = Alloc(4096, stream_);
  allocator_->RecordStream(p, stream_);
  allocator_->Free(p);
  EXPECT_EQ(Stat("active.all.current"), 0);  // freed at once, no event needed
}

TEST_F(StreamReuseTest, PendingBlocksDoNotMergeUntilEventsComplete) {
  auto gate = backend_->hold_stream(0, other_.handle);
  void* a = Alloc(kMiB / 2, stream_);
  void* b = Alloc(kMiB / 2, stream_);
  allocator_->RecordStream(a, other_);
  allocator_->Free(a);
  allocator_->Free(b);
  Snapshot snap = allocator_->TakeSnapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  EXPECT_EQ(snap.segments[0].blocks.size(), 2u);  // a pending, b merged with the tail
  gate->Open();
  backend_->synchronize_stream(0, other_.handle);
  allocator_->ProcessEvents(0);
  snap = allocator_->TakeSnapshot();
  EXPECT_EQ(snap.segments[0].blocks.size(), 1u);
}

TEST_F(StreamReuseTest, EmptyCacheKeepsSegmentsWithPendingEvents) {
  auto gate = backend_->hold_stream(0, other_.handle);
  void* p = Alloc(12 * kMiB, stream_);
  allocator_->RecordStream(p, other_);
  allocator_->Free(p);
  allocator_->EmptyCache();
  EXPECT_EQ(Stat("segment.all.current"), 1);
  gate->Open();
  backend_->synchronize_stream(0, other_.handle);
  allocator_->EmptyCache();
  EXPECT_EQ(Stat("segment.all.current"), 0);
}

TEST_F(StreamReuseTest, StreamIdsNotHandlesIdentifyStreams) {
  // A destroyed stream's handle may be recycled; a new stream must never inherit its cache.
  const StreamRef temp = backend_->create_stream(0);
  void* p = Alloc(4096, temp);
  allocator_->Free(p);
  backend_->destroy_stream(0, temp.handle);
  const StreamRef next = backend_->create_stream(0);
  EXPECT_NE(next.id, temp.id);
  void* q = Alloc(4096, next);
  EXPECT_NE(q, p);
  allocator_->Free(q);
}

// A failed asynchronous copy found while processing stream uses is finished work: the block is
// reused, the caller's Malloc succeeds, and the stream's owner hears of the failure.
TEST_F(StreamReuseTest, FailedWorkOnAUseStreamReachesTheObserverNotTheCaller) {
  std::vector<StreamError> seen;
  allocator_->SetStreamErrorObserver([&](const StreamError& e) { seen.push_back(e); });
  FreeAfterAFailingCopyOnOther();
  // Poll as Malloc does until the failing copy has run and its error was found (bounded).
  EXPECT_NO_THROW(PollUntil([&] {
    allocator_->ProcessEvents(0);
    return !seen.empty();
  }));
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].stream, other_.id);
  EXPECT_NE(seen[0].message.find("injected copy failure"), std::string::npos);
  EXPECT_EQ(Stat("active.all.current"), 0);  // the block came back
}

// An observer that throws (out of memory, say) does not take the allocation that found the error
// with it, nor make a free throw: the error stays pending, and the next look tells it again.
TEST_F(StreamReuseTest, AnObserverThatThrowsLosesNeitherTheAllocationNorTheError) {
  int thrown = 0;
  allocator_->SetStreamErrorObserver([&](const StreamError&) {
    ++thrown;
    throw std::bad_alloc();
  });
  FreeAfterAFailingCopyOnOther();
  ASSERT_NO_THROW(PollUntil([&] {
    allocator_->ProcessEvents(0);
    return thrown != 0;
  }));
  ASSERT_EQ(thrown, 1) << "the failing copy's error was never found";
  void* p = nullptr;
  ASSERT_NO_THROW(p = allocator_->Malloc(kMiB, 0, stream_));
  EXPECT_EQ(thrown, 2) << "the pending error was not told again";
  EXPECT_EQ(Stat("allocated_bytes.all.current"), static_cast<int64_t>(kMiB));
  EXPECT_NO_THROW(allocator_->Free(p));
  // Asked for the errors, the engine must know that they did not get through.
  EXPECT_THROW(allocator_->DeliverStreamErrors(0), std::bad_alloc);
  std::vector<StreamError> seen;
  allocator_->SetStreamErrorObserver([&](const StreamError& e) { seen.push_back(e); });
  allocator_->ProcessEvents(0);
  allocator_->ProcessEvents(0);
  ASSERT_EQ(seen.size(), 1u) << "told once to an observer that took it";
  EXPECT_EQ(seen[0].stream, other_.id);
}

// An allocator that goes away while a use's failed copy is pending hands back every segment and
// event all the same: the backend is shared and may live on (the first wait that heard of the
// failure ended the cleanup, and 14 MiB and the events stayed taken).
TEST_F(StreamReuseTest, AnAllocatorGoingAwayAfterAFailedCopyGivesEverythingBack) {
  void* big = Alloc(12 * kMiB, stream_);
  allocator_->Free(big);  // cached
  FreeAfterAFailingCopyOnOther();
  allocator_.reset();
  EXPECT_EQ(backend_->bytes_in_use(0), 0u);
  EXPECT_EQ(backend_->num_live_events(), 0u);
  Reset(AllocatorConfig{});  // the fixture's own teardown needs one
}

// An error stays pending while it is being delivered: a thread that asks for the device's errors
// meanwhile (the offload engine, holding the lock the first delivery waits for) is told of it
// too, under the same number, so that it can act on it once; when both are over it is gone.
TEST_F(StreamReuseTest, AnErrorBeingDeliveredReachesWhoeverAsksMeanwhile) {
  std::mutex seen_mutex;
  std::vector<StreamError> seen;
  std::atomic<int> calls{0};
  std::promise<void> second_told;
  const std::shared_future<void> second_told_future = second_told.get_future().share();
  allocator_->SetStreamErrorObserver([&](const StreamError& e) {
    {
      const std::lock_guard lock(seen_mutex);
      seen.push_back(e);
    }
    if (calls.fetch_add(1) == 0) second_told_future.wait();  // the first waits, as on a lock
  });
  FreeAfterAFailingCopyOnOther();
  std::thread first([&] {
    PollUntil([&] {
      allocator_->ProcessEvents(0);
      return calls.load() != 0;
    });
  });
  PollUntil([&] { return calls.load() != 0; });
  const bool found = calls.load() == 1;
  if (found) allocator_->DeliverStreamErrors(0);  // while the first delivery is still under way
  second_told.set_value();
  first.join();
  ASSERT_TRUE(found) << "the failing copy's error was never found";
  ASSERT_EQ(seen.size(), 2u) << "an error being delivered was gone for another thread";
  EXPECT_EQ(seen[0].seq, seen[1].seq);
  EXPECT_EQ(seen[0].found_by, 0);
  EXPECT_EQ(seen[1].stream, other_.id);
  allocator_->DeliverStreamErrors(0);
  EXPECT_EQ(seen.size(), 2u) << "an error delivered was still pending";
}

}  // namespace
}  // namespace spillway::testing
