// Pieces the allocator and engine fuzzers share: the check that turns a broken invariant into a
// crash libFuzzer records, and a simulated device whose streams an input can hold busy.
#pragma once

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

#include "allocator/sim_backend.h"

namespace spillway::fuzz {

[[noreturn]] inline void Fail(const char* what, const char* file, int line) {
  std::fprintf(stderr, "%s:%d: invariant violated: %s\n", file, line, what);
  std::fflush(stderr);
  __builtin_trap();
}

// With SPILLWAY_FUZZ_TRACE set, prints each operation to stderr: run a crash input that way to
// see the program that led to it.
__attribute__((format(printf, 1, 2))) inline void Trace(const char* format, ...) {
  static const bool enabled = std::getenv("SPILLWAY_FUZZ_TRACE") != nullptr;
  if (!enabled) return;
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fputc('\n', stderr);
}

// Not CHECK: Abseil's logging library defines one.
#define FUZZ_CHECK(cond)                                            \
  do {                                                              \
    if (!(cond)) ::spillway::fuzz::Fail(#cond, __FILE__, __LINE__); \
  } while (0)

// A simulated device whose streams the input can hold (SimBackend::hold_stream): work queued
// behind a hold has provably not run, so reusing memory before a stream it was recorded on has
// passed is a deterministic failure instead of a race the fuzzer rarely wins.
//
// Every call that makes the host wait for the device first lets all held streams go on. A
// correct allocator or engine may wait on a held stream (the out-of-memory ladder, a segment
// given back to the device, the engine's rescue); without this the fuzzer would deadlock. A real
// GPU finishes its queued work eventually, so releasing the holds when the host waits at the
// latest is one legal schedule among those the code must handle.
class GatedBackend : public SimBackend {
 public:
  using SimBackend::SimBackend;
  ~GatedBackend() override { ReleaseAll(); }

  // Holds `stream` busy until the next release; no-op when it is held already.
  void Hold(StreamRef stream) {
    std::lock_guard lock(mu_);
    auto& hold = holds_[stream.id];
    if (hold == nullptr) hold = hold_stream(0, stream.handle);
  }
  void ReleaseAll() {
    std::lock_guard lock(mu_);
    if (holds_.empty()) return;
    holds_.clear();  // each StreamHold opens its gate as it goes
    ++generation_;
  }
  bool held(StreamRef stream) const {
    std::lock_guard lock(mu_);
    return holds_.count(stream.id) != 0;
  }
  // Changes whenever held streams were let go: work queued behind a hold taken in generation g
  // has not run as long as generation() is still g and the stream is still held.
  uint64_t generation() const {
    std::lock_guard lock(mu_);
    return generation_;
  }

  void synchronize_stream(int device, StreamHandle stream) override {
    ReleaseAll();
    SimBackend::synchronize_stream(device, stream);
  }
  void synchronize_event(int device, EventHandle event) override {
    ReleaseAll();
    SimBackend::synchronize_event(device, event);
  }
  void device_free(int device, void* ptr) override {
    ReleaseAll();
    SimBackend::device_free(device, ptr);
  }
  void host_free(void* ptr) override {
    ReleaseAll();
    SimBackend::host_free(ptr);
  }
  void destroy_stream(int device, StreamHandle stream) override {
    ReleaseAll();
    SimBackend::destroy_stream(device, stream);
  }

 private:
  mutable std::mutex mu_;
  std::map<uint64_t, std::unique_ptr<StreamHold>> holds_;  // by stream id
  uint64_t generation_ = 0;
};

}  // namespace spillway::fuzz
