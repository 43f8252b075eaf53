#include "allocator/stream_slots.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>

#include "allocator/errors.h"

namespace spillway {
namespace {

TEST(StreamSlots, OneSlotPerStreamHeldWhileItHasSegments) {
  StreamSlots slots;
  const uint16_t a = slots.Acquire(1001);
  const uint16_t b = slots.Acquire(2002);
  EXPECT_NE(a, b);
  EXPECT_EQ(slots.Acquire(1001), a);  // a second segment of the same stream
  EXPECT_EQ(slots.id(a), 1001u);
  EXPECT_EQ(slots.id(b), 2002u);
  EXPECT_EQ(slots.Find(1001), a);
  EXPECT_EQ(slots.Find(3003), std::nullopt);
  slots.Release(a);
  EXPECT_EQ(slots.Find(1001), a);  // one segment left
  slots.Release(a);
  EXPECT_EQ(slots.Find(1001), std::nullopt);  // gone with its last segment
  EXPECT_EQ(slots.Find(2002), b);
}

TEST(StreamSlots, AFreedSlotGoesToTheNextNewStream) {
  StreamSlots slots;
  const uint16_t a = slots.Acquire(1001);
  EXPECT_EQ(slots.Find(1001), a);  // now Find's remembered answer
  slots.Release(a);
  const uint16_t c = slots.Acquire(3003);
  EXPECT_EQ(c, a);
  EXPECT_EQ(slots.id(c), 3003u);
  EXPECT_EQ(slots.Find(1001), std::nullopt);  // the remembered answer is not trusted blindly
  EXPECT_EQ(slots.Find(3003), c);
}

TEST(StreamSlots, StreamsWithoutEndDoNotRunOutWhenTheyComeAndGo) {
  StreamSlots slots;
  for (uint64_t id = 1; id <= 200000; ++id) slots.Release(slots.Acquire(id));
  EXPECT_EQ(slots.Acquire(7), 0u);
}

TEST(StreamSlots, TooManyStreamsHoldingMemoryAtOnceIsAClearError) {
  StreamSlots slots;
  for (uint64_t id = 0; id <= UINT16_MAX; ++id) slots.Acquire(id);
  try {
    slots.Acquire(UINT16_MAX + 1);
    FAIL() << "expected an error";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("too many streams"), std::string::npos) << e.what();
  }
  slots.Release(slots.Find(5).value());
  EXPECT_EQ(slots.Acquire(UINT16_MAX + 1), 5u);  // a slot came free: served again
}

}  // namespace
}  // namespace spillway
