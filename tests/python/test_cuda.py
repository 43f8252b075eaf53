"""The torch-layer checks on device="cuda": run where a GPU and a CUDA build of torch exist,
skipped elsewhere. Each runs in a fresh process: install("cuda") must precede CUDA's start."""

import os
import textwrap

import pytest
import torch

from conftest import run_script

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device (or torch without CUDA)")


def cuda_script(body):
    result = run_script(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {BENCH!r})
        import torch, spillway, tiny_lm
        spillway.install("cuda")
        torch.use_deterministic_algorithms(True)
    """) + textwrap.dedent(body), env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_training_on_cuda_with_eager_offload_matches_and_spills():
    out = cuda_script("""
        base, _ = tiny_lm.train(steps=3, device="cuda")
        spillway.reset_peak_stats()
        got, _ = tiny_lm.train(steps=3, device="cuda",
                               offload=lambda: spillway.offload("eager", min_bytes=0))
        stats = spillway.memory_stats()
        print("equal", got == base)
        print("spills", stats["spillway.num_spills"] > 0)
        print("served", stats["allocation.all.allocated"] > 0)
    """)
    assert "equal True" in out and "spills True" in out and "served True" in out


def test_views_come_back_exactly_on_cuda():
    out = cuda_script("""
        x = torch.randn(64, 64, device="cuda", requires_grad=True)
        def forward():
            base = torch.randn(64, 64, device="cuda")
            return (x * base.t()[::2].repeat(2, 1)).sum(), base.t()[::2].clone()
        with spillway.offload("eager", min_bytes=0):
            loss, expected = forward()
        loss.backward()
        print("grad ok", torch.equal(x.grad, expected.repeat(2, 1)))
    """)
    assert "grad ok True" in out
