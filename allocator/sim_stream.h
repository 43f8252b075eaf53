// One stream of the simulated device (sim_backend.h): internal to the simulated device's sources.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "allocator/sim_backend.h"

namespace spillway {

// One simulated stream: a FIFO of ops run by a dedicated worker thread.
//
// Positions are 1-based: the op returned as position p has run once `completed >= p`. This is what
// makes events cheap: an event is just (stream, position).
//
// Lifetime: the backend holds every live stream and calls `Shutdown` (drain, then join) before it
// lets go, so a `Stream` is never destroyed with a running worker, and never on its own worker.
class SimBackend::Stream {
 public:
  // Returns an error message when the op failed (only injected copy failures do).
  using Op = std::function<std::optional<std::string>()>;

  Stream(int device, uint64_t id, std::chrono::microseconds max_jitter, uint64_t seed);
  ~Stream() { Shutdown(); }

  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  int device() const { return device_; }
  uint64_t id() const { return id_; }
  StreamHandle handle() { return this; }

  // Returns the op's position; BackendError once the stream is shut down.
  uint64_t Enqueue(Op op);
  // Whether the op at `position` has run.
  bool Reached(uint64_t position);
  // Blocks until the op at `position` has run.
  void WaitFor(uint64_t position);
  // Waits for everything enqueued before this call.
  void Drain();
  // Whose waits Waiters counts: the host's, other streams' workers running a wait on one of its
  // events, or both.
  enum class Waiting { kHost, kStreams, kAny };
  // Threads of `who` blocked until this stream reaches `position` or later. A thread woken for an
  // earlier position and not yet running again is not one.
  int Waiters(Waiting who, uint64_t position);
  // Returns and clears the sticky error, if any.
  std::optional<std::string> TakeError();
  // Runs everything still queued, then joins the worker. Idempotent.
  void Shutdown();

 private:
  void Run();
  void BlockUntil(std::unique_lock<std::mutex>& lock, uint64_t position);
  // Only the worker touches `rng_`.
  void SleepJitter();

  const int device_;
  const uint64_t id_;
  const std::chrono::microseconds max_jitter_;
  std::mt19937_64 rng_;

  std::mutex mu_;
  std::condition_variable work_cv_;  // Signalled when an op is queued or on shutdown.
  std::condition_variable done_cv_;  // Signalled when an op completes.
  std::deque<Op> queue_;
  uint64_t enqueued_ = 0;
  uint64_t completed_ = 0;
  // Positions blocked threads wait for (BlockUntil).
  std::multiset<uint64_t> host_targets_;
  std::multiset<uint64_t> stream_targets_;
  bool stopping_ = false;
  std::optional<std::string> sticky_error_;

  // Last: it starts running `Run` during construction, after everything above is initialized.
  std::thread worker_;
};

}  // namespace spillway
