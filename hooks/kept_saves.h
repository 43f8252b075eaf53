// Saves the hooks keep as they are (a tensor subclass, a nested, quantized or sparse tensor, a
// second storage over Spillway's memory such as torch.from_numpy(t.numpy()) or DLPack): the engine
// does not track them, yet backward reads the device memory they hold. release(), keepers(),
// residency() and snapshots see them here. Each is registered by its own storage, and the
// Spillway block its data lies in is looked up when asked: a storage resized (resize_, an out=
// op, FSDP's resize to 0 and back) moves to another block, and its save with it; an alias's
// storage is not the block's own, but its data lies in that block.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "allocator/device_allocator.h"
#include "offload/engine.h"

namespace spillway::torch_layer {

struct KeptSave {
  // The save's own storage, alive while the registration is: the saved tensor holds it, and goes
  // only after the registration does (SavedHandle's and _Kept's member order).
  const c10::StorageImpl* storage = nullptr;
  ViewInfo view;        // the saved tensor's geometry on that storage
  bool nested = false;  // a nested tensor's save: `view` is its whole buffer, one dimension
};

class KeptSaves {
 public:
  static KeptSaves& Get();

  // Registers `tensor` when it has a storage on the device Spillway serves; returns 0 (and
  // registers nothing) otherwise, or when nothing is installed.
  uint64_t Add(const at::Tensor& tensor);
  void Remove(uint64_t token);
  // The saves whose data lies in `block` now.
  std::vector<KeptSave> On(const AllocationInfo& block) const;
  // The saves whose data lies in a Spillway block now, by block start.
  std::map<const void*, std::vector<KeptSave>> ByBlock() const;
  // Drops the saves whose data lies in `block`, freed by a forced release: the block may serve
  // another tensor next, which they do not hold.
  void Forget(const AllocationInfo& block);

 private:
  mutable std::mutex mutex_;
  uint64_t next_token_ = 1;
  absl::flat_hash_map<uint64_t, KeptSave> saves_;
};

// A registration that lasts as long as the object: what a kept save holds. A sparse save is
// registered by each of its components (indices and values): they hold its memory. A tensor with
// no memory of Spillway's to register (a wrapper subclass, whose data is in inner tensors) makes
// an empty one.
class KeptRegistration {
 public:
  KeptRegistration() = default;
  explicit KeptRegistration(const at::Tensor& tensor);
  ~KeptRegistration();
  KeptRegistration(const KeptRegistration&) = delete;
  KeptRegistration& operator=(const KeptRegistration&) = delete;
  // How many storages it registered.
  size_t size() const { return tokens_.size(); }

 private:
  absl::InlinedVector<uint64_t, 1> tokens_;
};

// How many of `kept` are saves on `storage` itself (each holds it once, through its tensor).
int64_t KeptOn(const c10::StorageImpl* storage, const std::vector<KeptSave>& kept);
// The holders of the storages of `kept` other than those saves (an alias's original storage, which
// the registry does not know, is not among them).
int64_t OtherHoldersOfKeptStorages(const std::vector<KeptSave>& kept);

// The live Spillway block a tensor's storage data lies in.
std::optional<AllocationInfo> SpillwayBlockOf(const at::Tensor& tensor);

}  // namespace spillway::torch_layer
