"""Shared fixtures. The whole suite runs in one process on the simulated device (installed once:
Spillway allows one install per process); tests that need another capacity or the environment
hook run a script in a subprocess."""

import os
import subprocess
import sys
import textwrap

# One intra-op thread, here and in the scripts the tests start (they inherit the variable), set
# before torch starts its thread pools. Runs are compared bitwise, and on a loaded machine torch's
# CPU kernels do not always reduce in the same order: beside two busy processes, plain PyTorch
# (Spillway not imported) trained the demo's model to two sets of losses in 12 runs, the other
# one a one-thread run's (2026-12-07: the "contention bug" of 2026-12-04, docs/reliability.md). One
# thread also keeps OpenMP's spinning barriers from slowing the suite beside scripts/test's lanes.
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import spillway  # noqa: E402

torch.set_num_threads(1)  # also where something imported torch before this file

SIM_CAPACITY = 2 << 30


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "models: trains third-party model code (transformers, torch.compile) at a size "
        "that takes seconds a run; the sanitizer build's run of the suite leaves these out "
        "(scripts/test): they drive the engine along the paths the smaller tests cover")
    config.addinivalue_line(
        "markers", "packaging: builds and installs the package afresh (pip), without the "
        "sanitizers: the sanitizer build's run of the suite leaves it out (scripts/test), as it "
        "would test nothing of that build and take minutes")


@pytest.fixture(scope="session", autouse=True)
def sim_device():
    spillway.install("sim", capacity_bytes=SIM_CAPACITY)
    yield


@pytest.fixture(autouse=True)
def offload_settings_restored():
    """The outermost offload block's settings stay in force after it (for backward): each test
    starts from the settings the one before it found."""
    before = spillway._C.offload_config()
    yield
    spillway._C.configure_offload(before["policy"], before["budget_bytes"],
                                  before["budget_fraction"], before["min_bytes"],
                                  before["prefetch_bytes"])


@pytest.fixture(autouse=True)
def deterministic():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def stat(name):
    return spillway.memory_stats()[name]


def run_script(source, env=None, timeout=300):
    """Runs `source` in a fresh interpreter (the one running the tests), with the build's package
    importable; returns the CompletedProcess."""
    full_env = dict(os.environ)
    for var in ("SPILLWAY_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        full_env.pop(var, None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def grads_of(module):
    return [p.grad.clone() for p in module.parameters()]


def assert_bitwise_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max()
