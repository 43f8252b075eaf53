// Blocks, the free-block index and the arena blocks live in. Internal to the allocator.
//
// Why blocks are 32 bytes and linked by 32-bit ids: with 100k live allocations every free and
// malloc touches a handful of blocks at random (the block, its neighbours, a split's remainder),
// and each touch is a cache miss once the metadata outgrows the last-level cache. Half-size
// blocks halve that footprint, which is what keeps per-operation time close to flat as the
// number of live allocations grows (bench/complexity.py counts it; spillway_allocator_bench
// times it).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <vector>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "allocator/backend.h"
#include "allocator/history.h"
#include "allocator/size_policy.h"

namespace spillway {

// A block's index in its BlockArena. 0 is never a block: it stands for "none".
using BlockId = uint32_t;
inline constexpr BlockId kNoBlock = 0;

// A stream of another device that used a block (record_stream with another device's stream).
struct ForeignStreamUse {
  int device = 0;
  StreamRef stream;
};

// What only some blocks need, kept out of line: streams recorded by record_stream, the events
// still pending for them after a free, and what the history notes of its allocation (when on).
struct BlockExtras {
  absl::InlinedVector<StreamRef, 1> stream_uses;     // streams of the block's own device
  std::vector<ForeignStreamUse> foreign_uses;        // rare: no room taken until used
  TraceContext context;                              // gathered at its allocation
  TraceCategory category = TraceCategory::kUnknown;  // see DeviceAllocator::SetTraceCategory
  int32_t event_count = 0;                           // stream-use events still pending after a free
  // Set by DeviceAllocator::TagForRevival, unique per device, 0 when none: names this allocation,
  // so that its free, while pending, is taken back by its owner and by nobody else (Revive).
  // Cleared when the free completes or the allocation is taken back.
  uint64_t revive_tag = 0;
};

// A contiguous range of one segment. A segment starts as one block and is split and re-merged;
// `prev`/`next` link the blocks of a segment in address order. Every block of a segment belongs
// to the segment's allocation stream, named here by its slot in the device's StreamSlots.
struct alignas(32) Block {
  uintptr_t ptr = 0;
  size_t requested = 0;  // caller's size while allocated (or pending)
  uint32_t units = 0;    // size / kMinBlockSize
  BlockId prev = kNoBlock;
  BlockId next = kNoBlock;
  uint16_t stream = 0;  // StreamSlots slot of the allocation stream: the only one it is reused on
  PoolKind pool = PoolKind::kSmall;
  bool allocated : 1 = false;
  bool pending : 1 = false;     // freed, waiting for stream-use events (extras' event_count > 0)
  bool has_extras : 1 = false;  // the arena holds a BlockExtras for it (kept when recycled)

  size_t size() const { return size_t{units} * kMinBlockSize; }
  // Every block size is a multiple of kMinBlockSize below kMaxBlockSize (see BlockArena).
  void set_size(size_t bytes) { units = static_cast<uint32_t>(bytes / kMinBlockSize); }
  bool is_split() const { return prev != kNoBlock || next != kNoBlock; }
  bool is_free() const { return !allocated && !pending; }
};
static_assert(sizeof(Block) == 32, "two blocks per cache line: see the comment at the top");
// The largest block `units` can describe; kMaxRequest keeps every rounded request below it.
inline constexpr size_t kMaxBlockSize = size_t{UINT32_MAX} * kMinBlockSize;
static_assert(kMaxRequest + kRoundLarge <= kMaxBlockSize, "a rounded request must fit a Block");

// Key of a free block within one stream's tree. Ordered by (size, address) so that `lower_bound`
// finds the smallest block that fits, lowest address first among equals (PyTorch's order): best
// fit in O(log n), no pointer chasing in the comparator. The stream is not part of the key: each
// stream has its own tree. 16 bytes (the size in kMinBlockSize units, as in Block): 16 keys per
// 256-byte node, against 10 for 24-byte keys, so a tree of the same blocks is a level shallower
// and a third smaller, and that is the part of every free and malloc that misses in L1 once many
// blocks are free.
struct FreeKey {
  FreeKey(size_t bytes, uintptr_t address, BlockId id)
      : ptr(address), units(static_cast<uint32_t>(bytes / kMinBlockSize)), block(id) {}

  uintptr_t ptr;
  uint32_t units;  // every block size is a multiple of kMinBlockSize
  BlockId block;

  size_t size() const { return size_t{units} * kMinBlockSize; }

