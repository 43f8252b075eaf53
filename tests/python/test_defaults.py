"""Defaults that need no tuning (issue #36): with no arguments, `eager` at least halves the peak
of a PyTorch transformer language model of about 170 MB (parameters, AdamW state and
activations), and `auto` keeps near an explicit budget, both bitwise equal to no offload. Each
run is a fresh process of bench/encoder_lm.py on the simulated device (one install per
process)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.models
BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")


def run(*args):
    env = dict(os.environ)
    for var in ("SPILLWAY_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, os.path.join(BENCH, "encoder_lm.py"), *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference():
    return run("--offload", "none")


def test_eager_with_no_arguments_halves_the_peak_bitwise(reference):
    # Before the adaptive window, backward's default 256 MiB window brought every save back at
    # once: 0.96x here (2026-12-05).
    got = run("--offload", "eager")
    assert got["bytes_to_host"] > 0
    assert (got["losses"], got["grads"]) == (reference["losses"], reference["grads"])
    # Allocated: what the policy keeps on the device (0.495x, 2026-12-07). Held also counts a
    # spill's block until its copy has read it: the same on an idle machine, but the simulated
    # link's copies are host threads, which a loaded host slows (0.540x in a clean-clone CI run
    # beside its two lanes, 2026-12-07, bitwise all the same), so held has room for copies in
    # flight.
    allocated = got["peak_allocated"] / reference["peak_allocated"]
    held = got["peak_held"] / reference["peak_held"]
    detail = f"eager with its defaults: {allocated:.3f}x allocated, {held:.3f}x held of no offload"
    assert allocated <= 0.5, detail
    assert held <= 0.6, detail


def test_auto_holds_an_explicit_budget_bitwise(reference):
    # Before, the default window kept the newest 256 MiB of saves resident: nothing was spilled
    # and the peak was the peak of no offload (1.00x, 2026-12-05). Then, with the adaptive window,
    # backward's gradients landed on top of prefetches auto did not give back: 1.15x the budget.
    budget_fraction = 0.6
    got = run("--offload", "auto", "--budget-fraction", str(budget_fraction),
              "--reference-peak", str(reference["peak_allocated"]))
    assert got["bytes_to_host"] > 0
    assert (got["losses"], got["grads"]) == (reference["losses"], reference["grads"])
    budget = budget_fraction * reference["peak_allocated"]
    # What auto cannot spill at an allocation (saves below min_bytes, reloads in use) may pass
    # the budget a little: the 1 MiB test_training allows too.
    assert got["peak_allocated"] <= budget + (1 << 20), \
        f"auto peaked at {got['peak_allocated'] / budget:.3f}x of its budget"
    # The budget is on allocated bytes; what auto holds also counts the blocks its spills still
    # copy at the peak: 104.5 MiB against a budget of 98.3 (1.064x) on 2026-12-07.
    assert got["peak_held"] <= 1.1 * budget, \
        f"auto held {got['peak_held'] / budget:.3f}x of its budget at its peak"
