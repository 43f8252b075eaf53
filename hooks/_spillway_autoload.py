"""Spillway's start-up hook (run by spillway.pth; a top-level module, so that it can run before
torch is importable without importing the `spillway` package): loads Spillway from the
environment, so existing training scripts run unchanged:

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
    data = text.encode()  # sized in bytes: a non-ASCII character takes more than one
    size = len(data) + 1
    ours = ctypes.create_string_buffer(size)
    theirs = ctypes.create_string_buffer(size)
    rc = lib.spillway_split_config(data, ours, size, theirs, size)
    if rc == -1:
        raise ValueError(lib.spillway_last_error().decode(errors="replace"))
    if rc != 0:  # not the user's doing: neither half can be longer than the whole
        raise RuntimeError(f"spillway_split_config returned {rc} for {text!r}")
    return ours.value.decode(), theirs.value.decode()


def _items(text):
    # Item-level split on top-level commas (lists in brackets stay whole).
    items, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    items.append(current)
    return [i.strip() for i in items]


def _honoured_items(pytorch_items):
    return [i for i in _items(pytorch_items) if i.split(":", 1)[0].strip() in _HONOURED]


def _warn_conflicts(sources):
    """Warns of a key given different values by two items: the later one wins (the merged string
    is parsed in order), which the user should not have to find out."""
    seen = {}
    for var, item in sources:
        key, _, value = (part.strip() for part in item.partition(":"))
        if key in seen and seen[key][1].lower() != value.lower():
            first_var, first_value = seen[key]
            print(f"spillway: {key} is given twice, {key}:{first_value} in {first_var} and "
                  f"{key}:{value} in {var}; using {key}:{value}", file=sys.stderr)
        seen[key] = (var, value)


# PyTorch's keys that choose or shape PyTorch's own CUDA allocator, which Spillway replaces on
# device:cuda: kept in the variable (they are PyTorch's to judge), but serving nothing.
_REPLACED = {
    "backend": "chooses PyTorch's own CUDA allocator",
    "expandable_segments": "shapes PyTorch's own CUDA allocator (Spillway has no expandable "
                           "segments)",
}


def _replaced_items(environ):
    """Warnings for the items of PyTorch's variables that Spillway on CUDA makes moot."""
    warnings = []
    for var in _PYTORCH_VARS:
        for item in _items(environ.get(var) or ""):
            key, _, value = (part.strip() for part in item.partition(":"))
            if key in _REPLACED and not (key == "expandable_segments" and value == "False"):
                warnings.append(f"spillway: {item} in {var} {_REPLACED[key]}, which Spillway "
                                f"replaces on CUDA: it has no effect")
    return warnings


def _without_ours(lib, text):
    """`text` less every item Spillway's split would take, those with a bad value included (the
    whole-string split refuses those, and PyTorch would reject them all the same)."""
    kept = []
    for item in _items(text):
        try:
            ours, _ = _split(lib, item)
        except ValueError:
            ours = item
        if item and not ours:
            kept.append(item)
    return ",".join(kept)


def _set_or_unset(var, value):
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value


_pending = None  # the configuration string to install once torch is importable
# (variable, item) of every item the merged string takes, in its order: for _warn_conflicts.
_sources = []
# (variable, item) pairs of honoured PyTorch keys from variables that do not name Spillway.
_borrowed = []
# SPILLWAY_ALLOC_CONF as the user set it (None: unset), put back if the install fails.
_user_conf = None


