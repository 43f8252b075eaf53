"""Spillway under torch.distributed: DDP across two ranks on this machine (gloo, loopback only),
FSDP's free/refill of gathered parameters, wrapper subclasses (DTensor) saved for backward, and
1-GPU NCCL smoke tests (DDP and FSDP) for machines that have one.

Ranks run as subprocesses of the test (Spillway allows one install per process, and each rank is
its own process with its own allocator); they rendezvous through a file:// store in the test's
temporary directory and talk over the loopback interface only (GLOO_SOCKET_IFNAME=lo)."""

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import spillway
from conftest import assert_bitwise_equal, run_script, stat

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(spillway.__file__)))
PREFETCH = 4 << 20
EXTRA = 64 << 20  # the tensor only rank 1 allocates
WORLD = 2
RANK_TIMEOUT = 150  # seconds for a whole multi-rank launch

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="this torch has no torch.distributed with gloo")


# --------------------------------------------------------------------------------------------
# Multi-rank runs: one script, one process per rank.

RANK_SCRIPT = """
import contextlib
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import spillway
import tiny_lm

mode, init, out = sys.argv[1], sys.argv[4], sys.argv[5]
rank, world = int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))

# Saved activations must exceed the prefetch window (4 MiB), which "auto" never spills.
CONFIG = dict(vocab=128, d_model=64, nhead=4, layers=2, ff=128, seq=64)
STEPS, BATCH, EXTRA, PREFETCH = 3, 16, {extra}, {prefetch}


def wrap_ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model)


def wrap_fsdp(model):
    # Raises where this torch cannot run FSDP on CPU (reported as a skip by the test).
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    try:
        make = lambda m: FSDP(m)
        make(torch.nn.Linear(2, 2))
    except Exception:  # older torch wants CUDA unless told the device
        make = lambda m: FSDP(m, device_id=torch.device("cpu"))
    for i, block in enumerate(model.blocks):  # one FSDP unit per layer, then the root
        model.blocks[i] = make(block)
    return make(model)


def wrap_fsdp2(model):
    # FSDP2: fully_shard per layer, then the root, over a CPU mesh (gloo). Each layer's
    # parameters are gathered before its forward and freed after it (reshard_after_forward), and
    # gathered again before its backward. A forward hook that runs before FSDP2's reshard notes
    # where Spillway has the gathered parameters then: they must never be spilled.
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
        block.register_forward_hook(note_gathered_parameters, prepend=True)
    return fully_shard(model, mesh=mesh)


# Spillway's residency of each gathered parameter at the end of its layer's forward (FSDP2).
gathered_residency = set()


def note_gathered_parameters(module, args, output):
    for p in module.parameters():
        gathered_residency.add(spillway.residency(p) if spillway.installed() else "not installed")


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2's shards are DTensors


def train(wrap, offload, budget=None, extra=False):
    torch.manual_seed(0)
    model = wrap(tiny_lm.TinyLM(**CONFIG))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = tiny_lm.batches(STEPS, BATCH, CONFIG["seq"], CONFIG["vocab"], seed=1000 + rank)
    spillway.synchronize()
    spillway.reset_peak_stats()
    before = spillway.memory_stats()
    losses, grads = [], None
    for step, tokens in enumerate(data):
        optimizer.zero_grad(set_to_none=True)
        context = (spillway.offload("auto", budget_bytes=budget, min_bytes=0,
                                    prefetch_bytes=PREFETCH)
                   if offload else contextlib.nullcontext())
        held = None
        with context:
            if extra and step == 1:
                held = torch.ones(EXTRA // 4)  # this rank's memory only
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, CONFIG["vocab"]),
                                   tokens[:, 1:].reshape(-1))
            del logits
        loss.backward()
        del held
        if step == STEPS - 1:
            grads = [local(p.grad).detach().clone() for p in model.parameters()]
        optimizer.step()
        losses.append(loss.item())
    spillway.synchronize()
    after = spillway.memory_stats()
    return {{
        "losses": losses,
        "grads": grads,
        "params": [local(p).detach().clone() for p in model.parameters()],
        "peak": after["allocated_bytes.all.peak"],
        "spills": after["spillway.num_spills"] - before["spillway.num_spills"],
        "to_host": after["spillway.bytes_to_host"] - before["spillway.bytes_to_host"],
    }}


result = {{"rank": rank}}
wrap = wrap_ddp
if mode == "fsdp2":
    wrap = wrap_fsdp2
if mode == "fsdp":
    # Whether this torch can train with FSDP on CPU over gloo at all, found before Spillway is
    # installed, so that a failure here is this torch's, never Spillway's.
    try:
        probe = wrap_fsdp(tiny_lm.TinyLM(vocab=16, d_model=8, nhead=2, layers=2, ff=16, seq=8))
        tokens = tiny_lm.batches(1, 2, 8, 16, seed=rank)[0]
        probe(tokens[:, :-1]).sum().backward()
        torch.optim.SGD(probe.parameters(), lr=0.1).step()
        del probe, tokens
        wrap = wrap_fsdp
    except Exception as error:  # noqa: BLE001 - becomes the skip reason
        result["skip"] = f"FSDP cannot train on CPU/gloo with torch {{torch.__version__}} " \\
                         f"(Python {{sys.version.split()[0]}}): {{type(error).__name__}}: " \\
                         f"{{str(error).splitlines()[0][:200]}}"
spillway.install("sim", capacity_bytes=256 << 20)
if "skip" not in result:
    result["plain"] = train(wrap, offload=False)
    budget = max(1 << 20, result["plain"]["peak"] // 2)
    result["budget"] = budget
    gathered_residency.clear()
    result["offload"] = train(wrap, offload=True, budget=budget, extra=(rank == 1))
    result["gathered_residency"] = sorted(map(str, gathered_residency))
dist.barrier()
dist.destroy_process_group()
torch.save(result, out)
print("rank", rank, "done")
"""


