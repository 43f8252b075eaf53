"""The package's entry points: install rules, argument checks, statistics."""

import textwrap

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
    ({"device": torch.device("cuda", 0)}, "device must be 'cuda' or 'sim'"),
    ({"device": "sim", "capacity_bytes": -5}, "capacity_bytes must be a positive"),
    ({"device": "sim", "capacity_bytes": 1000}, "multiple of 1 MiB"),
    ({"device": "cuda", "capacity_bytes": 1 << 20}, "applies to device='sim' only"),
    ({"device": "sim", "conf": 42}, "conf must be a string"),
])
def test_install_checks_its_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        spillway.install(**kwargs)


def test_install_takes_a_torch_device_for_cuda():
    """Helper review: install(device=torch.device("cuda")) was refused as no device at all."""
    result = run_script("""
        import torch, spillway
        try:
            spillway.install(device=torch.device("cuda"))
        except Exception as error:
            print(type(error).__name__, error)
    """)
    assert result.returncode == 0, result.stderr
    if torch.cuda.is_available():
        assert result.stdout == ""
    else:
        assert result.stdout.startswith("RuntimeError spillway.install(device='cuda'): this torch "
                                        "has no usable CUDA"), result.stdout


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "fast"}, "policy must be one of off, eager, auto"),
    ({"budget_bytes": -1}, "budget_bytes must be a positive"),
    ({"budget_bytes": 0}, "budget_bytes must be a positive"),
    ({"min_bytes": 1.5}, "min_bytes must be an int"),
    ({"prefetch_bytes": True}, "prefetch_bytes must be an int"),
])
def test_offload_checks_its_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        spillway.offload(**kwargs)  # when the block is made, not when it is entered


def test_one_offload_block_serves_every_step_nested_and_as_a_decorator():
    """User review: offload() was a one-shot generator context manager (a second `with` on the same
    object raised AttributeError), unlike save_on_cpu and torchtune's OffloadActivations."""
    block = spillway.offload("eager", min_bytes=0)
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(64, 256)
    reference = torch.autograd.grad((x @ w).tanh().sum(), w)[0]
    spills = spillway.memory_stats()["spillway.num_spills"]
    # Each backward waits for the spills' copies first (synchronize): a save read while its copy
    # is still running is taken back, and after two such runs eager's next run of the forward
    # keeps it on the device (ForwardSpillQuota), which would leave a use of the block that
    # spills nothing.
    for _ in range(2):
        with block:
            loss = (x @ w).tanh().sum()
        spillway.synchronize()
        assert torch.equal(torch.autograd.grad(loss, w)[0], reference)
    with block:
        with block:  # the same object, nested
            loss = (x @ w).tanh().sum()
    spillway.synchronize()
    assert torch.equal(torch.autograd.grad(loss, w)[0], reference)

    @block
    def forward():
        return (x @ w).tanh().sum()

    loss = forward()
    spillway.synchronize()
    assert torch.equal(torch.autograd.grad(loss, w)[0], reference)
    assert spillway.memory_stats()["spillway.num_spills"] >= spills + 4


