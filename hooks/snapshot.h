// Memory snapshots in PyTorch's format (what torch.cuda.memory._snapshot() returns and
// pytorch.org/memory_viz reads), plus a "spillway" section the viewer ignores: per block its
// storage entry, residency and keepers; per entry its spill and reload history.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <string>

namespace spillway::torch_layer {

pybind11::dict Snapshot();

// Mirrors torch.cuda.memory._record_memory_history: `stacks` is "python" (allocations carry the
// Python frames of the allocating code) or "none"; `free_context` (its context="all") gathers the
// frames at frees too; `pinned_host_memory` (its record_pinned_host_memory, torch 2.14) records the
// offload engine's pinned host pools as well, for the snapshot's host_segments and host_traces.
// As in torch, any call without it stops the host recording.
void RecordHistory(bool enabled, size_t max_entries, const std::string& stacks, bool free_context,
                   bool pinned_host_memory);

}  // namespace spillway::torch_layer
