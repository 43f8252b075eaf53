// Failures of stream work that an allocator finds while it waits for a stream use, and the ledger
// that keeps them for the work's owner.
//
// A stream-ordered allocator waits for the streams that used a freed block (events, host waits).
// When such a wait reports a failure (an asynchronous copy failed), the allocator only needs the
// work to be over; whose work failed is none of its business. It hands the failure to a
// StreamFailureSink and goes on. The ledger is the sink the multi-device front gives each device:
// it numbers the failures and keeps them until their delivery to the owner (the offload engine,
// through CachingAllocator's StreamErrorObserver) is over.
//
// Threads and locks: a sink is called under the reporting allocator's lock, so it must not call
// back into that allocator. The ledger has a mutex of its own, taken after the allocator's (the
// order is always allocator, then ledger) and never held while calling anything else.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "allocator/errors.h"

namespace spillway {

// Told of a failure of work on `stream` (StreamRef::id) of `device`, found while waiting for a
// stream use. Called under the finder's lock: it must not call into the finder.
class StreamFailureSink {
 public:
  virtual ~StreamFailureSink() = default;
  virtual void OnStreamFailure(int device, uint64_t stream, const BackendError& error) = 0;
};

// A failure reported while waiting for a stream's work (an asynchronous copy failed). The
// allocator only needs the work to be over; the work's owner learns of the failure from this.
struct StreamError {
  int device = 0;
  uint64_t stream = 0;  // StreamRef::id
  std::string message;
  // Which device's allocator found it, and its number there (from 1, in the order found). An
  // error stays pending until a delivery of it is over, so that a thread that asks for the
  // errors while another is delivering them (and waits for a lock that thread holds) gets them
  // too: an observer may be told of one error more than once, and acts on each number once.
  int found_by = 0;
  uint64_t seq = 0;
};

// The failures one device's allocator found, in the order found, until retired.
//
// Invariants: seq numbers are 1, 2, ... in the order found; Pending() holds every error numbered
// above the highest retired one; has_errors() is true while Pending() is not empty (read without
// the lock: a stale false only delays a delivery to the next look, a stale true costs one look).
// A reader that must also see a failure another thread has taken from the backend and not yet
// reported asks the allocator to finish its calls under way first (DeviceAllocator::AwaitReports).
class StreamErrorLedger final : public StreamFailureSink {
 public:
  // `found_by`: the device whose allocator reports here (StreamError::found_by).
  explicit StreamErrorLedger(int found_by) : found_by_(found_by) {}
  StreamErrorLedger(const StreamErrorLedger&) = delete;
  StreamErrorLedger& operator=(const StreamErrorLedger&) = delete;

  void OnStreamFailure(int device, uint64_t stream, const BackendError& error) override;

  bool has_errors() const { return has_errors_.load(std::memory_order_relaxed); }
  // The errors not yet retired, oldest first.
  std::vector<StreamError> Pending() const;
  // Drops the pending errors numbered up to `seq`: their delivery is over.
  void Retire(uint64_t seq);
  // How many errors were reported so far (the last StreamError::seq given).
  uint64_t found() const;

 private:
  const int found_by_;
  mutable std::mutex mutex_;
  std::vector<StreamError> errors_;  // pending, in the order found
  uint64_t found_ = 0;
  std::atomic<bool> has_errors_{false};
};

}  // namespace spillway
