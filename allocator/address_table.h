// AddressTable: the map from a live allocation's address to its Block. Internal to the allocator.
//
// Every free looks its pointer up here, so with many live allocations this lookup is a cache
// miss on every call. A general-purpose Swiss table (absl::flat_hash_map) keeps control bytes
// and slots in separate arrays: two misses per lookup. This table keeps key and value together
// in one 16-byte slot and probes linearly, so a lookup is almost always one cache line. Deletion
// shifts the following entries back (no tombstones), so probe runs never degrade under churn.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace spillway {

template <typename Value>
class AddressTable {
 public:
  AddressTable() : slots_(kMinCapacity) {}

  size_t size() const { return size_; }

  // Null when `key` is absent. Key 0 is never stored (no allocation lives at address 0).
  Value* Find(uintptr_t key) const {
    if (key == 0) return nullptr;
    for (size_t i = Home(key);; i = Next(i)) {
      const Slot& slot = slots_[i];
      if (slot.key == key) return slot.value;
      if (slot.key == 0) return nullptr;
    }
  }

  // `key` must be non-zero and absent (the allocator inserts each live address once).
  void Insert(uintptr_t key, Value* value) {
    if ((size_ + 1) * kMaxLoadDen > slots_.size() * kMaxLoadNum) Grow();
    Place(key, value);
    ++size_;
  }

  // Returns false when `key` is absent.
  bool Erase(uintptr_t key) {
    if (key == 0) return false;
    size_t hole = Home(key);
    while (slots_[hole].key != key) {
      if (slots_[hole].key == 0) return false;
      hole = Next(hole);
    }
    // Backward-shift deletion: move each later entry of the run into the hole when the hole lies
    // on its probe path (between its home slot and where it sits), so lookups never need
    // tombstones.
    for (size_t i = Next(hole);; i = Next(i)) {
      const Slot& slot = slots_[i];
      if (slot.key == 0) break;
      const size_t home = Home(slot.key);
      const bool hole_on_path = hole <= i ? (home <= hole || home > i) : (home <= hole && home > i);
      if (hole_on_path) {
        slots_[hole] = slot;
        hole = i;
      }
    }
    slots_[hole] = Slot{};
    --size_;
    return true;
  }

  // Starts loading the cache line `key` would be looked up in.
  void Prefetch(uintptr_t key) const { __builtin_prefetch(&slots_[Home(key)]); }

 private:
  struct Slot {
    uintptr_t key = 0;
    Value* value = nullptr;
  };
  static constexpr size_t kMinCapacity = 64;
  // Grow past 3/4 full: linear probing's expected run is still about two slots there.
  static constexpr size_t kMaxLoadNum = 3;
  static constexpr size_t kMaxLoadDen = 4;

  size_t Home(uintptr_t key) const {
    // Allocations are 512-byte aligned, so the low bits carry nothing; Fibonacci hashing spreads
    // the rest and the top bits pick the slot.
    return static_cast<size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  size_t Next(size_t i) const { return (i + 1) & (slots_.size() - 1); }

  void Place(uintptr_t key, Value* value) {
    size_t i = Home(key);
    while (slots_[i].key != 0) i = Next(i);
    slots_[i] = Slot{key, value};
  }

  void Grow() {
    Slots old(slots_.size() * 2);
    old.swap(slots_);
    shift_ = 64 - std::countr_zero(slots_.size());
    for (const Slot& slot : old) {
      if (slot.key != 0) Place(slot.key, slot.value);
    }
  }

  using Slots = std::vector<Slot>;
  Slots slots_;
  size_t size_ = 0;
  int shift_ = 64 - std::countr_zero(kMinCapacity);
};

}  // namespace spillway