def _run():
    global _pending, _user_conf, _borrowed, _sources
    # Set but empty (or blank) is the same as unset: no request, so no attempt at device=cuda.
    wanted = os.environ.get("SPILLWAY_ALLOC_CONF", "").strip() != "" or any(
        "spillway" in os.environ.get(v, "") for v in _PYTORCH_VARS)
    if not wanted:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    lib = ctypes.CDLL(os.path.join(here, "spillway", "libspillway_alloc.so"))
    lib.spillway_last_error.restype = ctypes.c_char_p
    # (variable, item) of every item the merged string takes, in the order read: the variables in
    # _PYTORCH_VARS's order, then SPILLWAY_ALLOC_CONF; the last value of a key wins.
    sources = []
    _borrowed = []
    for var in _PYTORCH_VARS:
        value = os.environ.get(var)
        if not value:
            continue
        try:
            ours, theirs = _split(lib, value)
        except ValueError:
            # A bad value of a Spillway key: Spillway is not loaded, and PyTorch must not see
            # Spillway's keys either (it rejects every one, backend:spillway included).
            _set_or_unset(var, _without_ours(lib, value) or None)
            raise
        if ours:
            if theirs:
                os.environ[var] = theirs
            else:
                del os.environ[var]
            sources.extend((var, item) for item in _items(ours) + _honoured_items(theirs))
        else:
            # PyTorch's keys that Spillway honours count even from a variable that does not name
            # Spillway (on CUDA PyTorch's own allocator, which would have read them, serves
            # nothing); but one Spillway's stricter parser refuses is skipped with a warning
            # rather than keep Spillway from loading (finish_pending).
            borrowed = [(var, item) for item in _honoured_items(theirs)]
            _borrowed.extend(borrowed)
            sources.extend(borrowed)
    _user_conf = os.environ.get("SPILLWAY_ALLOC_CONF")
    own = (_user_conf or "").strip()
    conf = ",".join([item for _, item in sources if item] + ([own] if own else []))
    sources.extend(("SPILLWAY_ALLOC_CONF", item) for item in _items(own) if own)
    _sources = sources  # warned of once the borrowed items are checked (finish_pending)
    # The process allocator of libspillway_alloc.so reads SPILLWAY_ALLOC_CONF on first use: give
    # it the merged string, so every entry point sees the same configuration. If the install
    # fails, finish_pending puts the user's value back. The Spillway keys taken out of
    # PYTORCH_*_ALLOC_CONF stay out even then: PyTorch rejects every one of them (an unknown key,
    # or "Unknown allocator backend" for backend:spillway), and only PyTorch's keys remain there.
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

    ignored = []
    for var, item in _borrowed:
        try:
            _C.describe_config(item)
        except ValueError as error:
            print(f"spillway: ignoring {item!r} of {var}: {error}", file=sys.stderr)
            conf = ",".join(i for i in _items(conf) if i != item)
            os.environ["SPILLWAY_ALLOC_CONF"] = conf
            ignored.append((var, item))
    _warn_conflicts([source for source in _sources if source not in ignored])

    try:
        info = _C.describe_config(conf)
        spillway.install(device=info["device"], conf=conf)
    except Exception:
        # Not loaded: the process runs on PyTorch's allocator, and child processes inherit
        # SPILLWAY_ALLOC_CONF as the user set it, not the merged string.
        _set_or_unset("SPILLWAY_ALLOC_CONF", _user_conf)
        raise
    if info["device"] == "cuda":
        for warning in _replaced_items(os.environ):
            print(warning, file=sys.stderr)
    # "off" too: it registers saved tensors (keepers() sees them) and never spills.
    if info["offload"] is not None:
        _C.configure_offload(info["offload"], info["budget_bytes"], info["budget_fraction"],
                             info["min_bytes"], info["prefetch_bytes"])
        import torch

        # The process-wide (non-context) form of saved_tensors_hooks: scripts need no change.
        torch._C._autograd._push_saved_tensors_default_hooks(spillway._api._pack,
                                                             spillway._api._unpack)
        spillway._api._process_wide_saves = (info["offload"] == "off", info["min_bytes"])
        spillway._api._process_wide_config = spillway._C.offload_config()


def _report(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - a start-up hook must never take the process down
        print(f"spillway: not loaded from the environment: {error}", file=sys.stderr)


_report(_run)
