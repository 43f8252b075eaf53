"""The torch-layer checks on device="cuda": run where a GPU and a CUDA build of torch exist,
skipped elsewhere. Each runs in a fresh process: install("cuda") must precede CUDA's start."""

import os
import textwrap

import pytest
import torch

import spillway
from conftest import run_script

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device (or torch without CUDA)")


def cuda_script(body, install=True):
    """Runs `body` in a fresh process on device="cuda", with Spillway installed (or, for a
    control, with PyTorch's own allocator); returns its stdout."""
    result = run_script(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {BENCH!r})
        import torch, spillway, tiny_lm
        if {install!r}:
            spillway.install("cuda")
        torch.use_deterministic_algorithms(True)
    """) + textwrap.dedent(body), env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("amp", ["None", "torch.bfloat16"])
def test_training_on_cuda_with_eager_offload_matches_and_spills(amp):
    out = cuda_script(f"""
        base, _ = tiny_lm.train(steps=3, device="cuda", amp_dtype={amp})
        spillway.reset_peak_stats()
        got, _ = tiny_lm.train(steps=3, device="cuda", amp_dtype={amp},
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


# --- the c10 CUDAAllocator adapter (torch >= 2.4 with CUDA): torch.cuda.memory through Spillway ---

needs_adapter = pytest.mark.skipif(
    not (torch.cuda.is_available() and spillway._C.has_cuda_allocator()),
    reason="no CUDA device, or this build has no c10 CUDA allocator adapter")


@needs_adapter
def test_torch_cuda_memory_reports_spillway():
    out = cuda_script("""
        print("backend", torch.cuda.get_allocator_backend())
        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        ours = spillway.memory_stats()
        theirs = torch.cuda.memory_stats()
        print("allocated", torch.cuda.memory_allocated() == ours["allocated_bytes.all.current"])
        print("reserved", torch.cuda.memory_reserved() == ours["reserved_bytes.all.current"])
        print("keys", all(k in theirs for k in ("allocation.all.current", "segment.large_pool.peak",
                                                 "requested_bytes.all.allocated", "num_ooms")))
        del x
        torch.cuda.reset_peak_memory_stats()
        print("peak reset", torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated())
        w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
        with spillway.offload("eager"):
            loss = (w * 2).exp().sum()
        spillway.synchronize()
        loss.backward()
        del w, loss
        print("host cached", spillway.memory_stats()["spillway.host_reserved_bytes"] > 0)
        torch.cuda.empty_cache()
        print("emptied", torch.cuda.memory_reserved() == 0)
        print("host emptied", spillway.memory_stats()["spillway.host_reserved_bytes"] == 0)
        print("fraction", torch.cuda.get_per_process_memory_fraction() == 1.0)
    """)
    for line in ("backend spillway", "allocated True", "reserved True", "keys True",
                 "peak reset True", "host cached True", "emptied True", "host emptied True",
                 "fraction True"):
        assert line in out, out


@needs_adapter
def test_out_of_memory_raises_torch_cuda_oom_with_spillway_message():
    out = cuda_script("""
        torch.cuda.set_per_process_memory_fraction(0.01)
        try:
            torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
            print("no error")
        except torch.cuda.OutOfMemoryError as e:
            print("oom", "Spillway: out of memory" in str(e))
    """)
    assert "oom True" in out, out


@needs_adapter
def test_out_of_memory_observers_hear_the_request_and_the_limit():
    """Hooks review: observers were told the allocated bytes for the request and the device's total
    for the memory the process may use, although a fraction was set."""
    out = cuda_script("""
        torch.cuda.set_per_process_memory_fraction(0.01)
        heard = []
        torch._C._cuda_attach_out_of_memory_observer(lambda *args: heard.append(args))
        try:
            torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            pass
        total = torch.cuda.get_device_properties(0).total_memory
        device, request, allowed, free = heard[0]
        print("heard", len(heard), device, request == 2 << 30,
              abs(allowed - total * 0.01) < 2 << 20, 0 < free <= total)
    """)
    assert "heard 1 0 True True True" in out, out


RECORD_STREAM_SCRIPT = """
        torch.cuda.memory._record_memory_history(max_entries=1000)
        side = torch.cuda.Stream()
        x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        ptr = x.data_ptr()
        # Both kernels once first: CUDA loads a kernel lazily at its first launch, and that load
        # may wait for the device, which ended the side stream's sleep before record_stream (the
        # control failed so on an H200, 2026-12-04: "side busy False").
        with torch.cuda.stream(side):
            torch.cuda._sleep(1)
            x.add_(1)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000_000)  # keep the side stream busy (about half a second)
            x.add_(1)
        x.record_stream(side)
        del x
        y = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        print("side busy", not side.query())
        print("not reused while pending", y.data_ptr() != ptr)
        # What happened to x's block, for the failure message: a free_completed before y's alloc
        # means the free did not wait for the side stream.
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        print("history", [(e["action"], e["stream"]) for e in trace if e["addr"] == ptr])
        print("stats", {k: v for k, v in torch.cuda.memory_stats().items()
                        if k in ("num_sync_all_streams", "num_alloc_retries")})
        side.synchronize()
"""


@needs_adapter
def test_record_stream_holds_reuse_back_until_the_stream_is_done():
    # The control: PyTorch's own allocator must pass the same script, or its premise is wrong.
    control = cuda_script(RECORD_STREAM_SCRIPT, install=False)
    assert "side busy True" in control, "control: the side stream was done too soon: " + control
    assert "not reused while pending True" in control, "control (PyTorch's allocator): " + control
    out = cuda_script(RECORD_STREAM_SCRIPT)
    assert "side busy True" in out, "the side stream was done too soon: " + out
    assert "not reused while pending True" in out, out


@needs_adapter
def test_memory_snapshot_and_history_have_python_frames():
    out = cuda_script("""
        torch.cuda.memory._record_memory_history(max_entries=1000)
        def make_it():
            return torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
        x = make_it()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        blocks = [b for s in snap["segments"] for b in s["blocks"]
                  if b["state"] == "active_allocated"]
        print("block", any(b["size"] >= 5 << 20 for b in blocks))
        allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
        print("frames", any(any(f["name"] == "make_it" for f in e["frames"]) for e in allocs))
    """)
    assert "block True" in out and "frames True" in out, out


@needs_adapter
def test_unsupported_features_raise_clear_errors():
    out = cuda_script("""
        g = torch.cuda.CUDAGraph()
        x = torch.ones(4, device="cuda")
        try:
            with torch.cuda.graph(g):
                y = x * 2
            print("captured")
        except RuntimeError as e:
            print("graph error", "does not support private memory pools" in str(e))
    """)
    assert "graph error True" in out, out
