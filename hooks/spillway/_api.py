"""The public functions of `spillway`; argument checks happen here, the work in `spillway._C`."""

import contextlib
import numbers
import os
import threading

import torch

from . import _C

_LIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libspillway_alloc.so")
_POLICIES = ("off", "eager", "auto")
_lock = threading.Lock()
_INT64_MAX = (1 << 63) - 1


def _check_bytes(name, value, allow_none=True, positive=False):
    """`value` as a Python int (numpy's integers too), or None when allowed."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int number of bytes, got {value!r}")
    value = int(value)
    if value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"{name} must be a {kind} number of bytes, got {value}")
    if value > _INT64_MAX:
        # The C++ layer takes 64-bit sizes; past that pybind11 answers only "incompatible
        # function arguments".
        raise ValueError(f"{name} must be at most 2**63 - 1 bytes, got {value}")
    return value


def _check_bool(name, value):
    """`value` as a bool: Python's bool, numpy's, or a one-element torch bool tensor. Anything
    else (a string such as "no" is truthy) is refused rather than read by its truth value."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"):
        return bool(value)
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.numel() == 1:
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def install(device=None, conf=None, capacity_bytes=None):
    """Makes Spillway serve PyTorch's allocations on `device`.

    device: "cuda" (or torch.device("cuda")) installs Spillway as PyTorch's CUDA allocator, for
        every CUDA device (must run before CUDA initializes); "sim" installs the simulated device
        (host memory with a capacity) as PyTorch's CPU allocator, so CPU tensors created
        afterwards live in it. Default: the configuration's `device` key, else "cuda".
    conf: a `key:value,...` string (the grammar of PYTORCH_CUDA_ALLOC_CONF); see README.
    capacity_bytes: simulated device capacity (a multiple of 1 MiB; default 1 GiB).

    One install per process. Installing again is a no-op when everything the call names is what
    the install in force has (keys it leaves out are no request for their defaults, so a script's
    install("sim") under SPILLWAY_ALLOC_CONF=device:sim,... is one); anything else raises.
    """
    if conf is not None and not isinstance(conf, str):
        raise ValueError(f"conf must be a string like 'offload:auto,prefetch_mb:256', got {conf!r}")
    if device is None:
        # The install in force (a repeat names nothing new), else the configuration's key.
        device = _C.installed_mode() or _C.describe_config(conf or "")["device"]
    if isinstance(device, torch.device) and device.type == "cuda" and device.index is None:
        device = "cuda"  # torch.device("cuda"), as torch's own calls take it
    if device not in ("cuda", "sim"):
        raise ValueError(f"device must be 'cuda' or 'sim' (Spillway serves every CUDA device: no "
                         f"index), got {device!r}")
    capacity_bytes = _check_bytes("capacity_bytes", capacity_bytes, positive=True)
    if capacity_bytes is not None and device != "sim":
        # Before the CUDA checks below, which would name another problem.
        raise ValueError("capacity_bytes applies to device='sim' only")
    # The C++ install checks the rest: whole MiB, and no conflict with a capacity_mb key.
    text = conf or ""
    capacity = capacity_bytes or 0
    with _lock:
        if device == "cuda":
            mode = _C.installed_mode()
            if mode == "":
                # The configuration first: its problems are the ones to report, not CUDA's.
                if _C.describe_config(text)["device"] != "cuda":
                    raise ValueError(f"spillway.install(device='cuda') conflicts with the "
                                     f"configuration's device key in {text!r}")
                if torch.version.cuda is None or not torch.cuda.is_available():
                    raise RuntimeError(
                        "spillway.install(device='cuda'): this torch has no usable CUDA "
                        f"(torch {torch.__version__}, CUDA {torch.version.cuda}); use device='sim'")
                if torch.cuda.is_initialized():
                    raise RuntimeError(
                        "spillway.install(device='cuda') must run before CUDA initializes: call "
                        "it before creating any CUDA tensor")
                # Checked before the runtime installs: after that, a failure here would leave it
                # in CUDA mode with PyTorch's own allocator serving everything.
                if not _C.has_cuda_allocator() and not hasattr(torch.cuda.memory,
                                                               "CUDAPluggableAllocator"):
                    raise RuntimeError(
                        "spillway.install(device='cuda'): this build has no c10 allocator adapter "
                        f"and torch {torch.__version__} has no CUDAPluggableAllocator; build "
                        "Spillway against a CUDA torch 2.4 or later")
            _C.install("cuda", text, capacity)
            if mode == "":
                try:
                    if _C.has_cuda_allocator():
                        # The c10 adapter: torch.cuda.memory_stats, _snapshot and friends work.
                        _C.install_cuda_allocator()
                    else:
                        # Built without a CUDA torch >= 2.4: the C ABI route (no torch-side
                        # stats).
                        torch.cuda.memory.change_current_allocator(pluggable_allocator())
                except BaseException:
                    # Nothing went through Spillway yet: undone, installed() says None and a
                    # retry checks everything again (it returned silently, installed in name).
                    try:
                        _C.abandon_cuda_install()
                    except Exception:  # noqa: BLE001 - used meanwhile: the route's error matters
                        pass
                    raise
        else:
            _C.install("sim", text, capacity)


