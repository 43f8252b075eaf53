"""The package's entry points: install rules, argument checks, statistics."""

import pytest
import torch

import spillway
from conftest import SIM_CAPACITY, run_script


def test_repeating_the_same_install_is_a_no_op():
    spillway.install("sim", capacity_bytes=SIM_CAPACITY)
    assert spillway.installed() == "sim"


def test_a_different_install_is_refused():
    with pytest.raises(ValueError, match="already installed"):
        spillway.install("sim", capacity_bytes=SIM_CAPACITY // 2)


@pytest.mark.parametrize("kwargs, message", [
    ({"device": "tpu"}, "device must be 'cuda' or 'sim'"),
    ({"device": "sim", "capacity_bytes": -5}, "capacity_bytes must be a positive"),
    ({"device": "sim", "capacity_bytes": 1000}, "multiple of 1 MiB"),
    ({"device": "cuda", "capacity_bytes": 1 << 20}, "applies to device='sim' only"),
    ({"device": "sim", "conf": 42}, "conf must be a string"),
])
def test_install_checks_its_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        spillway.install(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "fast"}, "policy must be one of off, eager, auto"),
    ({"budget_bytes": -1}, "budget_bytes must be a positive"),
    ({"budget_bytes": 0}, "budget_bytes must be a positive"),
    ({"min_bytes": 1.5}, "min_bytes must be an int"),
    ({"prefetch_bytes": True}, "prefetch_bytes must be an int"),
])
def test_offload_checks_its_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        with spillway.offload(**kwargs):
            pass


def test_memory_stats_has_pytorch_and_spillway_keys():
    stats = spillway.memory_stats()
    for key in ["allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
                "requested_bytes.all.current", "num_ooms", "num_alloc_retries",
                "spillway.num_spills", "spillway.spilled_bytes.current", "spillway.bytes_to_host",
                "spillway.host_bytes.peak", "spillway.num_prefetch_hits", "spillway.stall_us",
                "spillway.skipped.small", "spillway.skipped.no_pinned",
                "spillway.skipped.host_limit"]:
        assert key in stats, key


def test_memory_stats_follow_tensors():
    before = spillway.memory_stats()["allocated_bytes.all.current"]
    t = torch.empty(1 << 20, dtype=torch.uint8)
    assert spillway.memory_stats()["allocated_bytes.all.current"] - before == 1 << 20
    del t
    assert spillway.memory_stats()["allocated_bytes.all.current"] == before


def test_reset_peak_and_empty_cache():
    t = torch.empty(64 << 20, dtype=torch.uint8)
    del t
    spillway.reset_peak_stats()
    stats = spillway.memory_stats()
    assert stats["allocated_bytes.all.peak"] == stats["allocated_bytes.all.current"]
    spillway.empty_cache()
    assert spillway.memory_stats()["reserved_bytes.all.current"] < stats["reserved_bytes.all.current"]


def test_bad_device_index_is_a_value_error():
    with pytest.raises(ValueError, match="device index 3 is out of range"):
        spillway.memory_stats(3)


def test_cuda_install_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = run_script("""
        import spillway
        try:
            spillway.install("cuda")
        except RuntimeError as error:
            print("ERR", error)
    """)
    assert "ERR spillway.install(device='cuda'): this torch has no usable CUDA" in result.stdout, \
        result.stderr


def test_cuda_allocator_adapter_needs_a_cuda_install():
    # Here (simulated device installed) the adapter cannot be installed, whichever build this is.
    with pytest.raises(Exception, match="install Spillway for device \"cuda\" first|no c10 CUDA"):
        spillway._C.install_cuda_allocator()
    if torch.version.cuda is None:
        assert spillway._C.has_cuda_allocator() is False
