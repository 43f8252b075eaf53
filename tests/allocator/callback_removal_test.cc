// The allocator calls its callbacks outside its locks, from whichever thread allocates; their
// owner (the offload engine) removes them in its destructor and then goes. A removal must
// therefore return only once no call of the removed callback is running: otherwise an
// allocation racing with the destructor called into a freed engine.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "tests/allocator/sim_fixture.h"

namespace spillway::testing {
namespace {

using namespace std::chrono_literals;

// A callback that, once entered, blocks until the test lets it go.
class Latch {
 public:
  void Enter() {
    std::unique_lock lock(mutex_);
    entered_ = true;
    changed_.notify_all();
    changed_.wait_for(lock, 10s, [&] { return released_; });
  }
  void AwaitEntered() {
    std::unique_lock lock(mutex_);
    changed_.wait_for(lock, 10s, [&] { return entered_; });
  }
  void Release() {
    std::lock_guard lock(mutex_);
    released_ = true;
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool entered_ = false;
  bool released_ = false;
};

class CallbackRemovalTest : public SimAllocatorTest {
 protected:
  // Takes 40 MiB of a fresh 64 MiB device (into `held`), so that 40 MiB more runs the
  // out-of-memory ladder, and adds an out-of-memory callback that waits in `latch`.
  uint64_t FillAndAddLatchedCallback(Latch& latch, std::atomic<bool>& returned, void*& held) {
    Reset(AllocatorConfig{}, 64 * kMiB);
    held = Alloc(40 * kMiB);
    return allocator_->AddFreeMemoryCallback([&latch, &returned](int, size_t) -> size_t {
      latch.Enter();
      returned = true;
      return 0;
    });
  }

  // Runs `remove` on another thread while a callback is inside `latch`: the removal must not
  // return before the callback has. Then lets the callback go.
  template <typename Remove>
  void ExpectRemovalWaitsForTheCall(Latch& latch, const std::atomic<bool>& call_returned,
                                    Remove remove) {
    latch.AwaitEntered();
    std::atomic<bool> removed{false};
    std::atomic<bool> call_had_returned{false};
    std::thread remover([&] {
      remove();
      call_had_returned = call_returned.load();
      removed = true;
    });
    std::this_thread::sleep_for(100ms);
    EXPECT_FALSE(removed) << "the removal returned while the callback was still running";
    latch.Release();
    remover.join();
    EXPECT_TRUE(call_had_returned);
  }
};

TEST_F(CallbackRemovalTest, ClearingThePressureHandlerWaitsForItsCall) {
  allocator_->SetWatermark(0, 1);  // every allocation runs the handler first
  Latch latch;
  std::atomic<bool> returned{false};
  allocator_->SetPressureHandler([&](int, size_t) {
    latch.Enter();
    returned = true;
  });
  std::thread allocating([&] { allocator_->Free(Alloc(4096)); });
  ExpectRemovalWaitsForTheCall(latch, returned, [&] { allocator_->SetPressureHandler({}); });
  allocating.join();
}

TEST_F(CallbackRemovalTest, RemovingAFreeMemoryCallbackWaitsForItsCall) {
  Latch latch;
  std::atomic<bool> returned{false};
  void* held = nullptr;
  const uint64_t id = FillAndAddLatchedCallback(latch, returned, held);
  std::thread allocating([&] { EXPECT_THROW(Alloc(40 * kMiB), OutOfMemoryError); });
  ExpectRemovalWaitsForTheCall(latch, returned, [&] { allocator_->RemoveFreeMemoryCallback(id); });
  allocating.join();
  allocator_->Free(held);
}

// A removal made inside another callback (here the pressure handler removes an out-of-memory
// callback) still waits for the removed callback's call on another thread: being inside a call
// exempts only calls of the slot being removed, on the removing thread.
TEST_F(CallbackRemovalTest, ARemovalInsideAnotherCallbackWaitsForTheRemovedOnesCall) {
  Latch latch;
  std::atomic<bool> returned{false};
  void* held = nullptr;
  const uint64_t id = FillAndAddLatchedCallback(latch, returned, held);
  std::thread out_of_memory([&] { EXPECT_THROW(Alloc(40 * kMiB), OutOfMemoryError); });
  latch.AwaitEntered();
  allocator_->SetWatermark(0, 1);  // from now on every allocation runs the handler first
  std::atomic<bool> handler_removed{false};
  allocator_->SetPressureHandler([&](int, size_t) {
    if (!handler_removed.exchange(true)) allocator_->RemoveFreeMemoryCallback(id);
  });
  ExpectRemovalWaitsForTheCall(latch, returned, [&] { allocator_->Free(Alloc(4096)); });
  out_of_memory.join();
  EXPECT_TRUE(handler_removed);
  allocator_->SetPressureHandler({});
  allocator_->Free(held);
}

TEST_F(CallbackRemovalTest, ACallbackMayRemoveItself) {
  allocator_->SetWatermark(0, 1);
  int calls = 0;
  allocator_->SetPressureHandler([&](int, size_t) {
    ++calls;
    allocator_->SetPressureHandler({});  // would wait for itself
  });
  allocator_->Free(Alloc(4096));
  allocator_->Free(Alloc(4096));
  EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace spillway::testing
