"""The allocator's history and snapshots in PyTorch's format: record_history, the labels trace
entries carry (user metadata, annotations of live allocations), snapshot and dump_snapshot.
Argument checks happen here, the work in `spillway._C`."""

import numbers
import os

from . import _C
from ._api import _check_bool, _check_tensor, _require_installed

# The bound of the configuration key history_entries (allocator/config.cc): the history ring of
# each device grows as events come, up to max_entries of them.
_MAX_HISTORY_ENTRIES = 10_000_000


def record_history(enabled=True, context="all", stacks="python", max_entries=None, *,
                   record_pinned_host_memory=False, compile_context=False,
                   global_record_annotations=False):
    """Records allocator events, like torch.cuda.memory._record_memory_history, whose argument
    order it keeps. `enabled` is a bool, or as torch 2.x spells it "all" (record) or None (stop;
    as in torch, stopping also clears the history: take the snapshot first).
    context: which events carry frames: "all" (allocations and frees), "alloc" or "state"
    (allocations only; a live block keeps its allocation's frames either way), None (none).
    stacks="python" attaches the Python frames (on threads that hold the GIL); "none" records
    none. max_entries bounds the history ring (oldest events go first); None: the
    history_entries key (default 100000).
    record_pinned_host_memory=True (torch 2.14's keyword) also records the offload engine's
    pinned host memory, which snapshot() then shows in host_segments and host_traces, as torch
    shows its pinned host allocator's (with no frames: the pool is used inside the engine). As in
    torch, a call without it stops that recording.
    While recording, torch.autograd.profiler.record_function ranges show in snapshot()'s
    external_annotations ({"name", "stage": "START" or "END", "device", "time_us"}), as torch's
    _record_memory_history records them: those of the calling thread, or of every thread with
    global_record_annotations=True. compile_context=True makes the trace entries recorded inside
    a torch.compile'd region carry its name ("Torch-Compiled Region: 0/0") as compile_context;
    set_memory_metadata() labels them too. (Under the c10 adapter, torch's own
    _record_memory_history does the same for Spillway: use one or the other, not both, or each
    range is annotated twice.)"""
    if isinstance(enabled, str) and enabled == "state":
        raise ValueError("enabled='state' (frames of live blocks without an event history) is not "
                         "supported: Spillway records the history with its frames; pass 'all' or "
                         "True, None or False to stop")
    if enabled is None or isinstance(enabled, str):
        if enabled not in (None, "all"):
            raise ValueError(f"enabled must be True, False, 'all' or None, got {enabled!r}")
        enabled = enabled == "all"
    else:
        try:
            enabled = _check_bool("enabled", enabled)
        except ValueError:
            raise ValueError(f"enabled must be True, False, 'all' or None, got {enabled!r}") \
                from None
    if stacks == "all":
        raise ValueError("stacks='all' (Python and C++ frames) is not supported: Spillway records "
                         "Python frames only; pass 'python' or 'none'")
    if stacks not in ("python", "none", None):
        raise ValueError(f"stacks must be 'python' or 'none', got {stacks!r}")
    if context not in ("all", "alloc", "state", None):
        raise ValueError(f"context must be 'all', 'alloc', 'state' or None, got {context!r}")
    if max_entries is not None and (
            isinstance(max_entries, bool) or not isinstance(max_entries, numbers.Integral)
            or not 1 <= max_entries <= _MAX_HISTORY_ENTRIES):
        raise ValueError(
            f"max_entries must be a positive int number of entries, at most "
            f"{_MAX_HISTORY_ENTRIES} (as for the history_entries key), or None for that key's "
            f"value, got {max_entries!r}")
    record_pinned_host_memory = _check_bool("record_pinned_host_memory",
                                            record_pinned_host_memory)
    compile_context = _check_bool("compile_context", compile_context)
    global_record_annotations = _check_bool("global_record_annotations",
                                            global_record_annotations)
    _require_installed("record_history")
    # 0 asks the allocator for its configured history_entries.
    frames = "none" if context is None else stacks or "none"
    _C.record_history(enabled, 0 if max_entries is None else int(max_entries), frames,
                      context == "all", record_pinned_host_memory, compile_context,
                      global_record_annotations)


def set_memory_metadata(metadata):
    """Labels the allocator events this thread records from now on, as
    torch.cuda.memory._set_memory_metadata does (and, under the c10 adapter, that function does
    the same for Spillway): snapshot()'s trace entries carry the string as user_metadata; "" stops.
    Per thread; kept whether or not history is recorded. On an entry that also has Spillway's note
    (a saved, spilled or reloaded allocation) user_metadata is this string, a newline, then the
    note, which starts with "spillway: "."""
    if not isinstance(metadata, str):
        raise ValueError(f"metadata must be a str, got {metadata!r}")
    _require_installed("set_memory_metadata")
    _C.set_memory_metadata(metadata)


def get_memory_metadata():
    """The string set_memory_metadata() last set on this thread ("" if none), as
    torch.cuda.memory._get_memory_metadata."""
    _require_installed("get_memory_metadata")
    return _C.get_memory_metadata()


def annotate_tensor(tensor, metadata):
    """Attaches `metadata` to the allocation behind `tensor`, after the fact, as torch 2.14's
    torch.cuda.memory._annotate_tensor does (and, under the c10 adapter with torch 2.14 or newer,
    that function does the same for Spillway): while record_history() records, snapshot()'s
    device_traces get an "annotate" entry with the allocation's address and size, the frames of
    this call, and `metadata` as its user_metadata; nothing otherwise. The allocation is the one
    the tensor's storage starts at, so a view annotates its base. Works on the simulated device
    too. A tensor whose storage Spillway did not allocate raises ValueError; one with no memory
    (empty, or spilled to host) has nothing to annotate."""
    _check_tensor("annotate_tensor", tensor)
    if not isinstance(metadata, str):
        raise ValueError(f"metadata must be a str, got {metadata!r}")
    _require_installed("annotate_tensor")
    _C.annotate_tensor(tensor, metadata)


def snapshot():
    """PyTorch's snapshot format (segments, device_traces, allocator_settings, and torch 2.14's
    host_segments and host_traces: see record_history) plus a "spillway" section: per block its
    storage entry, residency and keepers; per entry its spill and reload history."""
    _require_installed("snapshot")
    return _C.snapshot()


def dump_snapshot(path):
    """Pickles snapshot() to `path` (protocol 4: pytorch.org/memory_viz reads no newer)."""
    import pickle

    if not isinstance(path, (str, os.PathLike)):
        # open() would take an int as a file descriptor and write there.
        raise ValueError(f"path must be a str or os.PathLike, got {path!r}")
    data = snapshot()
    with open(path, "wb") as f:
        pickle.dump(data, f, protocol=4)
    return path