def installed():
    """'cuda', 'sim', or None."""
    return _C.installed_mode() or None


def _require_installed(what):
    if not _C.installed_mode():
        raise RuntimeError(f"spillway.{what}: call spillway.install() first")


class _Kept:
    """A saved tensor Spillway keeps as it is (a subclass), as the C++ handle keeps the others:
    detached, since a saved output holds its grad_fn, which holds what pack returned, a loop
    through autograd's C++ nodes that Python's collector cannot break; with its version, since
    autograd leaves that check to the hooks; and registered, so that release(), keepers(),
    residency() and snapshots see the save, as they see the C++ handle's."""

    __slots__ = ("tensor", "version", "registrations")

    def __init__(self, tensor):
        self.tensor = tensor.detach()
        self.version = tensor._version
        self.registrations = _register_kept(self.tensor)

    def unpack(self):
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{self.tensor.dtype}{list(self.tensor.shape)}] is at version "
                f"{self.tensor._version}; expected version {self.version} instead. Hint: the "
                "tensor was saved for backward (kept as it is by Spillway) and changed in place "
                "afterwards.")
        return self.tensor


def _register_kept(tensor):
    """Registrations of the storages a kept save reads: its own, or, for a wrapper subclass
    (DTensor, float8 and NF4 tensors; no storage of its own), those of the inner tensors its
    __tensor_flatten__ names, wrappers within wrappers included."""
    try:
        own = _C.KeptRegistration(tensor)
    except (RuntimeError, TypeError):  # a tensor whose parts cannot be read: nothing registered
        own = None
    if own is not None and len(own):
        return [own]
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:  # nothing says where its data is: nothing to register
        return []
    names, _ = flatten()
    inner = (getattr(tensor, name) for name in names)
    return [r for t in inner if isinstance(t, torch.Tensor) for r in _register_kept(t)]


def _pack(tensor):
    # Tensor subclasses (wrappers such as DTensor, float8 or NF4 tensors) keep their Python
    # type only if kept as they are.
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        _C.count_skip("subclass")
        return _Kept(tensor)
    # Each save follows the innermost block open on its own thread (another thread's block may
    # have set the engine's configuration since), or the environment hook's settings.
    stack = _thread_stack()
    saves = stack[-1][3] if stack else _process_wide_saves
    if saves is None:  # no block open on this thread and no environment hook: the engine's
        return _C.pack(tensor)
    return _C.pack(tensor, *saves)


def _unpack(packed):
    if isinstance(packed, _C.SavedHandle):
        return _C.unpack(packed)
    return packed.unpack()


