// Exceptions thrown across Spillway's C++ API.
//
// All derive from `spillway::Error` (a `std::runtime_error`), so a caller can catch one type. The
// C ABI and the PyTorch layer translate them at their boundary: the C ABI returns null and keeps
// the message for `spillway_last_error()`, the torch layer raises the matching Python exception.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

namespace spillway {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The caller passed something Spillway does not accept: a pointer it does not own, a double
// free, a bad device index, an absurd size, a malformed configuration.
class InvalidArgumentError : public Error {
 public:
  using Error::Error;
};

// A device allocation could not be satisfied after the whole out-of-memory ladder ran. The
// message carries requested bytes, device, allocated, reserved, limit, free and largest free block.
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(const std::string& message, size_t requested_bytes, int device)
      : Error(message), requested_bytes_(requested_bytes), device_(device) {}
  size_t requested_bytes() const { return requested_bytes_; }
  int device() const { return device_; }

 private:
  size_t requested_bytes_;
  int device_;
};

// A backend operation failed unexpectedly (a CUDA error other than out-of-memory, an injected
// fault in the simulated device).
class BackendError : public Error {
 public:
  // `earlier_work`: the failure is not the call's own but that of asynchronous work enqueued
  // before it (an earlier copy on the stream), reported to this call, which had no effect. Only
  // the simulated device reports those apart; CUDA's are sticky, so nothing after them works.
  BackendError(std::string_view operation, std::string_view detail, bool earlier_work = false)
      : Error(std::string(operation) + " failed: " + std::string(detail)),
        operation_(operation),
        detail_(detail),
        earlier_work_(earlier_work) {}
  const std::string& operation() const { return operation_; }
  const std::string& detail() const { return detail_; }
  bool earlier_work() const { return earlier_work_; }

 private:
  std::string operation_;
  std::string detail_;
  bool earlier_work_;
};

}  // namespace spillway
