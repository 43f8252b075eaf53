// Memory snapshots in PyTorch's format (what torch.cuda.memory._snapshot() returns and
// pytorch.org/memory_viz reads), plus a "spillway" section the viewer ignores: per block its
// storage entry, residency and keepers; per entry its spill and reload history.
#pragma once

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <string>

namespace spillway::torch_layer {

pybind11::dict Snapshot();

// Mirrors torch.cuda.memory._record_memory_history: `stacks` is "python" (allocations carry the
// Python frames of the allocating code) or "none"; `free_context` (its context="all") gathers the
// frames at frees too; `pinned_host_memory` (its record_pinned_host_memory, torch 2.14) records the
// offload engine's pinned host pools as well, for the snapshot's host_segments and host_traces.
// As in torch, any call without it stops the host recording. While enabled, record_function
// ranges are recorded as the snapshot's external_annotations (on the calling thread's, or with
// `global_record_annotations` every thread's), and with `compile_context` the trace entries
// recorded inside Dynamo's compiled regions carry the region's name, as torch's
// _record_memory_history does for its allocator (its keywords).
void RecordHistory(bool enabled, size_t max_entries, const std::string& stacks, bool free_context,
                   bool pinned_host_memory, bool compile_context, bool global_record_annotations);

// torch.cuda.memory._set_memory_metadata / _get_memory_metadata for Spillway's allocator on any
// device: the calling thread's user metadata, which the trace entries it records carry.
void SetUserMetadata(const std::string& metadata);
std::string GetUserMetadata();

// torch.cuda.memory._annotate_tensor (torch 2.14) for Spillway's allocator on any device: an
// "annotate" trace entry for the allocation behind `tensor`'s storage (keyed by the address the
// storage starts at, so a view annotates its base), with `metadata` as its user_metadata, while
// history is recorded. A tensor on another device than Spillway's, or whose storage Spillway did
// not allocate, is an InvalidArgumentError; an empty or spilled storage has nothing to annotate.
void AnnotateTensor(const at::Tensor& tensor, const std::string& metadata);

}  // namespace spillway::torch_layer
