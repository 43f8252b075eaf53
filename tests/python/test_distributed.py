"""Spillway under torch.distributed, in processes of their own: DDP, FSDP, FSDP2 and pipeline
parallelism (torch.distributed.pipelining, GPipe and 1F1B) across two ranks on this machine (gloo,
loopback only), and 1-GPU NCCL smoke tests (DDP and FSDP) for machines that have one. FSDP's
free/refill of gathered parameters, done by hand in this process, is in
test_distributed_free_refill.py; wrapper subclasses (DTensor) saved for backward are in
test_distributed_wrappers.py.

Ranks run as subprocesses of the test (Spillway allows one install per process, and each rank is
its own process with its own allocator); they rendezvous through a file:// store in the test's
temporary directory and talk over the loopback interface only (GLOO_SOCKET_IFNAME=lo)."""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import spillway
from conftest import assert_bitwise_equal, run_script

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
torch.use_deterministic_algorithms(True)  # one intra-op thread: conftest's OMP_NUM_THREADS
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


def launch(tmp_path, mode, world=WORLD, source=None):
    """Runs `source` (default: RANK_SCRIPT) as `world` processes; returns their results, rank by
    rank."""
    script = tmp_path / f"{mode}_rank.py"
    script.write_text(source or RANK_SCRIPT.format(extra=EXTRA, prefetch=PREFETCH))
    init = f"file://{tmp_path / (mode + '_store')}"
    env = dict(os.environ)
    for var in ("SPILLWAY_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(var, None)
    env.update(PYTHONPATH=os.pathsep.join([PACKAGE_ROOT, BENCH]), GLOO_SOCKET_IFNAME="lo",
               MASTER_ADDR="127.0.0.1")
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
# Pipeline parallelism: torch.distributed.pipelining, one stage per rank, activations sent over
# gloo, several microbatches' graphs alive on each stage.

PIPELINE_SCRIPT = """
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import spillway
import tiny_lm

mode, init, out = sys.argv[1], sys.argv[4], sys.argv[5]
rank, world = int(sys.argv[2]), int(sys.argv[3])
torch.use_deterministic_algorithms(True)
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # noqa: E402

CONFIG = dict(vocab=128, d_model=64, nhead=4, layers=4, ff=128, seq=64)
STEPS, BATCH, MICROBATCHES = 3, 16, 4


# Half of TinyLM: rank 0 the embedding and the first half of the blocks, rank 1 the rest and
# the head.
class Stage(torch.nn.Module):

    def __init__(self, lm, first):
        super().__init__()
        half = len(lm.blocks) // 2
        self.first = first
        self.blocks = lm.blocks[:half] if first else lm.blocks[half:]
        self.embed, self.pos = (lm.embed, lm.pos) if first else (None, None)
        self.head = None if first else lm.head
        self.register_buffer("mask", lm.mask)

    def forward(self, x):
        n = x.shape[1]
        h = self.embed(x) + self.pos[:n] if self.first else x
        for block in self.blocks:
            h = block(h, src_mask=self.mask[:n, :n])
        return h if self.first else self.head(h)


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, CONFIG["vocab"]), target.reshape(-1))


def train(offload):
    torch.manual_seed(0)
    stage_module = Stage(tiny_lm.TinyLM(**CONFIG), first=rank == 0)
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[mode](
        stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.Adam(stage_module.parameters(), lr=1e-3)
    data = tiny_lm.batches(STEPS, BATCH, CONFIG["seq"], CONFIG["vocab"], seed=7)
    before = spillway.memory_stats()
    losses = []
    for tokens in data:
        optimizer.zero_grad(set_to_none=True)
        out = []
        with spillway.offload("eager", min_bytes=0) if offload else torch.enable_grad():
            if rank == 0:
                schedule.step(tokens[:, :-1])
            else:
                schedule.step(target=tokens[:, 1:], losses=out)
        optimizer.step()
        losses.append([loss.item() for loss in out])
    spillway.synchronize()
    after = spillway.memory_stats()
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in stage_module.parameters()],
        "to_host": after["spillway.bytes_to_host"] - before["spillway.bytes_to_host"],
        "entries": after["spillway.num_entries"],
    }


spillway.install("sim", capacity_bytes=256 << 20)
result = {"rank": rank, "plain": train(offload=False), "offload": train(offload=True)}
dist.barrier()
dist.destroy_process_group()
torch.save(result, out)
print("rank", rank, "done")
"""


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_parallel_training_with_offload_matches_plain(tmp_path, schedule):
    """torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B over two ranks (TinyLM split
    in two stages, 4 microbatches a step, 3 steps), each step in an `eager` block: the last
    stage's losses and both stages' parameters bitwise those of the same run without offload,
    activations spilled on both stages, and nothing left registered after the last step."""
    pytest.importorskip("torch.distributed.pipelining")
    ranks = launch(tmp_path, schedule, source=PIPELINE_SCRIPT)
    for rank, r in enumerate(ranks):
        plain, off = r["plain"], r["offload"]
        assert r["rank"] == rank
        assert off["losses"] == plain["losses"], (rank, off["losses"], plain["losses"])
        assert_bitwise_equal(off["params"], plain["params"])
        assert off["to_host"] > 0 and plain["to_host"] == 0, (rank, off["to_host"])
        assert off["entries"] == 0, (rank, off["entries"])
    assert all(len(step) == 4 for step in ranks[1]["plain"]["losses"])  # the last stage's


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
