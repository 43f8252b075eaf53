// AddressTable: the map from a live allocation's address to its block id. Internal to the
// allocator.
//
// Every free looks its pointer up here, so with many live allocations this lookup is a cache
// miss on every call, and the table's size decides how often. A slot is 8 bytes: the block id
// and 32 bits of the address's hash, not the address itself. A matching hash is confirmed by
// reading the address from the block (`key_of`), which the caller reads next anyway, so a lookup
// still costs one cache line of table and the table is half the size of one that stores
// addresses. Linear probing; deletion shifts the following entries back (no tombstones), so probe
// runs never degrade under churn.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace spillway {

class AddressTable {
 public:
  // Values are non-zero (0 marks an empty slot); `key_of(value)` gives back the key stored with
  // `value`. Keys are non-zero (no allocation lives at address 0).
  AddressTable() : slots_(kMinCapacity) {}

  size_t size() const { return size_; }
  static constexpr size_t kBytesPerSlot = 8;
  // Slots held; a power of two.
  size_t capacity() const { return slots_.size(); }

  // 0 when `key` is absent.
  template <typename KeyOf>
  uint32_t Find(uintptr_t key, KeyOf key_of) const {
    const size_t i = Locate(key, key_of);
    return i == kAbsent ? 0 : slots_[i].value;
  }

  // `key` must be non-zero and absent, `value` non-zero (the allocator inserts each live address
  // once).
  void Insert(uintptr_t key, uint32_t value) {
    if ((size_ + 1) * kMaxLoadDen > slots_.size() * kMaxLoadNum) Grow();
    Place(Slot{static_cast<uint32_t>(Hash(key) >> 32), value});
    ++size_;
    peak_size_ = std::max(peak_size_, size_);  // for ShrinkToFit's hysteresis
  }

  // Removes `key` and returns its value; 0 (and no change) when `key` is absent.
  template <typename KeyOf>
  uint32_t Take(uintptr_t key, KeyOf key_of) {
    size_t hole = Locate(key, key_of);
    if (hole == kAbsent) return 0;
    const uint32_t value = slots_[hole].value;
    // Backward-shift deletion: move each later entry of the run into the hole when the hole lies
    // on its probe path (between its home slot and where it sits), so lookups never need
    // tombstones. An entry's home comes from its tag: the tag is the hash's top 32 bits, and the
    // home is its top log2(capacity) bits.
    for (size_t i = Next(hole);; i = Next(i)) {
      const Slot& slot = slots_[i];
      if (slot.value == 0) break;
      const size_t home = TagHome(slot.tag);
      const bool hole_on_path = hole <= i ? (home <= hole || home > i) : (home <= hole && home > i);
      if (hole_on_path) {
        slots_[hole] = slot;
        hole = i;
      }
    }
    slots_[hole] = Slot{};
    --size_;
    return value;
  }

  // Gives back what a burst of live allocations grew the table to, once they are gone (the
  // allocator calls it from empty_cache): the smallest capacity at most half full with the most
  // entries held at once since the last call. That hysteresis is for workloads that repeat
  // (training steps with empty_cache between them): the table keeps what the last round needed
  // instead of regrowing, rehash by rehash, every round; what a round no longer needs goes back
  // at the call after it.
  void ShrinkToFit() {
    size_t capacity = kMinCapacity;
    while (capacity < 2 * peak_size_) capacity *= 2;
    peak_size_ = size_;
    if (capacity < slots_.size()) Rehash(capacity);
  }

  // Starts loading the cache line `key` would be looked up in.
  void Prefetch(uintptr_t key) const { __builtin_prefetch(&slots_[Home(Hash(key))]); }

 private:
  struct Slot {
    uint32_t tag = 0;
    uint32_t value = 0;  // 0: empty
  };
  static_assert(sizeof(Slot) == kBytesPerSlot);
  static constexpr size_t kMinCapacity = 64;
  static constexpr size_t kAbsent = SIZE_MAX;

  // The slot holding `key`, or kAbsent. A tag match is confirmed with the caller's key.
  template <typename KeyOf>
  size_t Locate(uintptr_t key, KeyOf key_of) const {
    if (key == 0) return kAbsent;
    const uint64_t hash = Hash(key);
    const auto tag = static_cast<uint32_t>(hash >> 32);
    for (size_t i = Home(hash);; i = Next(i)) {
      const Slot& slot = slots_[i];
      if (slot.value == 0) return kAbsent;
      if (slot.tag == tag && key_of(slot.value) == key) return i;
    }
  }
  // Grow past 3/4 full: linear probing's expected run is still about two slots there.
  static constexpr size_t kMaxLoadNum = 3;
  static constexpr size_t kMaxLoadDen = 4;

  static uint64_t Hash(uintptr_t key) {
    // Allocations are 512-byte aligned, so the low bits carry nothing; Fibonacci hashing spreads
    // the rest into the top bits, which pick the slot and make the tag.
    return (static_cast<uint64_t>(key) >> 9) * 0x9E3779B97F4A7C15ull;
  }
  size_t Home(uint64_t hash) const { return static_cast<size_t>(hash >> shift_); }
  // The home from the tag alone (shift_ >= 32: the table never has more than 2^32 slots).
  size_t TagHome(uint32_t tag) const { return static_cast<size_t>(tag >> (shift_ - 32)); }
  size_t Next(size_t i) const { return (i + 1) & (slots_.size() - 1); }

  void Place(const Slot& entry) {
    size_t i = TagHome(entry.tag);
    while (slots_[i].value != 0) i = Next(i);
    slots_[i] = entry;
  }

  void Grow() { Rehash(slots_.size() * 2); }
  void Rehash(size_t capacity) {
    Slots old(capacity);
    old.swap(slots_);
    shift_ = 64 - std::countr_zero(slots_.size());
    for (const Slot& slot : old) {
      if (slot.value != 0) Place(slot);
    }
  }

  using Slots = std::vector<Slot>;
  Slots slots_;
  size_t size_ = 0;
  size_t peak_size_ = 0;  // the most entries held at once since the last ShrinkToFit
  int shift_ = 64 - std::countr_zero(kMinCapacity);
};

}  // namespace spillway
