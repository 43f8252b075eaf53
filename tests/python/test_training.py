"""A small transformer language model trained with and without offload: memory goes down, losses
stay bitwise equal."""

import os
import sys

import pytest

import spillway
from conftest import run_script, stat

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)
import tiny_lm  # noqa: E402

PREFETCH = 4 << 20


def measured(offload):
    spillway.synchronize()
    spillway.reset_peak_stats()
    losses, _ = tiny_lm.train(steps=3, offload=offload)
    return losses, stat("allocated_bytes.all.peak")


def test_eager_halves_the_peak_with_equal_losses():
    base_losses, base_peak = measured(None)
    losses, peak = measured(lambda: spillway.offload("eager", min_bytes=0, prefetch_bytes=PREFETCH))
    assert losses == base_losses  # bitwise: float equality of every step's loss
    assert peak <= base_peak / 2, (peak, base_peak)


def test_auto_holds_the_peak_at_the_budget():
    base_losses, base_peak = measured(None)
    budget = base_peak // 2
    # auto makes room before each allocation, so the peak passes the budget only by what was in
    # use when nothing more could be spilled: 0.2 MiB on this model. Spilling after the fact
    # instead overshoots by up to the largest activation (attention weights, 4 MiB).
    slack = 1 << 20
    losses, peak = measured(lambda: spillway.offload("auto", budget_bytes=budget, min_bytes=0,
                                                     prefetch_bytes=PREFETCH))
    assert losses == base_losses
    assert peak <= budget + slack, (peak, budget)
    assert stat("spillway.num_spills") > 0


def test_auto_spills_ahead_from_the_second_step():
    """auto learns from a forward how far it went above its budget and, from the next one on,
    spills that much of its oldest saves as they are made, so that their copies run during the
    forward rather than at its peak: the second and third steps have spilled by the end of their
    first layer, far below the budget, and the memory they hold (a spill's block counts until its
    copy has read it) stays close to the budget. The first, which had nothing to learn from, had
    spilled nothing there, and held 1.65x its budget at its peak (measured 2026-12-07: the blocks
    its spills at the peak freed were still being read)."""
    import torch

    base_losses, base_peak = measured(None)
    budget = base_peak // 2
    at_first_layer = [None]  # per step: bytes spilled when its first layer ended

    def after_layer(module, args, output):
        if isinstance(module, torch.nn.TransformerEncoderLayer) and at_first_layer[-1] is None:
            at_first_layer[-1] = stat("spillway.spilled_bytes.current")

    def on_step():
        if len(at_first_layer) == 1:  # the later steps' peaks from here
            spillway.synchronize()
            spillway.reset_peak_stats()
        at_first_layer.append(None)

    with spillway.offload("off"):
        pass  # another policy: auto forgets what it learned of earlier tests' forwards
    handle = torch.nn.modules.module.register_module_forward_hook(after_layer)
    try:
        losses, _ = tiny_lm.train(
            steps=3, on_step=on_step,
            offload=lambda: spillway.offload("auto", budget_bytes=budget, min_bytes=0,
                                             prefetch_bytes=PREFETCH))
    finally:
        handle.remove()
    assert losses == base_losses
    spilled = at_first_layer[:3]
    assert spilled[0] == 0 and spilled[1] > 0 and spilled[2] > 0, spilled
    # How soon the copies finish is the simulated device's timing: within the budget here
    # (2026-12-07), 1.08x it in the sanitizer build's run, where the first step held 1.65x.
    held = stat("active_bytes.all.peak")
    assert held <= budget * 1.25, f"held {held} against a budget of {budget}"


def test_auto_reserves_little_more_than_its_budget():
    def reserved_peak(offload):
        spillway.empty_cache()  # no segments cached by earlier runs
        measured(offload)
        return stat("reserved_bytes.all.peak")

    base_losses, base_peak = measured(None)
    base_reserved = reserved_peak(None)
    budget = base_peak // 2
    reserved = reserved_peak(lambda: spillway.offload("auto", budget_bytes=budget, min_bytes=0,
                                                      prefetch_bytes=PREFETCH))
    # Measured with torch 1.13 (2026-12-01): 34 MiB against 62 without offload (a 24 MiB budget);
    # before the allocator waited for spill copies rather than take new segments past the budget,
    # 54 (0.87 of 62). With torch 2.11 (an H200 machine, 2026-12-04): 42 against 56 (0.75; an
    # 18 MiB budget: the same model peaks lower there).
    assert reserved <= base_reserved * 0.8, (reserved, base_reserved, budget)


CAPACITY_SCRIPT = """
    import sys
    sys.path.insert(0, {bench!r})
    import torch, spillway, tiny_lm
    spillway.install("sim", capacity_bytes={capacity})
    offload = None
    if {policy!r} != "none":
        offload = lambda: spillway.offload({policy!r}, min_bytes=0, prefetch_bytes={prefetch})
    try:
        losses, _ = tiny_lm.train(steps=3, offload=offload)
        print("losses", repr(losses))
    except torch.cuda.OutOfMemoryError as error:
        print("oom", str(error).splitlines()[0])
"""


def test_capacity_below_the_peak_fails_without_offload_and_completes_with_auto():
    base_losses, base_peak = measured(None)
    # Below the no-offload peak, rounded down to whole MiB.
    capacity = (int(base_peak * 0.7) >> 20) << 20

    def run(policy):
        script = CAPACITY_SCRIPT.format(bench=BENCH, capacity=capacity, policy=policy,
                                        prefetch=PREFETCH)
        result = run_script(script)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    without = run("none")
    assert without.startswith("oom Spillway: out of memory on device 0"), without
    with_auto = run("auto")
    assert with_auto == "losses " + repr(base_losses)


MLP_SCRIPT = """
    import hashlib, torch, spillway
    spillway.install("sim", capacity_bytes={capacity})
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
                                  for _ in range(16)])
    x = torch.randn(4096, 256)
    offload = {offload}
    try:
        with offload:
            loss = model(x).square().mean()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        print("grads", hashlib.sha256(grads.numpy().tobytes()).hexdigest())
    except torch.cuda.OutOfMemoryError as error:
        print("oom", str(error).splitlines()[0])
"""


def mlp_run(capacity, offload):
    result = run_script(MLP_SCRIPT.format(capacity=capacity, offload=offload))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize("policy, prefetch", [("eager", 256 << 20), ("auto", 4 << 20)])
def test_prefetch_never_turns_a_run_that_fits_into_an_out_of_memory_error(policy, prefetch):
    """Regression (user review, 2026-12-01): 128 MiB of saves in a 32 MiB device trained with
    prefetch off, and ran out of memory in backward with it on: the rescue could not take back a
    prefetch nobody had used yet. Gradients equal those of a run that fits without offload."""
    reference = mlp_run(512 << 20, "__import__('contextlib').nullcontext()")
    assert reference.startswith("grads "), reference
    got = mlp_run(32 << 20, f"spillway.offload({policy!r}, min_bytes=0, prefetch_bytes={prefetch})")
    assert got == reference
