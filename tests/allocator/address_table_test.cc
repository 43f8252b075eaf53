#include "allocator/address_table.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

namespace spillway {
namespace {

struct Item {
  int id = 0;
};

uintptr_t Address(uint64_t n) { return (n + 1) * 512; }  // allocations are 512-byte aligned

TEST(AddressTable, FindsInsertedAndForgetsErased) {
  AddressTable<Item> table;
  Item a{1}, b{2};
  EXPECT_EQ(table.Find(Address(1)), nullptr);
  table.Insert(Address(1), &a);
  table.Insert(Address(2), &b);
  EXPECT_EQ(table.size(), 2u);
  EXPECT_EQ(table.Find(Address(1)), &a);
  EXPECT_EQ(table.Find(Address(2)), &b);
  EXPECT_TRUE(table.Erase(Address(1)));
  EXPECT_EQ(table.Find(Address(1)), nullptr);
  EXPECT_EQ(table.Find(Address(2)), &b);
  EXPECT_FALSE(table.Erase(Address(1)));  // second erase: absent
  EXPECT_FALSE(table.Erase(0));
  EXPECT_EQ(table.Find(0), nullptr);
  EXPECT_EQ(table.size(), 1u);
}

TEST(AddressTable, GrowsAndKeepsEveryEntry) {
  AddressTable<Item> table;
  std::vector<Item> items(100000);
  for (size_t i = 0; i < items.size(); ++i) table.Insert(Address(i * 7), &items[i]);
  ASSERT_EQ(table.size(), items.size());
  for (size_t i = 0; i < items.size(); ++i) ASSERT_EQ(table.Find(Address(i * 7)), &items[i]) << i;
  EXPECT_EQ(table.Find(Address(3)), nullptr);
}

// Random churn at the highest load the table allows, where probe runs are long and wrap around
// the end of the slot array: backward-shift deletion must keep every remaining key reachable.
TEST(AddressTable, ChurnAtFullLoadMatchesAReferenceMap) {
  for (const size_t live : {size_t{47}, size_t{48}, size_t{3000}}) {
    AddressTable<Item> table;
    std::unordered_map<uintptr_t, Item*> reference;
    std::vector<Item> items(live * 4);
    std::mt19937_64 rng(live);
    std::uniform_int_distribution<uint64_t> key_dist(0, live * 8);
    for (size_t step = 0; step < 40000; ++step) {
      const uintptr_t key = Address(key_dist(rng));
      const bool present = reference.contains(key);
      if (present && (reference.size() >= live || rng() % 2 == 0)) {
        ASSERT_TRUE(table.Erase(key));
        reference.erase(key);
      } else if (!present && reference.size() < live) {
        Item* item = &items[step % items.size()];
        table.Insert(key, item);
        reference[key] = item;
      } else {
        ASSERT_EQ(table.Find(key), present ? reference[key] : nullptr);
      }
      ASSERT_EQ(table.size(), reference.size());
      if (step % 97 == 0) {
        for (const auto& [k, v] : reference) ASSERT_EQ(table.Find(k), v) << "step " << step;
      }
    }
    for (const auto& [k, v] : reference) ASSERT_EQ(table.Find(k), v);
  }
}

}  // namespace
}  // namespace spillway
