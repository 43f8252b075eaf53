// The fixture of the fault-injection tests: faults injected through the simulated device must
// surface as a clear error at the call they belong to, corrupt nothing, leak nothing, and leave
// the engine serving every other entry.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "allocator/errors.h"
#include "tests/offload/engine_fixture.h"

namespace spillway::testing {

inline ::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

class OffloadFaultInjection : public OffloadEngineTest {
 protected:
  std::vector<uint8_t> Read(const std::shared_ptr<TestStorage>& s) {
    return ReadOn(compute_, s->data(), s->nbytes());
  }

  // The program's next allocation of `nbytes` on the compute stream, written there by a kernel
  // while the engine's host-to-device stream is held by `hold`; returns what the block holds
  // once every copy has run. Anything but the kernel's bytes means an engine copy landed in a
  // block handed out again without anything ordering the two.
  std::vector<uint8_t> KernelWriteIntoNextBlock(SimBackend::StreamHold& hold, size_t nbytes) {
    void* next = allocator_->Malloc(nbytes, 0, compute_);
    const std::vector<uint8_t> fill(nbytes, kFill);
    backend_->memcpy_async(0, next, fill.data(), nbytes, CopyKind::kHostToDevice, compute_.handle);
    // Unordered, the kernel runs within microseconds, before the held copy: give it that chance.
    // Correctly ordered after the copy it cannot run yet, and the wait just runs out.
    EventHandle written = backend_->create_event(0);
    backend_->record_event(0, written, compute_.handle);
    PollUntil([&] { return backend_->query_event(0, written); }, std::chrono::milliseconds(100));
    hold.Open();
    engine_->Synchronize();
    std::vector<uint8_t> out = ReadOn(compute_, next, nbytes);
    backend_->destroy_event(0, written);
    allocator_->Free(next);
    return out;
  }

  static constexpr uint8_t kFill = 0x5A;

  // Runs `call` with the next copy enqueued on the simulated device made to fail when it runs
  // (disarmed after the call, however it ends: the countdown counts copies as they are enqueued).
  template <typename Call>
  void WithNextCopyFailing(Call call) {
    struct Disarm {
      SimBackend& backend;
      ~Disarm() { backend.fail_copy_after(-1); }
    } disarm{*backend_};
    backend_->fail_copy_after(1);
    call();
  }

  // `call` must throw the loss of an entry whose copy failed, never a pointer or out of memory,
  // each of `times` times it is made.
  template <typename Call>
  void ExpectLostAt(Call call, int times = 2) {
    for (int attempt = 0; attempt < times; ++attempt) {
      try {
        call();
        ADD_FAILURE() << "a call for an entry whose bytes never arrived returned";
      } catch (const OutOfMemoryError& e) {
        ADD_FAILURE() << "a failed copy reported as out of memory: " << e.what();
      } catch (const Error& e) {
        EXPECT_TRUE(Contains(e.what(), "could not be brought back"));
        EXPECT_TRUE(Contains(e.what(), "injected copy failure"));
      }
    }
  }
  void ExpectLost(KeeperId id) {
    ExpectLostAt([&] { engine_->Acquire(id, compute_); });
  }

  // Where the reload tests start: on a 64 MiB device, `a` (12 MiB, its own segment) is spilled
  // and `b` (16 MiB) stays resident, held by the program throughout.
  struct SpilledAndHeld {
    std::shared_ptr<TestStorage> a, b;
    KeeperId ida = 0, idb = 0;
  };
  SpilledAndHeld SpillOneHoldOne() {
    Make(Policy(OffloadPolicy::kEager), 64 * kMiB, std::chrono::microseconds{0});
    SpilledAndHeld out{NewStorage(12 * kMiB, 1), NewStorage(16 * kMiB, 2)};
    out.ida = Save(out.a);
    out.idb = Save(out.b);
    EndForwardSavesOnly({out.a});
    EXPECT_EQ(StateOf(out.a), Residency::kSpilled);
    EXPECT_EQ(StateOf(out.b), Residency::kResident);
    return out;
  }

  // Runs every op already enqueued on the device's streams, without asking any of them for an
  // error (the simulated device drains on a raw free and reports nothing).
  void DrainWithoutLooking() {
    void* raw = backend_->device_malloc(0, kMiB).value();
    backend_->device_free(0, raw);
  }

  // Spills `s` (saved, and held until now) by a copy that fails, and lets that copy run with
  // nobody hearing of it: the entry stays spilling, its old block pending on the copy.
  void SpillByACopyNobodyHearsFail(TestStorage& s) {
    {
      auto hold = backend_->hold_stream(0, compute_.handle);  // the copy waits behind it
      s.holders = 0;
      WithNextCopyFailing([&] { engine_->ForwardEnd(); });
      ASSERT_EQ(engine_->Describe(&s).value().residency, Residency::kSpilling);
    }
    DrainWithoutLooking();
  }

  // Drops every keeper and storage, then checks that neither device nor pinned memory is left.
  void DropAllAndExpectNoLeaks(const std::vector<KeeperId>& ids) {
    for (const KeeperId id : ids) engine_->RemoveKeeper(id);
    storages_.clear();
    engine_->Synchronize();
    backend_->synchronize_stream(0, compute_.handle);
    allocator_->ProcessEvents(0);
    EXPECT_EQ(EngineStat("num_entries"), 0);
    EXPECT_EQ(AllocStat("allocated_bytes.all.current"), 0);
    EXPECT_EQ(EngineStat("host_bytes.current"), 0);
    EXPECT_EQ(EngineStat("spilled_bytes.current"), 0);
  }
};

}  // namespace spillway::testing
