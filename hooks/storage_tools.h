// Who keeps a storage, and releasing one (DeepSpeed #8032: a padded base buffer with a
// true-shape view; clearing one tensor does not free a storage that views still hold).
#pragma once

#include <ATen/Tensor.h>
#include <pybind11/pybind11.h>

#include <vector>

#include "hooks/kept_saves.h"
#include "offload/engine.h"

namespace spillway::torch_layer {

// One dict per keeper of the tensor's storage: {"kind": "saved", "shape", "stride", "offset"}
// for each saved view Spillway registered, then {"kind": "external", "count": n} for the holders
// it does not know (n counts every tensor on the storage, including the one passed in).
pybind11::list Keepers(const at::Tensor& tensor);

// Frees the storage's device memory now, resizing the storage to 0 bytes, and returns
// {"freed_bytes", "other_holders", "keepers"}. Refuses (ValueError) when saved tensors still keep
// the storage for backward, unless `force`.
pybind11::dict Release(const at::Tensor& tensor, bool force);

// {"kind": "saved", "shape", "stride", "offset"} for each saved view of an engine entry.
pybind11::list SavedViewDicts(const EntryInfo& entry);

// The same for saves kept as they are (KeptSaves); a nested tensor's save is its whole buffer,
// one dimension, with "nested": True.
pybind11::list KeptSaveDicts(const std::vector<KeptSave>& kept);

// Reports of the latest release() calls (bounded), for snapshots and spillway.report.
pybind11::list ReleaseLog();

// "resident", "spilling", "spilled", "reloading", "failed", or None when not an engine entry.
pybind11::object ResidencyOf(const at::Tensor& tensor);

}  // namespace spillway::torch_layer
