"""scripts/demo, the main job, end to end on the simulated device (it runs each configuration in
its own process, as a user's run would)."""

import os
import subprocess
import sys

import pytest
import torch

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "demo.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the demo picks the GPU when there is one")
def test_demo_runs_and_offload_trains_where_no_offload_runs_out_of_memory(tmp_path):
    env = dict(os.environ, SPILLWAY_DEMO_OUT=str(tmp_path))
    for var in ("SPILLWAY_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(var, None)
    result = subprocess.run([sys.executable, DEMO], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split("|")[1].strip(): line for line in result.stdout.splitlines()
            if line.startswith("| ")}
    assert "yes (bitwise)" in rows["Spillway eager"]
    # Memory saved is read from what each run held (its spills' blocks count until their copies
    # have read them), not from its allocated bytes.
    header = next(line for line in result.stdout.splitlines() if "vs no offload" in line)
    assert [c.strip() for c in header.split("|")[2:5]] == [
        "peak held (MiB)", "vs no offload", "peak allocated (MiB)"], header
    first = result.stdout.split("When the activations do not fit")[0]
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]]
             for line in first.splitlines() if line.startswith("| ") and "x |" in line}
    assert len(cells) == 3, first
    base_held = float(cells["no offload"][0])
    for name, (held, ratio, allocated) in cells.items():
        assert float(held) >= float(allocated), (name, held, allocated)
        assert abs(float(ratio[:-1]) - float(held) / base_held) <= 0.007, (name, held, ratio)
    assert any(name.startswith("Spillway auto, budget") for name in rows)
    # The second table: the same run on a device too small for it without offload.
    tight = result.stdout.split("When the activations do not fit")[1]
    assert "| no offload | out of memory |" in tight
    assert "| Spillway auto, default budget | completed |" in tight
    assert "yes (bitwise)" in tight.split("| Spillway auto, default budget |")[1].splitlines()[0]
    for name in ("snapshot_no_offload.pickle", "snapshot_eager.pickle", "timeline.png",
                 "report.html"):
        assert (tmp_path / name).stat().st_size > 0, name