# How many offload blocks are open, and whether saves outside them are offloaded too (the
# environment hook's process-wide form): either way a block that ends gives the settings back.
_open_blocks = 0
# Per thread (a decorated forward may run on several), every offload block open on it, innermost
# last, as (block, its saved-tensor hooks, the settings it replaced, how its saves are made):
# blocks must close in the reverse order (saved-tensor hooks are a stack, and each block puts back
# what it replaced).
_open_on_thread = threading.local()
# Under the environment hook, how saves outside any block are made: (never spill, min_bytes),
# and the whole process-wide configuration, which the last block to end on any thread puts back.
_process_wide_saves = None
_process_wide_config = None
# Entering and leaving blocks read, change and count the engine's one configuration: one thread
# at a time (reentrant: a failed entry leaves through _leave).
_blocks_lock = threading.RLock()


class offload(contextlib.ContextDecorator):
    """Offloads tensors saved for backward inside the block.

    policy: "auto" (before an allocation would take allocated bytes past a budget, spill the
        oldest saves to make room), "eager" (spill everything eligible), or "off" (register,
        never spill); default from the configuration (its `offload` key, "auto" unless set).
    budget_bytes: the "auto" budget; default: the configured fraction (80%) of the device limit.
        Held when enough can be spilled; what cannot be (parameters, gradients, unsaved tensors,
        a fixed prefetch_bytes of the newest saves, reloads in use) can carry the peak past it.
    min_bytes: storages smaller than this are never spilled; default from the configuration
        (`offload_min_kb`, 1 MiB).
    prefetch_bytes: how far ahead backward reloads, per device (whole saves: the next one even
        when it alone is larger; 0: no prefetch); default from the configuration (`prefetch_mb`),
        unset there: adaptive, the next save and then as deep as the most memory forward held
        leaves room for, so that prefetching never raises the peak. A prefetch is a guess: an
        allocation that would fail otherwise takes back the ones not used yet.

    Blocks nest: each saved tensor keeps the "off" and the min_bytes of the block it was saved in
    (one saved in an "off" block stays on the device), and when an inner block ends the enclosing
    block's settings come back; when to spill is up to the policy in force. The outermost block's
    settings stay in force after it, for the backward pass (under the environment hook, the
    process-wide settings come back instead).

    Threads: a block's hooks, like PyTorch's, serve the thread that entered it, and each save
    keeps the "off" and min_bytes of the innermost block open on its own thread. When and how much
    to spill (the policy, budget_bytes, prefetch_bytes) is the engine's, one setting per process:
    a block's start sets it and its end puts back what the block found at its start (under the
    environment hook, the last block to end on any thread puts the process-wide settings back).

    The arguments are checked when the block is made; it can be entered again (each step of a
    training loop, say, as with save_on_cpu), nested in itself, and used as a decorator.
    """

    def __init__(self, policy=None, budget_bytes=None, min_bytes=None, prefetch_bytes=None):
        if policy is not None and policy not in _POLICIES:
            raise ValueError(f"policy must be one of {', '.join(_POLICIES)}, got {policy!r}")
        self._policy = policy
        self._budget_bytes = _check_bytes("budget_bytes", budget_bytes, positive=True)
        self._min_bytes = _check_bytes("min_bytes", min_bytes)
        self._prefetch_bytes = _check_bytes("prefetch_bytes", prefetch_bytes)

    def __enter__(self):
        global _open_blocks
        _require_installed("offload")
        defaults = _C.offload_defaults()

        def given(value, key):
            return value if value is not None else defaults[key]

        policy, min_bytes = given(self._policy, "policy"), given(self._min_bytes, "min_bytes")
        with _blocks_lock:
            previous = _C.offload_config()
            # What this block's end puts back: the enclosing settings, if any (the outermost
            # block's stay in force after it, for backward).
            enclosing = previous if (_open_blocks > 0 or _process_wide_saves is not None) else None
            _C.configure_offload(policy, given(self._budget_bytes, "budget_bytes"),
                                 defaults["budget_fraction"], min_bytes,
                                 given(self._prefetch_bytes, "prefetch_bytes"))
            _open_blocks += 1
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        try:
            hooks.__enter__()
        except BaseException:
            self._leave(previous)  # a block that never began leaves nothing of its settings
            raise
        _thread_stack().append((self, hooks, enclosing, (policy == "off", min_bytes)))
        return self

    def __exit__(self, *exc_info):
        stack = _thread_stack()
        if not any(entry[0] is self for entry in stack):
            # Exited twice, or on another thread than the one that entered it (saved-tensor
            # hooks are per thread): nothing of this block is open here.
            raise RuntimeError("spillway.offload: exited without being entered on this thread; a "
                               "block is entered and exited once, on the same thread")
        if stack[-1][0] is not self:
            # Out of order (entered and exited by hand, not by `with`): this block's hooks are
            # not the innermost, and the settings it would put back are not the ones in force.
            raise RuntimeError("spillway.offload: exited while a block entered after it is still "
                               "open; blocks exit in the reverse order they were entered (as "
                               "`with` statements do): exit the inner one first")
        _, hooks, enclosing, _ = stack.pop()
        try:
            try:
                _C.forward_end()
            finally:
                hooks.__exit__(*exc_info)
        finally:
            self._leave(enclosing)
        return False

    @staticmethod
    def _leave(enclosing):
        global _open_blocks
        with _blocks_lock:
            _open_blocks -= 1
            # Under the environment hook the last block to end, on whichever thread, puts the
            # process-wide settings back: blocks of several threads may end in another order than
            # they began, and what the last one found at its start may be a block's long ended.
            if _open_blocks == 0 and _process_wide_config is not None:
                enclosing = _process_wide_config
            if enclosing is not None:
                _C.configure_offload(enclosing["policy"], enclosing["budget_bytes"],
                                     enclosing["budget_fraction"], enclosing["min_bytes"],
                                     enclosing["prefetch_bytes"])


