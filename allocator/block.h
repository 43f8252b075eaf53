// Blocks, the free-block index and the arena blocks live in. Internal to the allocator.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <vector>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "allocator/backend.h"
#include "allocator/history.h"
#include "allocator/size_policy.h"

namespace spillway {

// What only some blocks need: streams recorded by record_stream and the trace context gathered
// when history is on. Kept out of line so that the fields every malloc and free touch fit in one
// cache line (with 100k live blocks the working set leaves the caches, and every line counts).
struct BlockExtras {
  absl::InlinedVector<StreamRef, 1> stream_uses;
  TraceContext context;
};

// A contiguous range of one segment. A segment starts as one block and is split and re-merged;
// `prev`/`next` link the blocks of a segment in address order. Every block of a segment belongs
// to the segment's allocation stream, so only its id is kept here (the handle is the segment's).
struct alignas(64) Block {
  uintptr_t ptr = 0;
  size_t size = 0;
  size_t requested = 0;  // caller's size while allocated
  uint64_t stream = 0;   // StreamRef::id of the allocation stream: the only stream it is reused on
  Block* prev = nullptr;
  Block* next = nullptr;
  // Created on first use and kept while the Block object is recycled, so a program that records
  // streams or history allocates these once per Block object, not once per malloc.
  std::unique_ptr<BlockExtras> extras;
  int32_t event_count = 0;  // stream-use events still pending after a free
  PoolKind pool = PoolKind::kSmall;
  bool allocated = false;

  bool is_split() const { return prev != nullptr || next != nullptr; }
  bool is_free() const { return !allocated && event_count == 0; }
  bool has_stream_uses() const { return extras != nullptr && !extras->stream_uses.empty(); }
  BlockExtras& mutable_extras() {
    if (extras == nullptr) extras = std::make_unique<BlockExtras>();
    return *extras;
  }
  const TraceContext* context() const { return extras != nullptr ? &extras->context : nullptr; }
};
static_assert(sizeof(Block) == 64, "Block's hot fields must fit one cache line");

// Key of a free block within one stream's tree. Ordered by (size, address) so that `lower_bound`
// finds the smallest block that fits, lowest address first among equals (PyTorch's order): best
// fit in O(log n), no pointer chasing in the comparator. The stream is not part of the key: each
// stream has its own tree, which keeps keys at 24 bytes (10 per 256-byte node, not 7) and makes
// every comparison two fields, not three.
struct FreeKey {
  size_t size;
  uintptr_t ptr;
  Block* block;

  friend bool operator<(const FreeKey& a, const FreeKey& b) {
    return a.size < b.size || (a.size == b.size && a.ptr < b.ptr);
  }
};

// The free blocks of one pool, a best-fit tree per allocation stream.
class FreeIndex {
 public:
  void Insert(Block* b) { TreeFor(b->stream).Insert(FreeKey{b->size, b->ptr, b}); }
  void Erase(const Block* b) {
    if (Tree* tree = FindTree(b->stream)) tree->Erase(FreeKey{b->size, b->ptr, nullptr});
  }
  // Removes and returns the smallest free block on `stream` with size >= `size`, if `accept`
  // takes its key; else null and the index is unchanged. One tree descent for find and erase.
  // `accept` sees the key, not the block, so the block's cache miss can overlap the erase.
  template <typename Accept>
  Block* TakeBestFit(uint64_t stream, size_t size, Accept accept) {
    Tree* tree = FindTree(stream);
    return tree != nullptr ? tree->TakeBestFit(size, accept) : nullptr;
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
    Tree() { set_.insert(FreeKey{0, 0, nullptr}); }

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
    Block* TakeBestFit(size_t size, Accept accept) {
      // From size 1 at least: the sentinel (size 0) is never a candidate.
      auto it = set_.lower_bound(FreeKey{std::max<size_t>(size, 1), 0, nullptr});
      if (it == set_.end() || !accept(*it)) return nullptr;
      Block* block = it->block;
      hint_ = set_.erase(it);
      hint_valid_ = true;
      return block;
    }
    size_t size() const { return set_.size() - 1; }
    // The sentinel (size 0) is first, so an empty tree answers 0.
    size_t LargestSize() const { return std::prev(set_.end())->size; }

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

// Recycles Block objects in chunks so the hot path never touches the system heap.
class BlockArena {
 public:
  Block* New() {
    if (free_.empty()) Grow();
    Block* b = free_.back();
    free_.pop_back();
    return b;
  }
  void Delete(Block* b) {
    std::unique_ptr<BlockExtras> extras = std::move(b->extras);
    if (extras != nullptr) {
      extras->stream_uses.clear();
      extras->context.reset();
    }
    *b = Block{};
    b->extras = std::move(extras);
    free_.push_back(b);
  }

 private:
  static constexpr size_t kChunk = 256;
  void Grow() {
    chunks_.push_back(std::make_unique<Block[]>(kChunk));
    Block* chunk = chunks_.back().get();
    for (size_t i = kChunk; i > 0; --i) free_.push_back(&chunk[i - 1]);
  }
  std::vector<std::unique_ptr<Block[]>> chunks_;
  std::vector<Block*> free_;
};

}  // namespace spillway
