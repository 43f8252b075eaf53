#include "allocator/address_table.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

namespace spillway {
namespace {

uintptr_t Address(uint64_t n) { return (n + 1) * 512; }  // allocations are 512-byte aligned

// The values' keys, as the allocator's blocks hold them: value v's key is keys[v].
struct Keys {
  std::vector<uintptr_t> keys{0};  // value 0 is never used
  uint32_t Add(uintptr_t key) {
    keys.push_back(key);
    return static_cast<uint32_t>(keys.size() - 1);
  }
  auto Of() const {
    return [this](uint32_t value) { return keys.at(value); };
  }
};

TEST(AddressTable, FindsInsertedAndForgetsTaken) {
  AddressTable table;
  Keys keys;
  const uint32_t a = keys.Add(Address(1));
  const uint32_t b = keys.Add(Address(2));
  EXPECT_EQ(table.Find(Address(1), keys.Of()), 0u);
  table.Insert(Address(1), a);
  table.Insert(Address(2), b);
  EXPECT_EQ(table.size(), 2u);
  EXPECT_EQ(table.Find(Address(1), keys.Of()), a);
  EXPECT_EQ(table.Find(Address(2), keys.Of()), b);
  EXPECT_EQ(table.Take(Address(1), keys.Of()), a);
  EXPECT_EQ(table.Find(Address(1), keys.Of()), 0u);
  EXPECT_EQ(table.Find(Address(2), keys.Of()), b);
  EXPECT_EQ(table.Take(Address(1), keys.Of()), 0u);  // second take: absent
  EXPECT_EQ(table.Take(0, keys.Of()), 0u);
  EXPECT_EQ(table.Find(0, keys.Of()), 0u);
  EXPECT_EQ(table.size(), 1u);
}

TEST(AddressTable, GrowsAndKeepsEveryEntry) {
  AddressTable table;
  Keys keys;
  std::vector<uint32_t> values;
  for (uint64_t i = 0; i < 100000; ++i) {
    values.push_back(keys.Add(Address(i * 7)));
    table.Insert(Address(i * 7), values.back());
  }
  ASSERT_EQ(table.size(), values.size());
  for (uint64_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(table.Find(Address(i * 7), keys.Of()), values[i]) << i;
  }
  EXPECT_EQ(table.Find(Address(3), keys.Of()), 0u);
}

// The table keeps 32 bits of each address's hash, not the address: two addresses whose hashes
// share those bits must still be told apart by the key the caller confirms with.
TEST(AddressTable, ShrinksToFitWhatIsLeftAndKeepsIt) {
  AddressTable table;
  Keys keys;
  const size_t empty = table.capacity();
  for (uint64_t n = 0; n < 10000; ++n) table.Insert(Address(n), keys.Add(Address(n)));
  const size_t grown = table.capacity();
  for (uint64_t n = 10; n < 10000; ++n) ASSERT_NE(table.Take(Address(n), keys.Of()), 0u);
  table.ShrinkToFit();
  EXPECT_EQ(table.capacity(), grown) << "the first call keeps room for the 10000 held since";
  table.ShrinkToFit();
  EXPECT_EQ(table.capacity(), empty) << "10 entries fit the smallest table";
  EXPECT_LT(table.capacity(), grown);
  for (uint64_t n = 0; n < 10; ++n) EXPECT_EQ(table.Find(Address(n), keys.Of()), n + 1);
  for (uint64_t n = 10; n < 10000; ++n) EXPECT_EQ(table.Find(Address(n), keys.Of()), 0u);
  table.Insert(Address(10), 11);  // and it takes entries again
  EXPECT_EQ(table.Find(Address(10), keys.Of()), 11u);
}

TEST(AddressTable, AddressesWithTheSameHashTagAreToldApart) {
  // The hash is (address >> 9) * C mod 2^64 and the tag its top 32 bits, so two addresses whose
  // (address >> 9) differ by d share a tag when d * C mod 2^64 is a small number m: d = m / C.
  constexpr uint64_t kC = 0x9E3779B97F4A7C15ull;
  uint64_t inverse = kC;  // Newton's iteration for C^-1 mod 2^64 (C is odd)
  for (int i = 0; i < 6; ++i) inverse *= 2 - kC * inverse;
  ASSERT_EQ(inverse * kC, 1u);
  uint64_t d = 0;
  for (uint64_t m = 1; d == 0; ++m) {
    const uint64_t candidate = inverse * m;
    if (candidate < (uint64_t{1} << 50)) d = candidate;  // keeps the address in 64 bits
  }
  const uintptr_t first = 512;
  const uintptr_t second = first + d * 512;
  auto tag = [&](uintptr_t key) { return ((key >> 9) * kC) >> 32; };
  ASSERT_EQ(tag(first), tag(second)) << "the test's premise: both addresses share a tag";

  AddressTable table;
  Keys keys;
  const uint32_t a = keys.Add(first);
  const uint32_t b = keys.Add(second);
  table.Insert(first, a);
  EXPECT_EQ(table.Find(second, keys.Of()), 0u);  // same tag, another address: absent
  EXPECT_EQ(table.Take(second, keys.Of()), 0u);
  table.Insert(second, b);
  EXPECT_EQ(table.Find(first, keys.Of()), a);
  EXPECT_EQ(table.Find(second, keys.Of()), b);
  EXPECT_EQ(table.Take(first, keys.Of()), a);
  EXPECT_EQ(table.Find(first, keys.Of()), 0u);
  EXPECT_EQ(table.Find(second, keys.Of()), b);
}

// Random churn at the highest load the table allows, where probe runs are long and wrap around
// the end of the slot array: backward-shift deletion must keep every remaining key reachable.
TEST(AddressTable, ChurnAtFullLoadMatchesAReferenceMap) {
  for (const size_t live : {size_t{47}, size_t{48}, size_t{3000}}) {
    AddressTable table;
    Keys keys;
    std::unordered_map<uintptr_t, uint32_t> reference;
    std::mt19937_64 rng(live);
    std::uniform_int_distribution<uint64_t> key_dist(0, live * 8);
    for (size_t step = 0; step < 40000; ++step) {
      const uintptr_t key = Address(key_dist(rng));
      const bool present = reference.contains(key);
      if (present && (reference.size() >= live || rng() % 2 == 0)) {
        ASSERT_EQ(table.Take(key, keys.Of()), reference[key]);
        reference.erase(key);
      } else if (!present && reference.size() < live) {
        const uint32_t value = keys.Add(key);
        table.Insert(key, value);
        reference[key] = value;
      } else {
        ASSERT_EQ(table.Find(key, keys.Of()), present ? reference[key] : 0u);
      }
      ASSERT_EQ(table.size(), reference.size());
      if (step % 97 == 0) {
        for (const auto& [k, v] : reference) {
          ASSERT_EQ(table.Find(k, keys.Of()), v) << "step " << step;
        }
      }
    }
    for (const auto& [k, v] : reference) ASSERT_EQ(table.Find(k, keys.Of()), v);
  }
}

}  // namespace
}  // namespace spillway
