// Pieces the allocator and engine fuzzers share: the check that turns a broken invariant into a
// crash libFuzzer records, a simulated device whose streams an input can hold busy, and the
// allocator over it that each input starts afresh.
#pragma once

#include <array>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

#include "allocator/caching_allocator.h"
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

// What each input runs on: a fresh GatedBackend of `capacity` bytes, a CachingAllocator over it
// and two streams. Setting up costs two worker threads, well below the cost of the checks.
// Destroyed allocator first: it waits for its pending stream uses and returns its segments to a
// backend still there. A harness declares this after the host buffers its copies read or write
// (destroyed before them: the backend joins its workers) and before what holds its memory.
struct FuzzDevice {
  explicit FuzzDevice(size_t capacity)
      : backend(std::make_shared<GatedBackend>(Options(capacity))),
        allocator(std::make_unique<CachingAllocator>(backend, AllocatorConfig{})),
        streams{backend->default_stream(0), backend->create_stream(0)} {}
  ~FuzzDevice() {
    allocator.reset();
    backend.reset();
  }
  FuzzDevice(const FuzzDevice&) = delete;
  FuzzDevice& operator=(const FuzzDevice&) = delete;

  // Lets every held stream go, waits for both and polls the allocator's pending frees: where an
  // input's end checks that nothing is left behind.
  void Settle() {
    backend->ReleaseAll();
    for (const StreamRef& stream : streams) backend->synchronize_stream(0, stream.handle);
    allocator->ProcessEvents(0);
  }

  std::shared_ptr<GatedBackend> backend;
  std::unique_ptr<CachingAllocator> allocator;
  std::array<StreamRef, 2> streams;  // the default stream, and another

 private:
  static SimBackend::Options Options(size_t capacity) {
    SimBackend::Options options;
    options.capacity_bytes = capacity;
    return options;
  }
};

}  // namespace spillway::fuzz
