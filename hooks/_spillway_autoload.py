"""Spillway's start-up hook (run by spillway.pth; a top-level module, so that it can run before
torch is importable without importing the `spillway` package): loads Spillway from the environment, so existing training
scripts run unchanged:

    PYTORCH_CUDA_ALLOC_CONF=backend:spillway,offload:auto python train.py
    SPILLWAY_ALLOC_CONF=offload:auto python train.py
    SPILLWAY_ALLOC_CONF=device:sim,capacity_mb:2048,offload:auto python train.py

It does nothing unless one of these variables asks for Spillway. When one does, it takes
Spillway's keys out of PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF before torch reads them
(PyTorch rejects keys it does not know), keeps PyTorch's own keys there (Spillway honours
max_split_size_mb, roundup_power2_divisions and garbage_collection_threshold too), installs
Spillway and, when the configuration names an offload policy, turns offload on for the process.
Errors are reported on stderr and leave the process on PyTorch's own allocator.
"""

import ctypes
import os
import sys

_PYTORCH_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_HONOURED = ("max_split_size_mb", "roundup_power2_divisions", "garbage_collection_threshold")


def _split(lib, text):
    """(spillway items, pytorch items) of `text`, split by Spillway's own parser."""
    size = len(text) + 1
    ours = ctypes.create_string_buffer(size)
    theirs = ctypes.create_string_buffer(size)
    rc = lib.spillway_split_config(text.encode(), ours, size, theirs, size)
    if rc != 0:
        raise ValueError(lib.spillway_last_error().decode())
    return ours.value.decode(), theirs.value.decode()


def _honoured_items(pytorch_items):
    # Item-level split on top-level commas (lists in brackets stay whole).
    items, depth, current = [], 0, ""
    for ch in pytorch_items:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    items.append(current)
    return [i.strip() for i in items if i.split(":", 1)[0].strip() in _HONOURED]


_pending = None  # the configuration string to install once torch is importable


def _run():
    global _pending
    wanted = "SPILLWAY_ALLOC_CONF" in os.environ or any(
        "spillway" in os.environ.get(v, "") for v in _PYTORCH_VARS)
    if not wanted:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    lib = ctypes.CDLL(os.path.join(here, "spillway", "libspillway_alloc.so"))
    lib.spillway_last_error.restype = ctypes.c_char_p
    parts = []
    for var in _PYTORCH_VARS:
        value = os.environ.get(var)
        if not value:
            continue
        ours, theirs = _split(lib, value)
        if not ours:
            continue
        if theirs:
            os.environ[var] = theirs
        else:
            del os.environ[var]
        parts.append(ours)
        parts.extend(_honoured_items(theirs))
    own = os.environ.get("SPILLWAY_ALLOC_CONF", "")
    if own:
        parts.append(own)
    conf = ",".join(p for p in parts if p)
    # The process allocator of libspillway_alloc.so reads SPILLWAY_ALLOC_CONF on first use: give
    # it the merged string, so every entry point sees the same configuration.
    os.environ["SPILLWAY_ALLOC_CONF"] = conf
    _pending = conf
    if "torch" in sys.modules:
        finish_pending()
    else:
        # .pth files run before the system site-packages (where torch may live) are on sys.path,
        # and a script that never imports torch should not pay for it: install right after the
        # script's own `import torch`.
        sys.meta_path.insert(0, _AfterTorchImport())


class _AfterTorchImport:
    """Meta-path finder that runs finish_pending() once the torch module has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            package = sys.modules.get("spillway")
            if package is not None and not hasattr(package, "install"):
                return  # spillway itself is importing torch: its __init__ finishes the job
            _report(finish_pending)

        spec.loader.exec_module = exec_then_install
        return spec


def finish_pending():
    """Installs what the environment asked for (once); called after torch is importable."""
    global _pending
    if _pending is None:
        return
    conf, _pending = _pending, None
    import spillway
    from spillway import _C

    info = _C.describe_config(conf)
    spillway.install(device=info["device"], conf=conf)
    if info["offload"] is not None and info["offload"] != "off":
        _C.configure_offload(info["offload"], info["budget_bytes"], info["budget_fraction"],
                             info["min_bytes"], info["prefetch_bytes"])
        import torch

        # The process-wide (non-context) form of saved_tensors_hooks: scripts need no change.
        torch._C._autograd._push_saved_tensors_default_hooks(spillway._api._pack,
                                                             spillway._api._unpack)


def _report(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - a start-up hook must never take the process down
        print(f"spillway: not loaded from the environment: {error}", file=sys.stderr)


_report(_run)