def _thread_stack():
    if not hasattr(_open_on_thread, "entries"):
        _open_on_thread.entries = []
    return _open_on_thread.entries


def _spill_now(module, args, output):
    # Forward only: a forward hook also runs when a checkpointed region is recomputed in
    # backward, where saves are being read back, not made.
    if (_thread_stack() or _process_wide_saves is not None) \
            and torch._C._current_graph_task_id() == -1:
        _C.forward_end()


def spill_after(modules):
    """Runs the spill policy each time one of `modules` (an iterable of nn.Module, such as a
    ModuleList of decoder layers) returns in forward, inside an offload block or under the
    environment hook's offload; returns the hooks' handles (`handle.remove()` undoes one).

    For torch.compile: a compiled graph saves for backward only when it returns, all at once, so
    an offload block can spill nothing of a graph before its end, and a compiled model whose
    forward is one graph reaches the same peak as without offload. This hook is one that
    torch.compile does not trace (a graph break): compiling the whole model then yields one graph
    per module, and each module's saves are spilled as it returns, not at the next save (under
    "eager", at the end of the next module's graph). Regional compilation (each module compiled
    on its own) gains from it too. Gradients are unchanged: only where the graphs end moves."""
    modules = list(modules)
    for module in modules:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"spill_after takes an iterable of torch.nn.Module, got an element "
                            f"of type {type(module).__name__}")
    hook = torch.compiler.disable(_spill_now)
    return [module.register_forward_hook(hook) for module in modules]


def memory_stats(device=None):
    """PyTorch's memory_stats keys, plus the offload engine's as 'spillway.<name>'."""
    _require_installed("memory_stats")
    return _C.memory_stats(_device_index(device))


def reset_peak_stats(device=None):
    """Resets the peaks of memory_stats(device) to the current values (PyTorch's
    reset_peak_memory_stats)."""
    _require_installed("reset_peak_stats")
    _C.reset_peak_stats(_device_index(device))


def empty_cache():
    """Gives cached device segments nothing uses back to the device, and the pinned host memory
    spilled data no longer uses back to the host (PyTorch's empty_cache, plus the host side)."""
    _require_installed("empty_cache")
    _C.empty_cache()


def set_per_process_memory_fraction(fraction, device=None):
    """Limits Spillway's reserved memory on `device` to this fraction of the device's total, as
    torch.cuda.set_per_process_memory_fraction does: 0 allows no new memory, 1 the whole device."""
    # numbers.Real: numpy's floats too (np.float32(0.5) was refused as "not in [0, 1]").
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
    # As in PyTorch, 0 or a tiny fraction is a limit nothing new fits under (the core keeps at
    # least one byte, as a limit of 0 bytes would mean none); NaN fails every comparison.
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
    _require_installed("set_per_process_memory_fraction")
    _C.set_memory_fraction(float(fraction), _device_index(device))


