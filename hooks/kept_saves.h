// Saves the hooks keep as they are (a tensor subclass, a nested or quantized tensor, a second
// storage over Spillway's memory such as torch.from_numpy(t.numpy()) or DLPack): the engine does
// not track them, yet backward reads the device memory they hold. release(), keepers(),
// residency() and snapshots see them here, by the Spillway block their data lies in (an alias's
// storage is not the block's own).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "offload/engine.h"

namespace spillway::torch_layer {

struct KeptSave {
  const void* block = nullptr;                // start of the Spillway block holding the data
  const c10::StorageImpl* storage = nullptr;  // the save's own storage (an alias has its own)
  ViewInfo view;                              // the saved tensor's geometry on that storage
};

class KeptSaves {
 public:
  static KeptSaves& Get();

  // Registers `tensor` when its data lies in a live Spillway block; returns 0 (and registers
  // nothing) otherwise. Nothing may be installed: then nothing is Spillway's.
  uint64_t Add(const at::Tensor& tensor);
  void Remove(uint64_t token);
  // Drops the saves kept on `block`, freed by a forced release: the block may serve another
  // tensor next, which they do not hold.
  void Forget(const void* block);
  // The saves kept on `block` (the start of a Spillway block).
  std::vector<KeptSave> On(const void* block) const;
  // Every block that kept saves hold.
  std::vector<const void*> Blocks() const;

 private:
  mutable std::mutex mutex_;
  uint64_t next_token_ = 1;
  // Block -> token -> save, and each token's block.
  absl::flat_hash_map<const void*, absl::flat_hash_map<uint64_t, KeptSave>> by_block_;
  absl::flat_hash_map<uint64_t, const void*> block_of_;
};

// A registration that lasts as long as the object: what a kept save holds.
class KeptRegistration {
 public:
  KeptRegistration() = default;
  explicit KeptRegistration(const at::Tensor& tensor) : token_(KeptSaves::Get().Add(tensor)) {}
  ~KeptRegistration() {
    if (token_ != 0) KeptSaves::Get().Remove(token_);
  }
  KeptRegistration(const KeptRegistration&) = delete;
  KeptRegistration& operator=(const KeptRegistration&) = delete;

 private:
  uint64_t token_ = 0;
};

// The block (start) a tensor's storage data lies in, when it is a live Spillway block.
std::optional<const void*> SpillwayBlockOf(const at::Tensor& tensor);

}  // namespace spillway::torch_layer
