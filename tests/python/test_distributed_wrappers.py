"""Wrapper subclasses saved for backward, what DTensor is: a wrapper in DTensor's style (and one
with the traceable-subclass protocol) in this process, and a real DTensor on a one-rank gloo
process group in a process of its own. A save that is such a wrapper is kept as it is, counted
(spillway.skipped.subclass), and keeps its inner storage from release(); the plain activation
next to it is still offloaded."""

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

import spillway
from conftest import assert_bitwise_equal, run_script, stat

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(spillway.__file__)))

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="this torch has no torch.distributed with gloo")


class Wrapper(torch.Tensor):
    """A wrapper subclass in DTensor's style: no storage of its own, every op unwraps to the
    inner tensor and wraps the results."""

    @staticmethod
    def __new__(cls, inner, requires_grad=False):
        r = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=inner.device, requires_grad=requires_grad)
        r.inner = inner
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.inner if isinstance(t, Wrapper) else t

        def wrap(t):
            return cls(t) if isinstance(t, torch.Tensor) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(wrap, out)


def wrapper_step(offload):
    torch.manual_seed(21)
    inner = torch.randn(128, 128)
    w = Wrapper(inner.clone(), requires_grad=True)
    p = torch.randn(128, 128, requires_grad=True)
    skipped, spills = stat("spillway.skipped.subclass"), stat("spillway.num_spills")
    residency = []
    if offload:
        with spillway.offload("eager", min_bytes=0, prefetch_bytes=0):
            y = w.exp()            # saves its output: a Wrapper
            residency.append(spillway.residency(y.inner))
            plain = p.exp()        # saves its output: a plain tensor, spillable
            loss = (y * 2).sum() + plain.sum()
            del y, plain
    else:
        loss = (w.exp() * 2).sum() + p.exp().sum()
    spillway.synchronize()
    counts = (stat("spillway.skipped.subclass") - skipped, stat("spillway.num_spills") - spills)
    loss.backward()
    assert isinstance(w.grad, Wrapper)
    return [w.grad.inner.clone(), p.grad.clone()], inner, counts, residency


def test_wrapper_subclass_saved_for_backward_is_kept_and_counted():
    reference, inner, _, _ = wrapper_step(False)
    grads, _, (skipped, spills), residency = wrapper_step(True)
    assert skipped > 0
    assert spills > 0  # the plain activation next to it was offloaded
    assert residency == [None]  # the wrapper's inner storage was never registered or moved
    assert_bitwise_equal(grads, reference)
    assert torch.equal(grads[0], 2 * inner.exp())


class FlatteningWrapper(Wrapper):
    """The same wrapper with the traceable-subclass protocol DTensor and float8 tensors follow:
    __tensor_flatten__ names the inner tensors that hold its data."""

    def __tensor_flatten__(self):
        return ["inner"], None


def test_a_saved_wrapper_keeps_its_inner_storage_from_release():
    """A wrapper kept as it is reads its inner tensors' memory at backward: release() of an
    inner tensor freed it unseen, and backward read freed memory."""
    w = FlatteningWrapper(torch.randn(256, 256), requires_grad=True)
    with spillway.offload("eager", min_bytes=0, prefetch_bytes=0):
        y = w.exp()  # saves its output, a FlatteningWrapper
    inner = y.inner
    assert spillway.residency(inner) == "resident"
    assert any(k["kind"] == "saved" for k in spillway.keepers(inner))
    with pytest.raises(ValueError, match="kept as they are"):
        spillway.release(inner)
    y.sum().backward()
    assert torch.equal(w.grad.inner, y.inner)  # d exp(x)/dx = exp(x), read intact
    del y
    assert spillway.residency(inner) is None  # backward let the save go


DTENSOR_MODULE = next((m for m in ("torch.distributed.tensor", "torch.distributed._tensor")
                       if importlib.util.find_spec(m) is not None), None)

DTENSOR_SCRIPT = """
import datetime, sys
sys.path.insert(0, {bench!r})
import torch, torch.distributed as dist, spillway
from {module} import DeviceMesh, Shard, distribute_tensor
torch.use_deterministic_algorithms(True)
spillway.install("sim", capacity_bytes=256 << 20)
dist.init_process_group("gloo", init_method={init!r}, rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
mesh = DeviceMesh("cpu", [0])
torch.manual_seed(0)
full = torch.randn(64, 64)

def step(offload):
    x = distribute_tensor(full.clone(), mesh, [Shard(0)]).requires_grad_()
    if offload:
        with spillway.offload("eager", min_bytes=0, prefetch_bytes=0):
            loss = (x.exp() * 2).sum()
    else:
        loss = (x.exp() * 2).sum()
    loss.backward()
    return x.grad.to_local().clone(), type(x.grad).__name__

reference, _ = step(False)
before = spillway.memory_stats()["spillway.skipped.subclass"]
grad, kind = step(True)
skipped = spillway.memory_stats()["spillway.skipped.subclass"] - before
dist.destroy_process_group()
print("kind", kind)
print("skipped", skipped)
print("equal", torch.equal(grad, reference), torch.equal(grad, 2 * full.exp()))
"""


@pytest.mark.skipif(DTENSOR_MODULE is None,
                    reason=f"torch {torch.__version__} has no DTensor "
                           "(torch.distributed.tensor / torch.distributed._tensor)")
def test_real_dtensor_saved_for_backward_is_kept_and_counted(tmp_path):
    source = DTENSOR_SCRIPT.format(bench=BENCH, module=DTENSOR_MODULE,
                                   init=f"file://{tmp_path / 'dtensor_store'}")
    result = run_script(source, env={"GLOO_SOCKET_IFNAME": "lo",
                                     "PYTHONPATH": os.pathsep.join([PACKAGE_ROOT, BENCH])},
                        timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    assert lines["kind"] == "DTensor"
    assert int(lines["skipped"]) > 0
    assert lines["equal"] == "True True"
