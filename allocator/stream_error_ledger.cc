#include "allocator/stream_error_ledger.h"

namespace spillway {

void StreamErrorLedger::OnStreamFailure(int device, uint64_t stream, const BackendError& error) {
  std::lock_guard lock(mutex_);
  errors_.push_back(StreamError{device, stream, error.what(), found_by_, ++found_});
  has_errors_.store(true, std::memory_order_relaxed);
}

std::vector<StreamError> StreamErrorLedger::Pending() const {
  std::lock_guard lock(mutex_);
  return errors_;
}

void StreamErrorLedger::Retire(uint64_t seq) {
  std::lock_guard lock(mutex_);
  std::erase_if(errors_, [&](const StreamError& error) { return error.seq <= seq; });
  has_errors_.store(!errors_.empty(), std::memory_order_relaxed);
}

uint64_t StreamErrorLedger::found() const {
  std::lock_guard lock(mutex_);
  return found_;
}

}  // namespace spillway