def synchronize():
    """Waits for every offload copy in flight."""
    _require_installed("synchronize")
    _C.synchronize()


def budget_bytes(device=None):
    """The "auto" policy's budget on `device`, in bytes."""
    _require_installed("budget_bytes")
    index = _device_index(device)
    # A configured budget is the same on every device, so the engine answers it without looking
    # at the index: check the index with a call that does.
    _C.memory_stats(index)
    return _C.budget_bytes(index)


def _check_tensor(what, tensor):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"spillway.{what} expects a torch.Tensor, got {type(tensor).__name__}")


def keepers(tensor):
    """Who keeps the tensor's storage: saved views ({'kind': 'saved', 'shape', 'stride',
    'offset'}), those Spillway tracks and those it keeps as they are (subclasses, nested or
    quantized tensors, a second storage over the memory), and holders Spillway does not know
    ({'kind': 'external', 'count': n}; n includes `tensor` itself). A saved view whose bytes are
    lost (released by force, or a failed copy: its backward raises) has 'lost': True."""
    _check_tensor("keepers", tensor)
    _require_installed("keepers")
    return _C.keepers(tensor)


def release(tensor, force=False):
    """Frees the storage's device memory now (the storage becomes 0 bytes) and reports who else
    held it: {'freed_bytes', 'other_holders', 'keepers'}. Refuses while tensors saved for
    backward still need the storage, unless force=True (backward then raises where it reads them,
    naming the release; a save kept as it is would read freed memory), and a tensor that requires
    grad, unless force=True (Spillway cannot see what autograd saved outside its hooks). Other
    tensors on the storage point at no memory afterwards."""
    _check_tensor("release", tensor)
    force = _check_bool("force", force)
    _require_installed("release")
    return _C.release(tensor, force)


def residency(tensor):
    """Where the saved data of the tensor's storage is: 'resident' (on the device), 'spilling',
    'spilled', 'reloading', 'failed' (a copy failed: backward raises when it reads it), or None
    when Spillway tracks no saved tensor of that storage."""
    _check_tensor("residency", tensor)
    _require_installed("residency")
    return _C.residency(tensor)


def pluggable_allocator():
    """A torch.cuda.memory.CUDAPluggableAllocator over libspillway_alloc.so. PyTorch cannot
    report statistics or snapshots on this route."""
    if torch.version.cuda is None:
        raise RuntimeError("pluggable_allocator: this torch has no CUDA")
    return torch.cuda.memory.CUDAPluggableAllocator(_LIB, "spillway_malloc", "spillway_free")


def _device_index(device):
    """The index of `device`: an int (numpy's too), a torch.device, or a string such as "cuda:1",
    as torch.cuda's functions take it ("cuda" alone, or None: the current device). On the
    simulated device, whose tensors are CPU tensors, "cpu" names device 0 too."""
    if device is None:
        device = "cuda"
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as error:
            raise ValueError(f"device {device!r} is not a device string ({error})") from None
    if isinstance(device, torch.device):
        sim = _C.installed_mode() == "sim"
        if device.type != "cuda" and not (sim and device.type == "cpu"):
            raise ValueError(f"device {str(device)!r} is not one Spillway serves: expected a "
                             f"'cuda' device{' (or cpu on the simulated device)' if sim else ''}")
        if device.index is not None:
            device = device.index
        elif device.type == "cuda" and not sim:
            device = torch.cuda.current_device()
        else:
            device = 0
    if isinstance(device, bool) or not isinstance(device, numbers.Integral):
        raise ValueError(f"device must be an int index, torch.device or string like 'cuda:0', "
                         f"got {device!r}")
    device = int(device)
    if not 0 <= device <= 0x7FFFFFFF:
        raise ValueError(f"device index {device} is out of range: expected a non-negative index")
    return device
