#include "allocator/budget_adaptor.h"

#include "absl/strings/str_format.h"
#include "allocator/errors.h"

namespace spillway {

void BudgetAdaptor::SetWatermarkFraction(double fraction) {
  // Checked here as well as by the core: the caller set a watermark, and the message says so.
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    throw InvalidArgumentError(absl::StrFormat(
        "watermark fraction %g for device %d is out of range: expected a value in (0, 1]", fraction,
        upstream_.device()));
  }
  upstream_.SetSoftLimitFraction(fraction);
}

void BudgetAdaptor::RelievePressure(size_t size, StreamRef stream) {
  const auto handler = handler_.Get();
  if (const CallbackGuard::Call call(guard_, handler.get());
      call && upstream_.CouldEverFit(size, stream)) {
    handler->fn(upstream_.device(), upstream_.RoundSize(size));
  }
}

}  // namespace spillway
