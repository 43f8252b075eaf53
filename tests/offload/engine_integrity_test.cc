// Data integrity under random operations, the proof that a missing wait is caught, and
// concurrent registration and reloads.
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "tests/offload/engine_fixture.h"

namespace spillway::testing {
namespace {

class OffloadIntegrity : public OffloadEngineTest {};

// Random saves, releases, policy runs, reloads and drops; every reload is checked byte for byte
// on the consumer stream, as a kernel would read it.
TEST_F(OffloadIntegrity, RandomContentsSurviveSpillAndReload) {
  OffloadConfig config = Policy(OffloadPolicy::kAuto);
  config.budget_bytes = 12 * kMiB;
  config.prefetch_bytes = 2 * kMiB;
  Make(config, 96 * kMiB, std::chrono::microseconds{200});
  const StreamRef side = backend_->create_stream(0);
  struct Live {
    std::shared_ptr<TestStorage> storage;
    KeeperId id;
    uint32_t seed;
  };
  std::vector<Live> live;
  std::mt19937 rng(12345);
  uint32_t next_seed = 1;
  int checked = 0;
  const int kOps = kThreadSanitizer ? 2000 : 10000;
  for (int op = 0; op < kOps; ++op) {
    const int kind = static_cast<int>(rng() % 10);
    if (kind < 4 && live.size() < 24) {  // save a new activation
      const size_t nbytes = 4096 + (rng() % (3 * kMiB));
      const uint32_t seed = next_seed++;
      auto s = NewStorage(nbytes, seed);
      storages_.clear();
      live.push_back({s, Save(s), seed});
      s->holders = static_cast<int64_t>(rng() % 2);
    } else if (kind < 6 && !live.empty()) {  // the program lets go of one
      live[rng() % live.size()].storage->holders = 0;
    } else if (kind < 9 && !live.empty()) {  // backward reads one, maybe on a side stream
      const size_t i = rng() % live.size();
      const StreamRef consumer = rng() % 4 == 0 ? side : compute_;
      void* ptr = engine_->Acquire(live[i].id, consumer);
      ASSERT_EQ(ReadOn(consumer, ptr, live[i].storage->nbytes()),
                Pattern(live[i].storage->nbytes(), live[i].seed))
          << "op " << op;
      ++checked;
      if (rng() % 2 == 0) {
        engine_->RemoveKeeper(live[i].id);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
    } else if (!live.empty()) {
      engine_->ForwardEnd();
    }
  }
  EXPECT_GT(checked, kOps / 5);
  EXPECT_GT(EngineStat("num_spills"), kOps / 100);
  EXPECT_GT(EngineStat("num_reloads"), kOps / 100);
  for (Live& l : live) engine_->RemoveKeeper(l.id);
  live.clear();
  engine_->Synchronize();
  EXPECT_EQ(EngineStat("host_bytes.current"), 0);
  EXPECT_EQ(EngineStat("spilled_bytes.current"), 0);
  backend_->synchronize_stream(0, side.handle);
  allocator_->ProcessEvents(0);
  EXPECT_EQ(AllocStat("allocated_bytes.all.current"), 0);
}

// Proof the harness can fail: without the consumer's wait on reload-done, a read issued right
// after Acquire sees bytes the H2D copy has not written yet. The H2D stream is held by a gate, so
// the outcome does not depend on timing.
TEST_F(OffloadIntegrity, DroppingTheConsumerWaitIsCaught) {
  Make(Policy(OffloadPolicy::kEager), 256 * kMiB, std::chrono::microseconds{0});
  for (const bool skip : {true, false}) {
    engine_->set_skip_consumer_wait_for_testing(skip);
    const uint32_t seed = skip ? 100 : 200;
    auto s = NewStorage(kMiB, seed);
    const KeeperId id = Save(s);
    EndForwardSavesOnly({s});
    // The reload will likely get the same cached block back: scrub it, or stale-but-right bytes
    // would hide a missing wait.
    allocator_->ProcessEvents(0);
    void* scratch = allocator_->Malloc(kMiB, 0, compute_);
    std::memset(scratch, 0, kMiB);
    allocator_->Free(scratch);
    // The copy runs once the consumer's stream waits for it: never, without the wait.
    auto gate = backend_->hold_stream(0, engine_->h2d_stream_for_testing(0).handle,
                                      SimBackend::HoldRelease::kWhenWaitedFor);
    void* ptr = engine_->Acquire(id, compute_);
    const bool intact = ReadOn(compute_, ptr, kMiB) == Pattern(kMiB, seed);
    if (skip) {
      // Nothing orders the read after the held copy: it must see the scrubbed bytes.
      EXPECT_FALSE(gate->opened_by_wait());
      gate->Open();
      EXPECT_FALSE(intact) << "a missing wait went unnoticed";
    } else {
      EXPECT_TRUE(gate->opened_by_wait()) << "the read did not wait for the copy";
      EXPECT_TRUE(intact);
    }
    engine_->Synchronize();
    engine_->RemoveKeeper(id);
    storages_.clear();
  }
}

// A storage saved again on another stream, after a write there: the spill must wait for that
// stream's work, not only for the stream of the first save (whose graph is gone by then), or it
// copies out the bytes from before the write.
TEST_F(OffloadIntegrity, ASpillWaitsForTheStreamOfTheLatestSave) {
  accesses_follow_streams_ = true;  // as on a GPU: only stream waits order the copies
  Make(Policy(OffloadPolicy::kEager), 256 * kMiB, std::chrono::microseconds{0});
  auto s = NewStorage(kMiB, 1);
  const KeeperId first = Save(s);
  const StreamRef side = backend_->create_stream(0);
  const std::vector<uint8_t> rewritten = Pattern(kMiB, 2);
  auto gate = backend_->hold_stream(0, side.handle, SimBackend::HoldRelease::kWhenWaitedFor);
  backend_->memcpy_async(0, s->data(), rewritten.data(), kMiB, CopyKind::kHostToDevice,
                         side.handle);  // an in-place write on `side`, queued behind the gate
  const auto second = engine_->AddKeeper(
      s.get(), [&] { return s; }, FloatView(kMiB), side);
  ASSERT_TRUE(second.has_value());
  engine_->RemoveKeeper(first);  // the first graph is freed without backward
  s->holders = 0;
  engine_->ForwardEnd();  // eager: the spill is issued now
  // Ordered after the write, the copy out waits for `side`, which opens the gate; unordered, it
  // runs at once and the gate stays shut until this opens it.
  engine_->Synchronize();
  EXPECT_TRUE(gate->opened_by_wait()) << "the spill did not wait for the latest save's stream";
  gate->Open();
  engine_->Synchronize();
  ASSERT_EQ(StateOf(s), Residency::kSpilled);
  EXPECT_EQ(ReadOn(compute_, engine_->Acquire(*second, compute_), kMiB), rewritten);
  engine_->RemoveKeeper(*second);
}

// A prefetch dropped while its copy is queued (the storage died before backward read it): its
// block goes back to the allocator and the next allocation may get it. On the simulated device
// the program's CPU kernels write from the host thread, which no stream wait orders: the drop
// waits for the copy on the host, or the copy lands on the next owner's bytes.
TEST_F(OffloadIntegrity, ADroppedPrefetchsCopyDoesNotLandOnTheNextOwner) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = 4 * kMiB;
  Make(config, 64 * kMiB, std::chrono::microseconds{0});
  std::shared_ptr<TestStorage> a = NewStorage(4 * kMiB, 21);
  std::shared_ptr<TestStorage> b = NewStorage(4 * kMiB, 22);
  const KeeperId ida = Save(a);
  const KeeperId idb = Save(b);
  EndForwardSavesOnly({a, b});
  ASSERT_EQ(StateOf(a), Residency::kSpilled);
  // The copies run once the host waits for them: the drop, or (without its wait) only the
  // engine's synchronization at the end, after the next owner wrote. (The compute stream waits
  // for b's reload all along: a stream's wait does not open this hold.)
  auto hold = backend_->hold_stream(0, engine_->h2d_stream_for_testing(0).handle,
                                    SimBackend::HoldRelease::kWhenHostWaits);
  engine_->Acquire(idb, compute_);  // b's reload, then a's prefetch, both queued behind the hold
  ASSERT_EQ(StateOf(a), Residency::kReloading);
  void* prefetch_block = a->data();
  std::erase(storages_, a);
  a.reset();
  engine_->RemoveKeeper(ida);  // a's storage goes, its block back to the allocator
  EXPECT_TRUE(hold->opened_by_wait()) << "the drop did not wait for its queued copy";
  // The program's next allocations, until one gets that block.
  std::vector<void*> taken;
  while (taken.size() < 16 && (taken.empty() || taken.back() != prefetch_block)) {
    taken.push_back(allocator_->Malloc(4 * kMiB, 0, compute_));
  }
  const bool reused = taken.back() == prefetch_block;
  const std::vector<uint8_t> fill(4 * kMiB, 0x5A);
  if (reused) std::memcpy(taken.back(), fill.data(), fill.size());  // a CPU kernel: host thread
  ASSERT_TRUE(reused) << "the test needs the prefetch's block handed out again";
  engine_->Synchronize();
  EXPECT_EQ(ReadOn(compute_, taken.back(), fill.size()), fill)
      << "the prefetch's copy overwrote them";
  for (void* p : taken) allocator_->Free(p);
  b.reset();
  engine_->RemoveKeeper(idb);
}

TEST_F(OffloadIntegrity, ConcurrentForwardAndBackwardThreads) {
  OffloadConfig config = Policy(OffloadPolicy::kEager);
  config.prefetch_bytes = kMiB;
  Make(config, 256 * kMiB, std::chrono::microseconds{100});
  // Storages are created up front; one thread saves and releases them while another reloads
  // what the first has published.
  constexpr int kCount = 200;
  std::vector<std::shared_ptr<TestStorage>> all;
  all.reserve(kCount);
  for (int i = 0; i < kCount; ++i) all.push_back(NewStorage(64 * kKiB, static_cast<uint32_t>(i)));
  storages_.clear();
  std::vector<std::atomic<KeeperId>> ids(kCount);
  std::atomic<int> published{0};
  std::atomic<int> mismatches{0};
  std::thread forward([&] {
    for (int i = 0; i < kCount; ++i) {
      ids[static_cast<size_t>(i)] = Save(all[static_cast<size_t>(i)]);
      all[static_cast<size_t>(i)]->holders = 0;
      engine_->RunPolicy();
      published = i + 1;
    }
  });
  const StreamRef backward_stream = backend_->create_stream(0);
  std::thread backward([&] {
    for (int i = 0; i < kCount; ++i) {
      while (published.load() <= i) std::this_thread::yield();
      const auto& s = all[static_cast<size_t>(i)];
      void* ptr = engine_->Acquire(ids[static_cast<size_t>(i)], backward_stream);
      std::vector<uint8_t> out(s->nbytes());
      backend_->memcpy_async(0, out.data(), ptr, out.size(), CopyKind::kDeviceToHost,
                             backward_stream.handle);
      backend_->synchronize_stream(0, backward_stream.handle);
      if (out != Pattern(s->nbytes(), static_cast<uint32_t>(i))) ++mismatches;
      engine_->RemoveKeeper(ids[static_cast<size_t>(i)]);
    }
  });
  forward.join();
  backward.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(EngineStat("num_entries"), 0);
}

}  // namespace
}  // namespace spillway::testing