  friend bool operator<(const FreeKey& a, const FreeKey& b) {
    return a.units < b.units || (a.units == b.units && a.ptr < b.ptr);
  }
};
static_assert(sizeof(FreeKey) == 16);

// The free blocks of one pool, a best-fit tree per allocation stream, keyed by a number the
// caller picks for the stream (the allocator uses its StreamSlots slot).
class FreeIndex {
 public:
  void Insert(uint64_t stream, const FreeKey& key) { TreeFor(stream).Insert(key); }
  void Erase(uint64_t stream, const FreeKey& key) {
    if (Tree* tree = FindTree(stream)) tree->Erase(key);
  }
  // Removes and returns the smallest free block on `stream` with size >= `size`, if `accept`
  // takes its key; else kNoBlock and the index is unchanged. One tree descent for find and
  // erase. `accept` sees the key, not the block, so the block's cache miss can overlap the erase.
  template <typename Accept>
  BlockId TakeBestFit(uint64_t stream, size_t size, Accept accept) {
    Tree* tree = FindTree(stream);
    return tree != nullptr ? tree->TakeBestFit(size, accept) : kNoBlock;
  }
  size_t size() const {
    size_t n = 0;
    for (const auto& [stream, tree] : trees_) n += tree->size();
    return n;
  }
  // Size of the largest free block, 0 when there is none: the last key of each stream's tree.
  size_t LargestSize() const {
    size_t largest = 0;
    for (const auto& [stream, tree] : trees_) largest = std::max(largest, tree->LargestSize());
    return largest;
  }
  // Number of per-stream trees, empty ones included.
  size_t tree_count() const { return trees_.size(); }
  // Drops the trees of streams that have no free block, so that a program allocating on many
  // short-lived streams does not keep a tree per stream forever. Off the hot path (empty_cache).
  void PruneEmpty() {
    for (auto it = trees_.begin(); it != trees_.end();) {
      if (it->second->size() == 0) {
        trees_.erase(it++);
      } else {
        ++it;
      }
    }
    last_ = nullptr;
  }

 private:
  class Tree {
   public:
    // A permanent sentinel (size 0 fits no request) keeps the root node alive: without it, a
    // tree that empties and refills on every malloc/free pair (the common cached path) would
    // free and reallocate its root through the system heap each time.
    Tree() { set_.insert(FreeKey{0, 0, kNoBlock}); }

    void Insert(const FreeKey& key) {
      // A split's remainder and a merge's result usually belong right next to the place the last
      // erase left: try there first (O(1) when right, a normal insert when not).
      if (hint_valid_) {
        hint_valid_ = false;
        set_.insert(hint_, key);
        return;
      }
      set_.insert(key);
    }
    void Erase(const FreeKey& key) {
      const auto it = set_.find(key);
      hint_valid_ = it != set_.end();
      if (hint_valid_) hint_ = set_.erase(it);
    }
    template <typename Accept>
    BlockId TakeBestFit(size_t size, Accept accept) {
      // The smallest block of at least `size` bytes has at least this many units; from one unit
      // at least, so the sentinel (size 0) is never a candidate.
      const size_t units = std::max<size_t>((size + kMinBlockSize - 1) / kMinBlockSize, 1);
      if (units > UINT32_MAX) return kNoBlock;  // larger than any block can be
      auto it = set_.lower_bound(FreeKey(units * kMinBlockSize, 0, kNoBlock));
      if (it == set_.end() || !accept(*it)) return kNoBlock;
      const BlockId block = it->block;
      hint_ = set_.erase(it);
      hint_valid_ = true;
      return block;
    }
    size_t size() const { return set_.size() - 1; }
    // The sentinel (size 0) is first, so an empty tree answers 0.
    size_t LargestSize() const { return std::prev(set_.end())->size(); }

   private:
    absl::btree_set<FreeKey> set_;
    // Where the last erase left off; valid until the next insert (erases refresh it).
    absl::btree_set<FreeKey>::iterator hint_;
    bool hint_valid_ = false;
  };

  // Programs use a handful of streams, and consecutive calls almost always name the same one:
  // the last tree used is checked before the map. Trees are boxed so the cached pointer stays
  // valid while the map rehashes. Only an insert creates a tree; lookups of a stream that never
  // had a free block leave the index as it was.
  Tree* FindTree(uint64_t stream) {
    if (last_ != nullptr && stream == last_stream_) return last_;
    const auto it = trees_.find(stream);
    if (it == trees_.end()) return nullptr;
    last_stream_ = stream;
    last_ = it->second.get();
    return last_;
  }
  Tree& TreeFor(uint64_t stream) {
    if (Tree* tree = FindTree(stream)) return *tree;
    std::unique_ptr<Tree>& tree = trees_[stream];
    tree = std::make_unique<Tree>();
    last_stream_ = stream;
    last_ = tree.get();
    return *last_;
  }

