#include "allocator/sim_stream.h"

#include <iterator>
#include <utility>

#include "absl/strings/str_format.h"
#include "allocator/errors.h"

namespace spillway {
namespace {

// Set on streams' worker threads: a wait there is a stream's, not the host's.
thread_local bool on_stream_worker = false;

}  // namespace

SimBackend::Stream::Stream(int device, uint64_t id, std::chrono::microseconds max_jitter,
                           uint64_t seed)
    : device_(device), id_(id), max_jitter_(max_jitter), rng_(seed), worker_([this] { Run(); }) {}

uint64_t SimBackend::Stream::Enqueue(Op op) {
  uint64_t position;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw BackendError("enqueue", absl::StrFormat("stream %d is destroyed", id_));
    queue_.push_back(std::move(op));
    position = ++enqueued_;
  }
  work_cv_.notify_one();
  return position;
}

bool SimBackend::Stream::Reached(uint64_t position) {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_ >= position;
}

void SimBackend::Stream::WaitFor(uint64_t position) {
  std::unique_lock<std::mutex> lock(mu_);
  BlockUntil(lock, position);
}

void SimBackend::Stream::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  BlockUntil(lock, enqueued_);
}

int SimBackend::Stream::Waiters(Waiting who, uint64_t position) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto from = [&](const std::multiset<uint64_t>& targets) {
    return static_cast<int>(std::distance(targets.lower_bound(position), targets.end()));
  };
  switch (who) {
    case Waiting::kHost:
      return from(host_targets_);
    case Waiting::kStreams:
      return from(stream_targets_);
    case Waiting::kAny:
      break;
  }
  return from(host_targets_) + from(stream_targets_);
}

std::optional<std::string> SimBackend::Stream::TakeError() {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<std::string> error = std::move(sticky_error_);
  sticky_error_.reset();
  return error;
}

void SimBackend::Stream::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_one();
  if (worker_.joinable()) worker_.join();
}

void SimBackend::Stream::Run() {
  on_stream_worker = true;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // Stopping, and everything enqueued has run.
    Op op = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    SleepJitter();
    std::optional<std::string> error = op();
    // Drop what the op captured (buffers' owners, other streams) before reporting completion, so
    // a waiter that then tears things down never races with this thread.
    op = nullptr;
    lock.lock();
    if (error.has_value() && !sticky_error_.has_value()) sticky_error_ = std::move(error);
    ++completed_;
    done_cv_.notify_all();
  }
}

void SimBackend::Stream::BlockUntil(std::unique_lock<std::mutex>& lock, uint64_t position) {
  if (completed_ >= position) return;
  std::multiset<uint64_t>& targets = on_stream_worker ? stream_targets_ : host_targets_;
  const auto it = targets.insert(position);
  done_cv_.wait(lock, [&] { return completed_ >= position; });
  targets.erase(it);
}

void SimBackend::Stream::SleepJitter() {
  if (max_jitter_.count() <= 0) return;
  std::uniform_int_distribution<int64_t> dist(0, max_jitter_.count());
  std::this_thread::sleep_for(std::chrono::microseconds(dist(rng_)));
}

}  // namespace spillway
