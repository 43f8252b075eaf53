// The saved-tensor hooks: pack registers a saved tensor as a keeper of its storage's engine entry;
// unpack makes the storage resident and rebuilds the exact view on that same storage.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hooks/kept_saves.h"
#include "offload/engine.h"

namespace spillway::torch_layer {

// What pack returns. Either a managed keeper (the engine owns the storage's residency) or the
// tensor as it was (anything Spillway does not offload: the reason was counted as skipped), kept
// detached: the saved output of an op holds its grad_fn, which holds this handle, and that loop
// runs through autograd's C++ nodes, where Python's collector cannot break it (PyTorch saves
// outputs without their grad_fn for the same reason). Autograd rebuilds the grad_fn at unpack.
class SavedHandle {
 public:
  explicit SavedHandle(const at::Tensor& kept);
  SavedHandle(KeeperId id, const at::Tensor& t);
  ~SavedHandle();
  SavedHandle(const SavedHandle&) = delete;
  SavedHandle& operator=(const SavedHandle&) = delete;

  bool managed() const { return id_ != 0; }
  KeeperId id() const { return id_; }
  at::Tensor Unpack() const;
  std::string Describe() const;  // "float32[8, 16]" for messages

 private:
  void CheckVersion() const;
  // The saved view (sizes, strides, offset, dtype, conj and neg bits) over `storage`.
  at::Tensor ViewOn(const c10::Storage& storage) const;

  at::Tensor kept_;
  // A kept tensor over Spillway's memory: release() and keepers() must see it.
  KeptRegistration kept_registration_;
  KeeperId id_ = 0;
  std::vector<int64_t> sizes_;
  std::vector<int64_t> strides_;
  int64_t offset_ = 0;
  at::TensorOptions options_;
  bool conj_ = false;
  bool neg_ = false;
  // With hooks installed, autograd does not compare versions itself: the handle does, so an
  // in-place change of a saved tensor (managed or kept) still raises autograd's usual error.
  c10::VariableVersion version_counter_{c10::VariableVersion::DISABLED};
  uint32_t saved_version_ = 0;
};

// pack_hook / unpack_hook bodies. `Pack` counts why a tensor is kept as it is; `settings` are
// those of the offload block the save was made in (without them, the engine's configuration).
std::shared_ptr<SavedHandle> Pack(const at::Tensor& tensor,
                                  std::optional<SaveSettings> settings = std::nullopt);
at::Tensor Unpack(const SavedHandle& handle);
// Phase signal: the offload context manager's exit.
void ForwardEnd();

}  // namespace spillway::torch_layer