  absl::flat_hash_map<uint64_t, std::unique_ptr<Tree>> trees_;
  uint64_t last_stream_ = 0;
  Tree* last_ = nullptr;
};

// Owns every Block of a device in one array indexed by BlockId, so reaching a block from its id
// is one load, and recycles ids so the hot path never touches the system heap. Extras live in
// a parallel array, read only for blocks whose `has_extras` is set.
//
// New() may grow the array and so move every block: hold no Block reference across it.
class BlockArena {
 public:
  // Id 0 is never handed out: it is kNoBlock.
  BlockArena() {
    Grow();
    free_.pop_back();
  }

  BlockId New() {
    if (free_.empty()) Grow();
    const BlockId id = free_.back();
    free_.pop_back();
    peak_in_use_ = std::max(peak_in_use_, blocks_.size() - free_.size());  // for Trim
    return id;
  }
  // Resets the block for reuse; its extras (if any) are emptied and stay attached to the id, so a
  // program that records streams or history allocates them once per id, not once per malloc.
  void Delete(BlockId id) {
    Block& b = blocks_[id];
    const bool has_extras = b.has_extras;
    if (has_extras) {
      BlockExtras& extras = *extras_[id];
      extras.stream_uses.clear();
      extras.foreign_uses.clear();
      extras.context.reset();
      extras.category = TraceCategory::kUnknown;
      extras.event_count = 0;
    }
    b = Block{};
    b.has_extras = has_extras;
    free_.push_back(id);
  }
  Block& operator[](BlockId id) { return blocks_[id]; }
  const Block& operator[](BlockId id) const { return blocks_[id]; }
  // Null unless the block has extras.
  const BlockExtras* extras(BlockId id) const {
    return blocks_[id].has_extras ? extras_[id].get() : nullptr;
  }
  BlockExtras& mutable_extras(BlockId id) {
    Block& b = blocks_[id];
    if (!b.has_extras) {
      extras_[id] = std::make_unique<BlockExtras>();
      b.has_extras = true;
    }
    return *extras_[id];
  }
  bool has_stream_uses(BlockId id) const {
    const BlockExtras* e = extras(id);
    return e != nullptr && (!e->stream_uses.empty() || !e->foreign_uses.empty());
  }
  // Host memory per id: the block, its extras pointer and its place in the free list.
  static constexpr size_t kBytesPerId = sizeof(Block) + sizeof(void*) + sizeof(BlockId);
  // Ids the arena holds room for (a power of two, at least kMinIds).
  size_t capacity() const { return blocks_.size(); }

  // Gives back the tail of the id space that no block uses any more, as after a burst of blocks
  // is gone (the allocator calls it from empty_cache). Ids in use keep their slots, so nothing
  // that names a block changes. Linear in the capacity. With hysteresis, as the address table's
  // ShrinkToFit: room stays for the most ids in use at once since the last call, so that a round
  // that repeats (a training step between empty_cache calls) does not regrow the arena, copy by
  // copy, every time; what a round no longer needs goes back at the call after it.
  void Trim() {
    std::vector<bool> is_free(blocks_.size(), false);
    for (const BlockId id : free_) is_free[id] = true;
    size_t used_end = 1;  // one past the highest id in use; id 0 (kNoBlock) always stays
    for (size_t id = blocks_.size() - 1; id > 0; --id) {
      if (!is_free[id]) {
        used_end = id + 1;
        break;
      }
    }
    const size_t target = std::max(kMinIds, std::bit_ceil(std::max(used_end, peak_in_use_)));
    peak_in_use_ = blocks_.size() - free_.size();
    if (target >= blocks_.size()) return;
    blocks_.resize(target);
    blocks_.shrink_to_fit();
    extras_.resize(target);
    extras_.shrink_to_fit();
    free_.clear();
    for (size_t id = target - 1; id > 0; --id) {
      if (is_free[id]) free_.push_back(static_cast<BlockId>(id));
    }
    free_.shrink_to_fit();
  }

 private:
  static constexpr size_t kMinIds = 256;
  // Doubling: a copy of every block now and then (amortized O(1) per New, like the address
  // table's rehash), in exchange for one load per id on every access.
  void Grow() {
    const size_t first = blocks_.size();
    const size_t grown = std::max(kMinIds, 2 * first);
    if (grown > UINT32_MAX) throw std::length_error("spillway: more than 2^32 blocks on a device");
    blocks_.resize(grown);
    extras_.resize(grown);
    for (size_t i = grown; i > first; --i) free_.push_back(static_cast<BlockId>(i - 1));
  }
  std::vector<Block> blocks_;
  std::vector<std::unique_ptr<BlockExtras>> extras_;
  std::vector<BlockId> free_;
  size_t peak_in_use_ = 0;  // the most ids in use at once since the last Trim (id 0 included)
};

}  // namespace spillway