def test_memory_stats_has_pytorch_and_spillway_keys():
    stats = spillway.memory_stats()
    for key in ["allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
                "requested_bytes.all.current", "num_ooms", "num_alloc_retries",
                "spillway.num_spills", "spillway.spilled_bytes.current", "spillway.bytes_to_host",
                "spillway.host_bytes.peak", "spillway.num_prefetch_hits", "spillway.stall_us",
                "spillway.num_taken_back", "spillway.bytes_taken_back",
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
    assert (spillway.memory_stats()["reserved_bytes.all.current"]
            < stats["reserved_bytes.all.current"])


def test_numpy_integers_and_device_strings_are_taken_as_torch_takes_them():
    """User review: numpy integers were refused as "must be an int number of bytes", and device
    strings such as "cuda:0" (torch.cuda's functions take them) as not an index."""
    import numpy as np
    with spillway.offload("off", min_bytes=np.int64(1 << 20), prefetch_bytes=np.uint32(1 << 22),
                          budget_bytes=np.int32(1 << 26)):
        config = spillway._C.offload_config()
    assert (config["min_bytes"], config["prefetch_bytes"], config["budget_bytes"]) == \
        (1 << 20, 1 << 22, 1 << 26)
    expected = spillway.memory_stats(0)["num_device_alloc"]
    for device in ("cuda:0", "cuda", torch.device("cuda", 0), np.int64(0), "cpu", None):
        assert spillway.memory_stats(device)["num_device_alloc"] == expected, device
        spillway.reset_peak_stats(device)
    with pytest.raises(ValueError, match="'gpu:x' is not a device string"):
        spillway.memory_stats("gpu:x")
    with pytest.raises(ValueError, match="'meta' is not one Spillway serves"):
        spillway.memory_stats("meta")
    spillway.record_history(True, max_entries=np.int64(1000))
    spillway.record_history(False)


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


# A CUDA torch, as far as install() can tell, with CUDA not yet initialized.
FAKE_CUDA_TORCH = """
import torch
import spillway
torch.version.cuda = "12.1"
torch.cuda.is_available = lambda: True
torch.cuda.is_initialized = lambda: False
"""


def test_a_cuda_install_with_no_route_to_torch_leaves_nothing_installed():
    """Review: with neither the c10 adapter nor CUDAPluggableAllocator (a CUDA torch before 2.0),
    the runtime was switched to CUDA before the torch side failed: installed() said "cuda" while
    PyTorch's own allocator served everything, and a second install returned silently."""
    if spillway._C.has_cuda_allocator():
        pytest.skip("this build has the c10 adapter")
    result = run_script(FAKE_CUDA_TORCH + textwrap.dedent("""
        if hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
            del torch.cuda.memory.CUDAPluggableAllocator
        for attempt in range(2):
            try:
                spillway.install("cuda")
                print("installed")
            except RuntimeError as error:
                print("ERR", error)
        print("mode", spillway.installed())
    """))
    lines = result.stdout.splitlines()
    assert lines[:2] == ["ERR spillway.install(device='cuda'): this build has no c10 allocator "
                         f"adapter and torch {torch.__version__} has no CUDAPluggableAllocator; "
                         "build Spillway against a CUDA torch 2.4 or later"] * 2, result
    assert lines[2] == "mode None", result


def test_a_cuda_install_whose_route_fails_leaves_nothing_installed():
    """Review: when the route into torch failed after the runtime had switched to CUDA (here
    CUDAPluggableAllocator cannot load the library), installed() said "cuda" with PyTorch's own
    allocator serving everything, and a retry returned silently."""
    if spillway._C.has_cuda_allocator():
        pytest.skip("this build has the c10 adapter")
    result = run_script(FAKE_CUDA_TORCH + textwrap.dedent("""
        class Unloadable:
            def __init__(self, *args):
                raise OSError("libcudart.so.12: cannot open shared object file")
        torch.cuda.memory.CUDAPluggableAllocator = Unloadable
        torch.cuda.memory.change_current_allocator = lambda allocator: None  # torch >= 2.0 has it
        for attempt in range(2):
            try:
                spillway.install("cuda")
                print("installed")
            except OSError as error:
                print("ERR", error)
            print("mode", spillway.installed())
        # The allocator the first attempt made keeps its settings: a retry asking for others is
        # refused rather than run with settings it did not ask for.
        try:
            spillway.install("cuda", conf="max_split_size_mb:64")
        except ValueError as error:
            print("REFUSED", error)
        print("mode", spillway.installed())
    """))
    assert result.stdout.splitlines()[:4] == [
        "ERR libcudart.so.12: cannot open shared object file", "mode None"] * 2, result
    assert result.stdout.splitlines()[4].startswith("REFUSED spillway.install: an earlier install "
                                                    "in this process failed"), result
    assert "max_split_size_mb:64" in result.stdout.splitlines()[4], result
    assert result.stdout.splitlines()[5] == "mode None", result


def test_cuda_allocator_adapter_needs_a_cuda_install():
    # Here (simulated device installed) the adapter cannot be installed, whichever build this is.
    with pytest.raises(Exception, match="install Spillway for device \"cuda\" first|no c10 CUDA"):
        spillway._C.install_cuda_allocator()
    if torch.version.cuda is None:
        assert spillway._C.has_cuda_allocator() is False


# Review of the entry points' argument checks: each was accepted (or failed deep inside) before.

def test_a_negative_device_index_is_refused_by_every_helper():
    for call in (spillway.memory_stats, spillway.reset_peak_stats, spillway.budget_bytes,
                 lambda d: spillway.set_per_process_memory_fraction(0, d)):
        with pytest.raises(ValueError, match="device index -2 is out of range"):
            call(-2)


def test_budget_bytes_checks_the_device_index_when_a_budget_is_configured():
    # A configured budget is the same on every device: the engine answered it for any index.
    result = run_script("""
        import spillway
        spillway.install("sim", conf="offload_budget_mb:64", capacity_bytes=256 << 20)
        print("budget", spillway.budget_bytes(0))
        for device in (-2, 3):
            try:
                print("accepted", device, spillway.budget_bytes(device))
            except ValueError as error:
                print("refused", device, error)
    """)
    assert result.returncode == 0, result.stderr
    assert f"budget {64 << 20}" in result.stdout
    assert "refused -2 device index -2 is out of range" in result.stdout, result.stdout
    assert "refused 3 device index 3 is out of range" in result.stdout, result.stdout


@pytest.mark.parametrize("fraction", [-0.5, 1.5, float("nan"), float("inf")])
def test_a_fraction_outside_zero_to_one_is_refused(fraction):
    with pytest.raises(ValueError, match=r"fraction must be a number in \[0, 1\]"):
        spillway.set_per_process_memory_fraction(fraction)


def test_a_zero_or_tiny_fraction_leaves_nothing_to_allocate_and_one_gives_it_back():
    """As in PyTorch: 0, or a fraction too small for any allocation, leaves nothing to allocate
    (0 used to remove the limit, and a tiny fraction rounded to that); 1 is the whole device."""
    result = run_script("""
        import numpy, torch, spillway
        spillway.install("sim", capacity_bytes=64 << 20)
        for fraction in (1e-9, 0, 1, numpy.float32(0.5)):
            spillway.set_per_process_memory_fraction(fraction)
            try:
                x = torch.empty(256 << 10, dtype=torch.uint8)
                del x
                print(fraction, "allocated")
            except torch.cuda.OutOfMemoryError:
                print(fraction, "out of memory")
    """)
    assert result.returncode == 0, result.stderr
    for line in ("1e-09 out of memory", "0 out of memory", "1 allocated", "0.5 allocated"):
        assert line in result.stdout, result.stdout


@pytest.mark.parametrize("call", [
    lambda: spillway.record_history("no"),
    lambda: spillway.record_history(1),
    lambda: spillway.release(torch.zeros(4), force="no"),
    lambda: spillway.release(torch.zeros(4), force=0),
])
def test_booleans_must_be_booleans(call):
    with pytest.raises(ValueError, match=r"(enabled|force) must be True(,| or) False.*, got"):
        call()


def test_release_with_a_string_force_frees_nothing():
    t = torch.ones(1000)
    with pytest.raises(ValueError, match="force must be True or False"):
        spillway.release(t, force="no")
    assert t.sum().item() == 1000


def test_numpy_and_torch_booleans_are_booleans():
    import numpy

    spillway.record_history(numpy.bool_(True), max_entries=10)
    spillway.record_history(torch.tensor(False))
    t = torch.ones(10)
    assert spillway.release(t, force=numpy.bool_(False))["freed_bytes"] == 40


def test_record_history_takes_torch_2x_spellings():
    """torch 2.x's _record_memory_history takes enabled="all" to record and None to stop."""
    spillway.record_history("all", max_entries=1000)
    try:
        x = torch.empty(3 << 20, dtype=torch.uint8)
        trace = spillway.snapshot()["device_traces"][0]
        assert any(e["action"] == "alloc" and e["addr"] == x.data_ptr() for e in trace)
    finally:
        spillway.record_history(None)
    before = len(spillway.snapshot()["device_traces"][0])
    y = torch.empty(3 << 20, dtype=torch.uint8)
    assert len(spillway.snapshot()["device_traces"][0]) == before, "None did not stop recording"
    del x, y
    with pytest.raises(ValueError,
                       match=r"enabled='state' .* is not supported.*pass 'all' or True"):
        spillway.record_history("state")
    with pytest.raises(ValueError, match=r"stacks='all' .* is not supported.*'python' or 'none'"):
        spillway.record_history("all", stacks="all")
    with pytest.raises(ValueError, match=r"enabled must be True, False, 'all' or None, got 'All'"):
        spillway.record_history("All")


@pytest.mark.parametrize("max_entries", [0, -1, 10_000_001, 1 << 62, 2.5, True])
def test_max_entries_is_a_bounded_number_of_entries(max_entries):
    with pytest.raises(ValueError, match=r"max_entries must be a positive int number of entries, "
                                         r"at most 10000000 \(as for the history_entries key\)"):
        spillway.record_history(True, max_entries=max_entries)


def test_byte_counts_past_64_bits_are_a_clear_error():
    with pytest.raises(ValueError, match=r"budget_bytes must be at most 2\*\*63 - 1 bytes, got"):
        with spillway.offload(budget_bytes=1 << 70):
            pass
    with pytest.raises(ValueError, match=r"prefetch_bytes must be at most 2\*\*63 - 1 bytes"):
        with spillway.offload(prefetch_bytes=1 << 64):
            pass


def test_dump_snapshot_wants_a_path(tmp_path):
    # An int was taken by open() as a file descriptor, and the snapshot written there.
    with open(tmp_path / "by_descriptor", "wb") as f:
        for path in (f.fileno(), None, 3.5):
            with pytest.raises(ValueError, match="path must be a str or os.PathLike, got"):
                spillway.dump_snapshot(path)
    assert (tmp_path / "by_descriptor").stat().st_size == 0


def test_dump_snapshot_takes_a_pathlike(tmp_path):
    path = tmp_path / "snap.pickle"
    assert spillway.dump_snapshot(path) == path
    assert path.stat().st_size > 0


def test_an_install_that_names_nothing_new_is_the_same_install():
    """User review: installs asking for the same thing were refused when their text differed (a
    script's install("sim") died under SPILLWAY_ALLOC_CONF=device:sim)."""
    result = run_script("""
        import spillway
        spillway.install(conf="device:sim,offload:eager,capacity_mb:64")  # device from conf
        print("installed", spillway.installed())
        for kwargs in ({"device": "sim", "conf": "offload:eager", "capacity_bytes": 64 << 20},
                       {"device": "sim"}, {"conf": "capacity_mb:64,device:sim"},
                       {"device": "sim", "conf": "offload_min_kb:1024"}, {},
                       {"conf": "offload:eager"}):
            spillway.install(**kwargs)
            print("same install", kwargs)
        for kwargs in ({"device": "sim", "capacity_bytes": 128 << 20},
                       {"device": "sim", "conf": "offload:auto"}, {"device": "cuda"}):
            try:
                spillway.install(**kwargs)
            except ValueError as error:
                print("refused", kwargs, error)
    """)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "installed sim" in out, out
    assert out.count("same install") == 6, out
    assert ("refused {'device': 'sim', 'capacity_bytes': 134217728} spillway is already installed "
            '(device=sim, conf="device:sim,offload:eager,capacity_mb:64")') in out, out
    assert "refused {'device': 'sim', 'conf': 'offload:auto'} spillway is already" in out, out
    assert "refused {'device': 'cuda'} spillway is already" in out, out


def test_a_cuda_install_whose_configuration_names_sim_is_a_conflict_first():
    result = run_script("""
        import spillway
        try:
            spillway.install("cuda", conf="device:sim")
        except ValueError as error:
            print("refused", error)
    """)
    assert result.returncode == 0, result.stderr
    assert ("refused spillway.install(device='cuda') conflicts with the configuration's device "
            "key in 'device:sim'") in result.stdout, result.stdout


def test_a_capacity_that_conflicts_with_the_configuration_is_refused():
    result = run_script("""
        import spillway
        for conf, capacity in (("capacity_mb:30", 256 << 20), ("capacity_mb: 64", 64 << 20)):
            try:
                spillway.install("sim", conf=conf, capacity_bytes=capacity)
                print("installed", conf, spillway.memory_stats()["reserved_bytes.all.current"])
            except ValueError as error:
                print("refused", conf, error)
    """)
    assert result.returncode == 0, result.stderr
    assert ('refused capacity_mb:30 spillway.install(capacity_bytes=268435456) conflicts with the '
            'configuration\'s capacity_mb key in "capacity_mb:30" (30 MiB)') in result.stdout, \
        result.stdout
    assert "installed capacity_mb: 64" in result.stdout, result.stdout
