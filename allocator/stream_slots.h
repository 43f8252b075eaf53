// StreamSlots: small numbers for the streams a device's segments belong to. Internal to the
// allocator.
//
// A Block names its allocation stream in 16 bits, not by the 64-bit StreamRef::id, to stay 32
// bytes (block.h). A slot is held while any segment of its stream exists and is reused after,
// so programs that create streams without end never run out of slots; only 65535 streams each
// holding device memory at the same time would.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_format.h"
#include "allocator/errors.h"

namespace spillway {

class StreamSlots {
 public:
  // The slot of stream `id`, taken for one more segment.
  uint16_t Acquire(uint64_t id) {
    if (const auto it = slot_of_.find(id); it != slot_of_.end()) {
      ++segments_[it->second];
      return it->second;
    }
    uint16_t slot = 0;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      if (ids_.size() > UINT16_MAX) {
        throw InvalidArgumentError(absl::StrFormat(
            "too many streams hold device memory at once (%d); at most %d are supported",
            ids_.size(), UINT16_MAX + 1));
      }
      slot = static_cast<uint16_t>(ids_.size());
      ids_.push_back(0);
      segments_.push_back(0);
    }
    ids_[slot] = id;
    segments_[slot] = 1;
    slot_of_[id] = slot;
    return slot;
  }
  // The slot of stream `id`, if it has one (it has a segment). Consecutive calls almost always
  // name the same stream: the last answer is checked before the map.
  std::optional<uint16_t> Find(uint64_t id) {
    if (last_ < ids_.size() && ids_[last_] == id && segments_[last_] > 0) return last_;
    const auto it = slot_of_.find(id);
    if (it == slot_of_.end()) return std::nullopt;
    last_ = it->second;
    return last_;
  }
  // One segment of the stream in `slot` is gone; the last one frees the slot.
  void Release(uint16_t slot) {
    if (--segments_[slot] > 0) return;
    slot_of_.erase(ids_[slot]);
    free_.push_back(slot);
  }
  uint64_t id(uint16_t slot) const { return ids_[slot]; }

 private:
  std::vector<uint64_t> ids_;       // by slot
  std::vector<uint32_t> segments_;  // by slot: segments of that stream
  absl::flat_hash_map<uint64_t, uint16_t> slot_of_;
  std::vector<uint16_t> free_;
  uint16_t last_ = 0;  // Find's last answer
};

}  // namespace spillway