def launch(tmp_path, mode, world=WORLD):
    """Runs RANK_SCRIPT as `world` processes; returns their results, rank by rank."""
    script = tmp_path / f"{mode}_rank.py"
    script.write_text(RANK_SCRIPT.format(extra=EXTRA, prefetch=PREFETCH))
    init = f"file://{tmp_path / (mode + '_store')}"
    env = dict(os.environ)
    for var in ("SPILLWAY_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(var, None)
    env.update(PYTHONPATH=os.pathsep.join([PACKAGE_ROOT, BENCH]), GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    procs, logs = [], []
    for rank in range(world):
        log = open(tmp_path / f"{mode}_rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, str(script), mode, str(rank), str(world), init,
             str(tmp_path / f"{mode}_rank{rank}.pt")],
            env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + RANK_TIMEOUT
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, \
            f"rank {rank} exited with {p.returncode}:\n{outputs[rank][-4000:]}"
    return [torch.load(tmp_path / f"{mode}_rank{rank}.pt") for rank in range(world)]


def test_ddp_two_ranks_offload_matches_plain_bitwise(tmp_path):
    ranks = launch(tmp_path, "ddp")
    for rank, r in enumerate(ranks):
        plain, off = r["plain"], r["offload"]
        assert r["rank"] == rank
        assert off["losses"] == plain["losses"], (rank, off["losses"], plain["losses"])
        assert_bitwise_equal(off["grads"], plain["grads"])
        assert_bitwise_equal(off["params"], plain["params"])
        assert plain["spills"] == 0
        assert off["spills"] > 0 and off["to_host"] > 0, (rank, off)
    # Different data per rank, yet DDP keeps the replicas identical.
    assert ranks[0]["plain"]["losses"] != ranks[1]["plain"]["losses"]
    assert_bitwise_equal(ranks[0]["offload"]["params"], ranks[1]["offload"]["params"])
    assert_bitwise_equal(ranks[0]["offload"]["grads"], ranks[1]["offload"]["grads"])
    # Each rank's statistics are its own: only rank 1 allocated EXTRA bytes.
    assert ranks[0]["offload"]["peak"] < EXTRA, ranks[0]["offload"]["peak"]
    assert ranks[1]["offload"]["peak"] >= EXTRA, ranks[1]["offload"]["peak"]
    # And offload lowered rank 0's peak.
    assert ranks[0]["offload"]["peak"] < ranks[0]["plain"]["peak"]


def test_fsdp_training_with_offload_matches_plain(tmp_path):
    ranks = launch(tmp_path, "fsdp")
    reasons = {r.get("skip") for r in ranks}
    if reasons != {None}:
        pytest.skip("; ".join(sorted({str(x) for x in reasons})))
    for rank, r in enumerate(ranks):
        plain, off = r["plain"], r["offload"]
        assert off["losses"] == plain["losses"], (rank, off["losses"], plain["losses"])
        assert_bitwise_equal(off["grads"], plain["grads"])
        assert_bitwise_equal(off["params"], plain["params"])
        assert off["spills"] > 0, (rank, off)
    assert ranks[0]["plain"]["losses"] != ranks[1]["plain"]["losses"]


def test_fsdp2_training_with_offload_matches_plain_and_never_spills_parameters(tmp_path):
    """FSDP2 (fully_shard per layer and the root, 2 gloo ranks) under `auto` with half the peak
    as its budget: losses, gradient and parameter shards bitwise equal to the run without
    offload, activations spilled, and the gathered parameters, which FSDP2 frees after each
    layer's forward and gathers again for its backward, never spilled."""
    ranks = launch(tmp_path, "fsdp2")
    for rank, r in enumerate(ranks):
        plain, off = r["plain"], r["offload"]
        assert off["losses"] == plain["losses"], (rank, off["losses"], plain["losses"])
        assert_bitwise_equal(off["grads"], plain["grads"])
        assert_bitwise_equal(off["params"], plain["params"])
        assert off["spills"] > 0 and off["to_host"] > 0, (rank, off)
        assert r["gathered_residency"], "the forward hook saw no gathered parameter"
        assert set(r["gathered_residency"]) <= {"None", "resident"}, r["gathered_residency"]
    assert ranks[0]["plain"]["losses"] != ranks[1]["plain"]["losses"]
    # Sharded: each rank holds its own half of every parameter.
    halves = zip(ranks[0]["offload"]["params"], ranks[1]["offload"]["params"])
    assert not all(torch.equal(a, b) for a, b in halves)


# --------------------------------------------------------------------------------------------
# FSDP's free/refill of the gathered flat parameter, done by hand on Spillway memory.

SHAPES = [(256, 256), (256,), (256, 256)]
SIZES = [torch.Size(s).numel() for s in SHAPES]
NUMEL = sum(SIZES)


def resize_storage(t, numel):
    """FSDP's _free_storage / _alloc_storage."""
    if hasattr(t, "untyped_storage"):
        t.untyped_storage().resize_(numel * t.element_size())
    else:
        t.storage().resize_(numel)


class FlatUnit:
    """One FSDP unit (world size 1): a flat parameter that holds its shard between uses; forward
    all-gathers into a padded buffer, points the flat parameter at it and uses views of it as
    the layer's weights; after forward the buffer's storage is freed (resized to 0); a hook on the
    output regathers it before backward reads the saved views."""

    def __init__(self, seed, probe):
        g = torch.Generator().manual_seed(seed)
        self.shard = torch.randn(NUMEL, generator=g) * 0.05
        self.flat = torch.nn.Parameter(self.shard.clone())
        self.flat.data = self.shard
        self.padded = torch.empty(NUMEL)
        resize_storage(self.padded, 0)
        self.probe = probe
        self.junk = []

    def unshard(self):
        resize_storage(self.padded, NUMEL)
        with torch.no_grad():
            self.padded.copy_(self.shard)  # the all-gather
        self.flat.data = self.padded

    def reshard(self):
        self.flat.data = self.shard
        resize_storage(self.padded, 0)
        # Whatever now takes the freed block is garbage: a saved view that still pointed there
        # would make the gradients NaN.
        self.junk.append(torch.full((NUMEL,), float("nan")))

    def __call__(self, x, free_refill=True):
        if free_refill:
            self.unshard()
        w1, b1, w2 = (t.view(s) for t, s in zip(self.flat.split(SIZES), SHAPES))
        h = F.linear(x, w1, b1)  # saves x and a view of w1
        self.probe(self, "linear1")
        a = torch.tanh(h)        # saves a (an activation, spillable)
        self.probe(self, "tanh")
        out = F.linear(a, w2)    # saves a and a view of w2
        self.probe(self, "linear2")
        if free_refill:
            self.reshard()
            self.probe(self, "freed")

            def pre_backward(grad):
                self.unshard()
                self.probe(self, "refilled")
                return grad

            out.register_hook(pre_backward)
        return out


def fsdp_like_step(policy, free_refill=True):
    states = []

    def probe(unit, where):
        if policy is not None and free_refill:
            kinds = [k["kind"] for k in spillway.keepers(unit.padded)]
            states.append((where, spillway.residency(unit.padded), kinds))

    units = [FlatUnit(11, probe), FlatUnit(12, probe)]
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(13), requires_grad=True)
    spillway.synchronize()
    spills, to_host = stat("spillway.num_spills"), stat("spillway.bytes_to_host")
    if policy is None:
        loss = units[1](units[0](x, free_refill), free_refill).square().sum()
    else:
        budget = 1 << 20 if policy == "auto" else None
        with spillway.offload(policy, budget_bytes=budget, min_bytes=0, prefetch_bytes=1 << 16):
            loss = units[1](units[0](x, free_refill), free_refill).square().sum()
    spillway.synchronize()
    spilled = (stat("spillway.num_spills") - spills, stat("spillway.bytes_to_host") - to_host)
    loss.backward()
    grads = [u.flat.grad.clone() for u in units] + [x.grad.clone()]
    leftover = [[k for k in spillway.keepers(u.padded) if k["kind"] == "saved"] for u in units]
    for u in units:  # FSDP's post-backward reshard
        resize_storage(u.padded, 0)
    return loss.item(), grads, states, spilled, leftover


@pytest.mark.parametrize("policy", ["eager", "auto"])
def test_fsdp_free_and_refill_of_gathered_parameters(policy):
    ref_loss, reference, _, _, _ = fsdp_like_step(None, free_refill=False)
    plain_loss, plain, _, _, _ = fsdp_like_step(None)
    assert plain_loss == ref_loss
    assert_bitwise_equal(plain, reference)

    loss, grads, states, (spills, to_host), leftover = fsdp_like_step(policy)
    assert loss == ref_loss
    for g in grads:
        assert not torch.isnan(g).any()
    assert_bitwise_equal(grads, reference)
    # Offload was active: activations went to host ...
    assert spills > 0 and to_host > 0
    # ... but never the gathered parameters: each holds 513 KiB, more than all spilled bytes.
    assert to_host < NUMEL * 4, to_host
    # Spillway saw the saved parameter views and kept their storage resident throughout, also
    # while it was freed (0 bytes) between forward and backward, and after the refill.
    assert [where for where, _, _ in states] == (["linear1", "tanh", "linear2", "freed"] * 2
                                                 + ["refilled"] * 2)
    for where, residency, kinds in states:
        assert residency in ("resident", None), (where, residency)
        assert "saved" in kinds, (where, kinds)
    # Backward released every saved view.
    assert leftover == [[], []]


# --------------------------------------------------------------------------------------------
# Wrapper subclasses (what DTensor is) saved for backward.

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


# --------------------------------------------------------------------------------------------
# For a machine with a GPU: one rank, NCCL, Spillway as the CUDA allocator.

NCCL_SCRIPT = """
import contextlib, datetime, sys
sys.path.insert(0, {bench!r})
import torch, torch.distributed as dist, torch.nn.functional as F
import spillway, tiny_lm
spillway.install("cuda")
torch.use_deterministic_algorithms(True)
dist.init_process_group("nccl", init_method={init!r}, rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=120))
torch.cuda.set_device(0)
t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
dist.all_reduce(t)
torch.cuda.synchronize()
assert torch.equal(t.cpu(), torch.arange(1 << 20, dtype=torch.float32)), "all_reduce"

def wrap(model):
    if {wrap!r} == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    # FSDP on its own streams: all-gathers, record_stream on the gathered parameters and their
    # free/refill, all through Spillway's CUDA allocator. One unit per layer, then the root.
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, device_id=0)
    return FSDP(model, device_id=0)

def train(offload):
    torch.manual_seed(0)
    model = wrap(tiny_lm.TinyLM().cuda())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for tokens in tiny_lm.batches(3, 16, 128, 256, seed=0):
        tokens = tokens.cuda()
        optimizer.zero_grad(set_to_none=True)
        with (spillway.offload("eager", min_bytes=0, prefetch_bytes={prefetch})
              if offload else contextlib.nullcontext()):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
            del logits
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses

plain = train(False)
spills = spillway.memory_stats()["spillway.num_spills"]
off = train(True)
spills = spillway.memory_stats()["spillway.num_spills"] - spills
dist.destroy_process_group()
print("equal", off == plain)
print("spills", spills)
"""


@pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                    reason="needs CUDA and NCCL (GPU machine)")
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_nccl_one_gpu_smoke_with_offload(tmp_path, wrap):
    source = NCCL_SCRIPT.format(bench=BENCH, prefetch=PREFETCH, wrap=wrap,
                                init=f"file://{tmp_path / 'nccl_store'}")
    result = run_script(source, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                                     "NCCL_SOCKET_IFNAME": "lo",
                                     "PYTHONPATH": os.pathsep.join([PACKAGE_ROOT, BENCH])},
                        timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    assert lines["equal"] == "True"
    assert int(lines["spills"]) > 0
