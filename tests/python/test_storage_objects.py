"""Storages that Python code has touched (torch 2.10 and later): a storage's Python object, once
made, holds a strong reference to the storage for as long as anything else does. That reference
is no holder while nothing in Python refers to the object; it is one while Python code holds it.
torch >= 2.10 behaviour; on 2.4-2.9 the same tests pass because the object holds nothing then.
FSDP2's resize_(0)-after-forward pattern, whose resizes make such objects of the gathered
parameters, is test_distributed_free_refill.py's
test_fsdp_free_and_refill_of_gathered_parameters."""

import gc

import pytest
import torch

import spillway
from conftest import assert_bitwise_equal, grads_of, run_script, stat

MIB = 1 << 20


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(),
                               torch.nn.Linear(512, 512), torch.nn.Tanh())


def _x():
    return torch.randn(1024, 512)  # 2 MiB activations: past the default min_bytes


def _step(touch, policy):
    """One forward and backward of _model() under `policy`, where `touch(h)` runs on every
    activation in forward (and nothing keeps them past it); (gradients, bytes spilled)."""
    model = _model()
    x = _x()
    before = stat("spillway.bytes_to_host")
    with spillway.offload(policy):
        h = x
        for layer in model:
            h = layer(h)
            touch(h)
        loss = h.square().mean()
    del h
    spillway.synchronize()
    spilled = stat("spillway.bytes_to_host") - before
    loss.backward()
    return grads_of(model), spilled


def _nothing(h):
    pass


def test_a_storage_object_made_and_dropped_in_forward_does_not_keep_its_storage_on_the_device():
    """Measured on torch 2.14.1 before the fix: 0 bytes to the host after h.untyped_storage()."""
    reference, _ = _step(_nothing, "off")
    plain, plain_spilled = _step(_nothing, "eager")
    grads, spilled = _step(lambda h: h.untyped_storage(), "eager")
    assert plain_spilled >= 2 * MIB  # the first tanh's output (x and the last are held)
    assert spilled == plain_spilled
    assert_bitwise_equal(grads, reference)
    assert_bitwise_equal(plain, reference)


def test_torchtunes_use_count_probe_in_forward_leaves_the_storage_spillable():
    """torchtune's activation offloading asks torch._C._storage_Use_Count of each storage."""
    counts = []

    def probe(h):
        counts.append(torch._C._storage_Use_Count(h.untyped_storage()._cdata))

    reference, _ = _step(_nothing, "off")
    grads, spilled = _step(probe, "eager")
    assert len(counts) == 4 and spilled >= 2 * MIB
    assert_bitwise_equal(grads, reference)


def test_a_storage_object_python_still_holds_is_a_holder():
    """While `s = t.untyped_storage()` lives, Python may read or write the storage through it:
    not spilled, and keepers() counts it among the external holders."""
    model = _model()
    x = _x()
    with spillway.offload("eager"):
        h = model[1](model[0](x))
        kept_storage = h.untyped_storage()
        loss = model[3](model[2](h)).square().mean()
    spillway.synchronize()
    assert spillway.residency(h) == "resident"
    external = [k for k in spillway.keepers(h) if k["kind"] == "external"]
    assert external == [{"kind": "external", "count": 2}]  # h and kept_storage
    del h
    gc.collect()
    assert kept_storage.nbytes() == 1024 * 512 * 4  # never dropped under Python's hands
    loss.backward()


def test_dropping_the_last_python_reference_makes_the_storage_spillable_again():
    """The same storage, its object held and then let go: the next forward's saves spill."""
    x = _x()
    w = torch.randn(512, 512, requires_grad=True)
    with spillway.offload("eager"):
        h = torch.tanh(x @ w)
        s = h.untyped_storage()
        loss = (h @ w).square().mean()
    spillway.synchronize()
    assert spillway.residency(h) == "resident"
    del s
    gc.collect()
    external = [k for k in spillway.keepers(h) if k["kind"] == "external"]
    assert external == [{"kind": "external", "count": 1}]  # h alone
    del h
    loss.backward()


@pytest.mark.parametrize("touch", ["untyped_storage", "none"])
def test_snapshot_holder_counts_are_exact_after_a_storage_object_was_made(touch):
    """A storage kept only by saves shows 0 external holders in snapshots, whether or not its
    Python storage object was ever made (torch 2.11 showed 1 after t.untyped_storage())."""
    w = torch.randn(64, requires_grad=True)
    t = torch.randn(64)
    with spillway.offload("off", min_bytes=0):
        loss = (w * t).sum()
    address = t.untyped_storage().data_ptr() if touch == "untyped_storage" else t.data_ptr()
    del t
    gc.collect()
    entry = [e for e in spillway.snapshot()["spillway"]["entries"] if e["address"] == address]
    assert entry and entry[0]["external_holders"] == 0
    block = spillway.snapshot()["spillway"]["blocks"][address]
    assert block["external_holders"] == 0
    loss.backward()


_THREADS_SCRIPT = """
    import threading, torch, spillway
    spillway.install("sim", capacity_bytes=1 << 30)
    spillway.record_history(True, stacks="python")  # allocations and frees take the GIL for stacks

    def run(seed, steps, out):
        gen = torch.Generator().manual_seed(seed)  # torch's default generator is the process's
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.06)
        x = torch.randn(1024, 256, generator=gen)
        grads = []
        for _ in range(steps):
            # A budget below what the threads hold: backward's kernels, which run without the GIL,
            # spill from their allocations (the budget's pressure handler).
            with spillway.offload("auto", budget_bytes=8 << 20, min_bytes=0):
                h = x
                for layer in model:
                    h = torch.tanh(layer(h))
                    h.untyped_storage()  # a storage object, made and dropped
                    s = h.untyped_storage()  # ... and one alive across the next save
                loss = h.square().mean()
            del s
            model.zero_grad(set_to_none=True)
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        out[seed] = grads

    alone = {}
    for seed in range(4):
        run(seed, 3, alone)
    together = {}
    threads = [threading.Thread(target=run, args=(seed, 3, together)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    same = all(torch.equal(a, b) for seed in range(4)
               for step_a, step_b in zip(alone[seed], together[seed])
               for a, b in zip(step_a, step_b))
    stats = spillway.memory_stats()
    print("spilled", stats["spillway.bytes_to_host"], "same", same, "entries",
          stats["spillway.num_entries"])
"""


def test_threads_saving_reading_and_dropping_storages_with_python_objects():
    """Four Python threads train at once under `auto` with a small budget, with storage objects
    made in forward and Python stacks recorded at every allocation and free: nothing under the
    locks of the engine or the allocator waits for the GIL (the stack recorder and, from torch
    2.10, a storage's last release take it). Backward's kernels run without the GIL and spill
    from their allocations under the engine's lock while other threads, holding the GIL, save:
    with the recorder called there, it hung. Bounded: a hang fails on the timeout. Each thread's
    gradients equal those of the same run alone."""
    result = run_script(_THREADS_SCRIPT, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    words = result.stdout.split()
    assert int(words[words.index("spilled") + 1]) > 0, result.stdout
    assert words[words.index("same") + 1] == "True", result.stdout
    assert words[words.index("entries") + 1] == "0", result.stdout
