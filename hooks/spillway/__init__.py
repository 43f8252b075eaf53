"""Spillway: a storage-aware caching allocator for PyTorch that spills saved activations to
pinned host memory and brings them back before backward reads them.

    import spillway
    spillway.install()                      # before CUDA initializes ("sim" for the simulator)
    with spillway.offload("auto"):
        loss = model(batch).sum()
    loss.backward()

See README.md for configuration, snapshots and limitations.
"""

from ._api import (
    budget_bytes,
    empty_cache,
    install,
    installed,
    keepers,
    memory_stats,
    offload,
    pluggable_allocator,
    release,
    reset_peak_stats,
    residency,
    set_per_process_memory_fraction,
    spill_after,
    synchronize,
)
from ._history import (
    annotate_tensor,
    dump_snapshot,
    get_memory_metadata,
    record_history,
    set_memory_metadata,
    snapshot,
)

import importlib as _importlib
import sys as _sys

if "_spillway_autoload" in _sys.modules:  # an environment install that waited for this import
    _boot = _sys.modules["_spillway_autoload"]
    _boot._report(_boot.finish_pending)
else:
    # The start-up hook did not run (`python -s`, or a virtual environment without spillway.pth),
    # yet SPILLWAY_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF may ask for Spillway: run it now, so that
    # the script's own install() finds the same install as with the hook, not the variables
    # silently ignored. (It sits beside this package; it does nothing unless a variable asks.)
    try:
        _importlib.import_module("_spillway_autoload")  # imported for what it does
    except ImportError:
        pass

__all__ = [
    "annotate_tensor",
    "budget_bytes",
    "dump_snapshot",
    "empty_cache",
    "get_memory_metadata",
    "install",
    "installed",
    "keepers",
    "memory_stats",
    "offload",
    "pluggable_allocator",
    "record_history",
    "release",
    "reset_peak_stats",
    "residency",
    "set_memory_metadata",
    "set_per_process_memory_fraction",
    "snapshot",
    "spill_after",
    "synchronize",
]
