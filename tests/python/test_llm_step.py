"""bench/llm_step.py end to end on the simulated device (the CPU smoke of scripts/gpu_bench.sh):
every configuration has its rows, Spillway's losses equal the reference's bitwise, Spillway
spills, the plot is a PNG, and the out-of-memory frontier is reported."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import types

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                     "llm_step.py")


def load_bench():
    """bench/llm_step.py's parts, as a namespace: the configurations (llm_step_common) and the
    report (llm_step_report)."""
    spec = importlib.util.spec_from_file_location("llm_step", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts bench/ on sys.path, where its parts are
    import llm_step_common
    import llm_step_report
    return types.SimpleNamespace(**vars(llm_step_common), **{
        name: getattr(llm_step_report, name) for name in ("annotate", "flops_per_step")})


@pytest.mark.models
def test_llm_step_on_the_simulated_device(tmp_path):
    env = dict(os.environ)
    for var in ("SPILLWAY_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(var, None)
    result = subprocess.run([sys.executable, BENCH, "--device", "sim", "--out", str(tmp_path),
                             "--budget-s", "75"], env=env, capture_output=True, text=True,
                            timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(tmp_path / "llm_step.json") as f:
        data = json.load(f)
    bench = load_bench()
    rows, models = data["rows"], data["meta"]["models"]
    assert set(models) == {"llama-w4096", "llama-1b"}
    assert data["meta"]["elapsed_s"] < 75 + 10

    def rows_of(model, config):
        return [r for r in rows if r["model"] == model and r["config"] == config]

    for model in models:
        for config, _ in bench.CONFIGS:
            mine = rows_of(model, config)
            assert mine, (model, config)
            if config in bench.HOST_OFFLOAD:
                # Host memory offloaded to host memory: n/a here, with the reason.
                assert [r["status"] for r in mine] == ["unavailable"], mine
                assert "n/a on the simulated device" in mine[0]["reason"]
                continue
            assert any(r["status"] == "ok" for r in mine), (model, config, mine)
        reference = {r["seq"]: r for r in rows_of(model, "pytorch") if r["status"] == "ok"}
        assert reference, model
        for config in bench.SPILLWAY:
            ok = [r for r in rows_of(model, config) if r["status"] == "ok"]
            for r in ok:
                if r["seq"] in reference:
                    assert r["losses"] == reference[r["seq"]]["losses"], (model, config, r["seq"])
                    assert r["losses_vs_reference"] == "bitwise equal"
    # Every Spillway configuration spilled (auto's default budget only where it has to: past
    # the reference's frontier), and said how long it stalled. The simulated device's link has
    # its default bandwidth, and each row that moved bytes has its bound against it.
    link = data["meta"]["link"]
    assert link["sim_link_mb_per_s"] == bench.SIM_LINK_MB_PER_S
    assert link["d2h_gbps"] == link["h2d_gbps"] == bench.SIM_LINK_MB_PER_S * bench.MIB / 1e9
    references = {(r["model"], r["seq"]): r for r in rows
                  if r["config"] == "pytorch" and r["status"] == "ok"}
    for config in bench.SPILLWAY:
        spilled = [r for r in rows if r["config"] == config and r["status"] == "ok"
                   and r.get("to_host_per_step", 0) > 0]
        assert spilled, config
        assert all("stall_per_step_s" in r for r in spilled)
        for r in spilled:
            if "bound" not in r:  # a length past every trained reference length is FLOPs-scaled
                continue
            assert r["bound"]["d2h_s"] == pytest.approx(
                r["to_host_per_step"] / (bench.SIM_LINK_MB_PER_S * bench.MIB))
            assert r["step_over_bound"] == pytest.approx(r["median_step_s"] / r["bound"]["bound_s"])
            # Memory held counts the blocks whose spill was still copying, which allocated
            # bytes leave out; the forward's time gives the peak its bound.
            assert r["peak_active"] >= r["peak_allocated"], r
            ref = references.get((r["model"], r["seq"]))
            if config not in bench.CHECKPOINTED and ref is not None:
                assert r["bound"]["forward_s"] == ref["median_forward_s"]
                assert r["bound"]["bound_s"] >= r["bound"]["peak_bound_s"]
        assert any("bound" in r for r in spilled), config
    # The frontier: the reference ran out of memory within the lengths tried, and Spillway
    # trained a longer length than it on some model.
    front = {(e["model"], e["config"]): e for e in data["frontier"]}
    assert len(front) == len(models) * len(bench.CONFIGS)
    longer = False
    for model in models:
        ref = front[(model, "pytorch")]
        assert ref["stopped"].startswith("out of memory at"), ref
        for config in bench.SPILLWAY:
            e = front[(model, config)]
            longer |= e["longest"] is not None and e["longest"] > ref["longest"]
    assert longer, data["frontier"]
    with open(tmp_path / "llm_step.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "llm_step.md").read_text()
    assert "Out-of-memory frontier" in table and "| Spillway eager |" in table
    # The summary comes last.
    assert "OOM frontier" in result.stdout.split("llm_step summary")[-1]


@pytest.mark.models
def test_the_simulated_link_holds_copies_to_its_bandwidth(tmp_path):
    # At 16 MiB/s the link, not the CPU, sets eager's first step: its bytes to the host take
    # longer to cross than the whole step takes with an unlimited link. Without the link model
    # the step would be several times shorter than its bytes' crossing time. One step: the first
    # forward spills every save (eager's bound comes from the forwards before).
    result = run_bench(tmp_path / "one", "--budget-s", "60", "--configs", "pytorch",
                       "spillway_eager", "--models", "llama-w4096", "--seqs", "llama-w4096:64",
                       "--sim-link-mb-per-s", "16", "--min-job-s", "1", "--steps", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "one" / "llm_step.json").read_text())
    assert data["meta"]["link"]["sim_link_mb_per_s"] == 16
    [eager] = [r for r in data["rows"] if r["config"] == "spillway_eager"]
    assert eager["status"] == "ok" and eager["losses_vs_reference"] == "bitwise equal", eager
    crossing = eager["to_host_per_step"] / (16 * (1 << 20))
    assert crossing > 2 * eager["bound"]["compute_s"], eager
    assert eager["median_step_s"] >= crossing, eager
    assert eager["bound"]["link_bound_s"] == pytest.approx(
        max(crossing, eager["to_device_per_step"] / (16 * (1 << 20))))
    assert eager["bound"]["bound_s"] >= eager["bound"]["link_bound_s"]
    summary = result.stdout.split("llm_step summary")[-1]
    assert "the simulated device's, 16 MiB/s each way" in summary

    # Over four steps the spills that backward took back (still copying) in the first two tell
    # the later forwards how much the link carries before backward: they send less, and take
    # nothing like as long (ForwardSpillQuota), with the same losses. (Measured 2026-12-07: the
    # timed steps 0.40, 0.041, 0.040 s; 2.3 MiB to the host per step, 2.0 taken back.)
    result = run_bench(tmp_path / "four", "--budget-s", "60", "--configs", "pytorch",
                       "spillway_eager", "--models", "llama-w4096", "--seqs", "llama-w4096:64",
                       "--sim-link-mb-per-s", "16", "--min-job-s", "1", "--steps", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "four" / "llm_step.json").read_text())
    [bounded] = [r for r in data["rows"] if r["config"] == "spillway_eager"]
    assert bounded["losses_vs_reference"] == "bitwise equal", bounded
    assert bounded["to_host_per_step"] < eager["to_host_per_step"] / 2, (bounded, eager)
    assert bounded["taken_back_per_step"] < eager["taken_back_per_step"] / 2, (bounded, eager)
    assert bounded["median_step_s"] < crossing, (bounded, eager)


def test_physical_bound_and_losses_against_the_reference():
    bench = load_bench()
    model = dict(params=1000, vocab_size=10, hidden_size=4, layers=2, batch=1,
                 tie_word_embeddings=False)

    def row(config, seq, step, to_host=None, losses=(1.0, 0.5)):
        r = {"model": "m", "config": config, "seq": seq, "status": "ok", "median_step_s": step,
             "peak_allocated": 100, "losses": list(losses)}
        if to_host is not None:
            r.update(to_host_per_step=to_host, to_device_per_step=to_host / 2)
        return r

    rows = [row("pytorch", 128, 1.0), row("spillway_eager", 128, 3.0, to_host=20e9),
            row("spillway_eager", 256, 2.0, to_host=1e9, losses=(1.0, 0.25))]
    link = {"d2h_gbps": 10.0, "h2d_gbps": 4.0}
    bench.annotate(rows, {"m": model}, link)
    at_128, at_256 = rows[1], rows[2]
    assert at_128["losses_vs_reference"] == "bitwise equal"
    assert at_128["bound"]["bound_s"] == pytest.approx(2.5)  # 10 GB back at 4 GB/s
    assert at_128["step_over_bound"] == pytest.approx(1.2)
    # No reference at 256: its compute time is scaled by FLOPs from 128.
    scale = bench.flops_per_step(model, 256) / bench.flops_per_step(model, 128)
    assert at_256["bound"]["compute_s"] == pytest.approx(scale)
    assert "FLOPs-scaled from 128" in at_256["bound"]["compute_basis"]
    assert at_256["losses_vs_reference"] == "no reference at this length"


def test_memory_saved_is_read_from_memory_held_and_the_peak_bounds_the_step():
    bench = load_bench()
    model = dict(params=1000, vocab_size=10, hidden_size=4, layers=2, batch=1,
                 tie_word_embeddings=False)
    gb = 1e9
    ref = {"model": "m", "config": "pytorch", "seq": 128, "status": "ok", "median_step_s": 1.0,
           "median_forward_s": 0.3, "peak_allocated": 100 * gb, "peak_active": 100 * gb,
           "losses": [1.0]}
    # Its spills freed 60 GB by the allocator's count, but 20 GB of them were still copying at
    # the peak: 40 GB held below the reference, which had to cross each way around the peak.
    auto = {"model": "m", "config": "spillway_auto_half", "seq": 128, "status": "ok",
            "median_step_s": 21.0, "median_forward_s": 5.0, "peak_allocated": 40 * gb,
            "peak_active": 60 * gb, "losses": [1.0], "to_host_per_step": 12 * gb,
            "to_device_per_step": 6 * gb}
    old = dict(auto, config="spillway_eager")  # a row of a run from before peak_active
    del old["peak_active"]
    rows = [ref, auto, old]
    bench.annotate(rows, {"m": model}, {"d2h_gbps": 10.0, "h2d_gbps": 4.0})
    assert auto["saved_fraction"] == pytest.approx(0.4)
    assert old["saved_fraction"] == pytest.approx(0.6)
    bound = auto["bound"]
    assert bound["link_bound_s"] == pytest.approx(1.5)  # 6 GB back at 4 GB/s
    assert bound["saved_at_peak"] == 40 * gb
    # max(forward 0.3, 40 GB / 10 GB/s) + max(the rest 0.7, 40 GB / 4 GB/s)
    assert bound["peak_bound_s"] == pytest.approx(14.0)
    assert bound["bound_s"] == pytest.approx(14.0)
    assert auto["step_over_bound"] == pytest.approx(1.5)
    # Without a base row at its length (FLOPs-scaled) the peak's bound is not given.
    longer = dict(auto, seq=256)
    bench.annotate([ref, longer], {"m": model}, {"d2h_gbps": 10.0, "h2d_gbps": 4.0})
    assert "peak_bound_s" not in longer["bound"]
    assert longer["bound"]["bound_s"] == longer["bound"]["link_bound_s"]


# --- what the GPU run depends on, checked here (issue #37's first GPU run gets one try) -----------

def load_parts():
    """bench/llm_step.py itself (the parent) and its child's part, llm_step_job."""
    spec = importlib.util.spec_from_file_location("llm_step", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import llm_step_job
    return module, llm_step_job


def run_bench(tmp_path, *args, env_extra=None, timeout=120):
    env = dict(os.environ)
    for var in ("SPILLWAY_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(var, None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, BENCH, "--device", "sim", "--out", str(tmp_path),
                           *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.models
def test_a_job_that_overruns_is_killed_within_the_matrix_budget(tmp_path):
    # One length of 400 steps cannot finish in the budget. The job used to be killed only at its
    # share plus --grace-s, past the budget, where gpu_bench.sh's timeout kills the parent
    # before it writes anything; now it is killed at the budget and the report follows.
    budget = 25
    result = run_bench(tmp_path, "--budget-s", str(budget), "--configs", "pytorch", "--models",
                       "llama-w4096", "--seqs", "llama-w4096:256", "--capacity-mb",
                       "llama-w4096:256", "--steps", "400", "--min-job-s", "1",
                       "--grace-s", "120", timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "llm_step.json").read_text())
    assert data["meta"]["elapsed_s"] < budget + 8, data["meta"]["elapsed_s"]
    [row] = [r for r in data["rows"] if r["config"] == "pytorch"]
    assert row["status"] == "no_time" and row["reason"].startswith("killed after"), row
    assert "llm_step summary" in result.stdout


@pytest.mark.models
def test_sigterm_writes_the_rows_that_ran_and_the_summary(tmp_path):
    # gpu_bench.sh's timeout sends SIGTERM to the process group, the job's child included: what
    # ran must still come back, and the job cut short says "no time", not "error".
    env = dict(os.environ)
    for var in ("SPILLWAY_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(var, None)
    proc = subprocess.Popen(
        [sys.executable, BENCH, "--device", "sim", "--out", str(tmp_path), "--budget-s", "120",
         "--configs", "pytorch", "spillway_eager", "spillway_auto", "checkpoint", "--models",
         "llama-1b", "--seqs", "llama-1b:64,128", "--steps", "30", "--min-job-s", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.strip().endswith("pytorch / llama-1b: 64:ok, 128:ok"):
                os.killpg(proc.pid, signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert code == 124, out
    data = json.loads((tmp_path / "llm_step.json").read_text())
    assert "stopped by signal" in data["meta"]["stopped"]
    status = {(r["config"], r["seq"]): r["status"] for r in data["rows"]}
    assert status[("pytorch", 64)] == status[("pytorch", 128)] == "ok", status
    assert status[("checkpoint", 64)] == "no_time", status
    assert "error" not in status.values(), status
    assert "Cut short" in (tmp_path / "llm_step.md").read_text()
    assert "llm_step summary: " in out.split("writing what ran")[-1]


@pytest.mark.models
def test_a_plot_that_fails_leaves_the_tables_and_the_summary(tmp_path):
    # matplotlib is carried to the GPU machine only while build-deps/ has room for it.
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    out = tmp_path / "out"
    result = run_bench(out, "--budget-s", "40", "--configs", "pytorch", "--models", "llama-1b",
                       "--seqs", "llama-1b:64", env_extra={
                           "PYTHONPATH": os.pathsep.join([str(fake),
                                                          os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (out / "llm_step.json").exists() and (out / "llm_step.md").exists()
    assert not (out / "llm_step.png").exists()
    summary = result.stdout.split("llm_step summary")[-1]
    assert "no llm_step.png (ImportError: no matplotlib here)" in summary


def test_job_window_ends_every_job_within_the_matrix_budget():
    llm_step, _ = load_parts()
    # Early in the matrix: the job's share, then the grace for a length in progress.
    assert llm_step.job_window(0, 400, 30, 20) == (30, 50)
    # The last job: killed at the budget, its own deadline the grace before.
    assert llm_step.job_window(370, 400, 30, 20) == (380, 400)


def test_determinism_leaves_uninitialized_memory_unfilled():
    # With determinism on, torch.empty writes NaN first, on the CPU for the host-offload peers'
    # pinned buffers (save_on_cpu's pack hook): GBs a step that only their rows would pay.
    import torch
    import torch.utils.deterministic as deterministic

    _, job = load_parts()
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              deterministic.fill_uninitialized_memory)
    try:
        assert job.set_determinism(torch, "off") == "off"
        assert deterministic.fill_uninitialized_memory == before[2]
        assert job.set_determinism(torch, "strict") == "strict"
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert deterministic.fill_uninitialized_memory is False
        assert job.set_determinism(torch, "warn") == "warn_only"
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        deterministic.fill_uninitialized_memory = before[2]


def test_strict_fallback_retries_once_the_failed_attempt_is_released():
    # The failed attempt's frames hold its activations: a retry inside the except block would
    # start with them still on the device.
    import weakref

    _, job = load_parts()

    class Activations:
        pass

    attempts, relaxed = [], []

    def train():
        held = Activations()
        attempts.append(weakref.ref(held))
        if len(attempts) == 1:
            raise RuntimeError("foo_backward_cuda does not have a deterministic implementation")
        assert attempts[0]() is None, "the failed attempt's tensors are still alive"
        return "trained"

    result, why = job.train_with_fallback(train, lambda: relaxed.append(1), strict=True)
    assert (result, relaxed) == ("trained", [1])
    assert "does not have a deterministic implementation" in why
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        job.train_with_fallback(lambda: (_ for _ in ()).throw(
            RuntimeError("CUDA out of memory")), lambda: None, strict=True)


TORCHTUNE_OFFLOADING = '''
import torch
import torchao
from torch.autograd.graph import saved_tensors_hooks
from torchao.dtypes.nf4tensor import NF4Tensor
from torchtune.modules import TiedLinear
from torchtune.utils import get_logger

log = get_logger("DEBUG")


class OffloadActivations(saved_tensors_hooks):
    def __init__(self, use_pin_memory=True):
        super().__init__(lambda t: t, lambda t: t)


class NoOpManager(saved_tensors_hooks):
    def __init__(self):
        super().__init__(lambda t: t, lambda t: t)
'''


def test_torchtune_offloading_loads_from_its_file_when_the_package_does_not_import(
        tmp_path, monkeypatch):
    # torchtune 0.6.1's `import torchtune` needs torchao's nf4tensor (gone from torchao 0.18),
    # sentencepiece, tiktoken...: the row would say "does not import" on the GPU machine.
    _, job = load_parts()
    package = tmp_path / "torchtune"
    (package / "training").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('torchao not installed')\n")
    (package / "training" / "__init__.py").write_text("")
    (package / "training" / "_activation_offloading.py").write_text(TORCHTUNE_OFFLOADING)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n.split(".")[0] in ("torchtune", "torchao")]:
        monkeypatch.delitem(sys.modules, name)
    offload, noop, note = job.load_torchtune_offloading()
    assert offload.__name__ == "OffloadActivations" and noop.__name__ == "NoOpManager"
    assert "loaded alone" in note and "torchao not installed" in note
    # The stand-ins are gone again.
    assert not [n for n in sys.modules if n.split(".")[0] in ("torchtune", "torchao")]
    (package / "training" / "_activation_offloading.py").unlink()
    with pytest.raises(job.Unavailable, match="torchao not installed"):
        job.load_torchtune_offloading()


def test_host_memory_estimate_of_the_peers():
    llm_step, _ = load_parts()
    gib = 1 << 30
    models = {"m": dict(params=2 * gib, dtype_bytes=2, seqs=[1024, 2048, 4096])}

    def row(config, seq, **more):
        return dict(model="m", config=config, seq=seq, status="ok", **more)

    # The reference's peak above its resident state counts the gradients too (8 GiB at 1024).
    rows = [row("pytorch", 1024, peak_allocated=30 * gib, base_allocated=20 * gib),
            row("spillway_eager", 1024, to_host_per_step=2 * gib, host_peak=2 * gib),
            row("spillway_eager", 2048, to_host_per_step=4 * gib, host_peak=4 * gib),
            # Held at its host_limit_mb: not all of its activations went to the host.
            row("spillway_eager", 4096, to_host_per_step=7 * gib, host_peak=7.5 * gib)]
    limit = 8 * gib
    act, basis = llm_step.host_bytes_estimate(rows, "m", models, "torchtune", 2048, limit)
    assert act == 4 * gib and basis == "Spillway eager's bytes to the host"
    act, basis = llm_step.host_bytes_estimate(rows, "m", models, "trl", 4096, limit)
    assert act == 8 * gib and "at 2048, scaled" in basis
    # save_on_cpu copies the weights that layers save, too.
    act, basis = llm_step.host_bytes_estimate(rows, "m", models, "save_on_cpu", 2048, limit)
    assert act == 8 * gib and "4.0 GiB of weights" in basis
    # No eager row: the reference's activation memory.
    act, basis = llm_step.host_bytes_estimate(rows[:1], "m", models, "trl", 2048, limit)
    assert act == 20 * gib and "the reference's" in basis


def test_device_memory_wait():
    _, job = load_parts()
    gib = 1 << 30
    seen = iter([10 * gib, 40 * gib, 78 * gib, 79 * gib])
    sleeps = []
    waited, free = job.wait_for_device_memory(lambda: (next(seen), 80 * gib), 79 * gib, 30,
                                              sleep=sleeps.append)
    assert free == 78 * gib and len(sleeps) == 2  # within 2 GiB of what the plan saw
    waited, free = job.wait_for_device_memory(lambda: (1, 80 * gib), None, 30)
    assert free == 1 and waited < 1


def test_bounds_without_a_measured_link():
    bench = load_bench()
    rows = [{"model": "m", "config": "pytorch", "seq": 8, "status": "ok", "median_step_s": 1.0,
             "peak_allocated": 10, "losses": [1.0]},
            {"model": "m", "config": "save_on_cpu", "seq": 8, "status": "ok",
             "median_step_s": 2.0, "peak_allocated": 5, "losses": [1.0],
             "to_host_per_step": 100, "to_device_per_step": 100}]
    bench.annotate(rows, {"m": {}}, {"device_total": 1, "error": "RuntimeError: no pinning"})
    assert "bound" not in rows[1] and rows[1]["saved_fraction"] == 0.5


def test_report_of_a_run_with_some_configurations():
    # docs/gpu.md's retry runs `--configs pytorch spillway_eager ...`: the tables used to look
    # up every configuration's frontier and stopped at the first not run.
    import llm_step_report as report

    load_bench()
    models = {"m": dict(label="m", params=1e9, batch=1, seqs=[8, 16], capacity_mb=1)}
    rows = [{"model": "m", "config": "pytorch", "seq": 8, "status": "ok", "median_step_s": 1.0,
             "tokens_per_s": 8.0, "peak_allocated": 10, "peak_reserved": 12, "losses": [1.0]},
            {"model": "m", "config": "pytorch", "seq": 16, "status": "oom", "reason": "OOM"}]
    meta = {"device": "sim", "device_name": "sim", "date": "today", "torch": "t",
            "transformers": "t", "python": "p", "steps": 3, "determinism": "n/a",
            "elapsed_s": 1.0, "budget_s": 2.0, "link": {"reason": "n/a"}}
    report.annotate(rows, models, None)
    front = report.frontier(rows, models, ["pytorch"])
    table = report.markdown(meta, rows, models, front)
    assert "| PyTorch allocator, no offload (reference) | 8 (out of memory at 16) |" in table
    assert "Spillway eager" not in report.summary(meta, rows, models, front)


def cuda_job(params):
    """llm_step, and job_spec's arguments for a CUDA run of a model "m" of `params` bf16
    parameters on an 80 GiB device: (llm_step, args, models, link)."""
    llm_step, _ = load_parts()
    gib = 1 << 30
    args = types.SimpleNamespace(device="cuda", steps=3, seed=0, deterministic="strict",
                                 host_fraction=0.3, sim_link_mb_per_s=0)
    models = {"m": dict(params=params, dtype_bytes=2, seqs=[1024, 2048], layers=4)}
    link = {"device_total": 80 * gib, "device_free": 79 * gib, "d2h_gbps": 50.0}
    return llm_step, args, models, link


def test_cuda_job_spec_caps_the_peers_by_host_memory():
    gib = 1 << 30
    llm_step, args, models, link = cuda_job(8 * gib)
    rows = [dict(model="m", config="spillway_eager", seq=1024, status="ok",
                 to_host_per_step=10 * gib, host_peak=10 * gib)]
    host = 128 * gib
    trl = llm_step.job_spec(args, models, "m", "trl", rows, link, host, 0)
    assert trl["device_free"] == 79 * gib and trl["host_limit_mb"] == int(0.3 * host) >> 20
    assert trl["skip"] == {}  # 20 GiB at 2048, under 38.4 GiB
    # save_on_cpu also pins the 16 GiB of weights its hook sees: 36 GiB at 2048 still fits,
    # and 26 at 1024.
    assert llm_step.job_spec(args, models, "m", "save_on_cpu", rows, link, host, 0)["skip"] == {}
    models["m"]["params"] = 12 * gib
    skip = llm_step.job_spec(args, models, "m", "save_on_cpu", rows, link, host, 0)["skip"]
    assert list(skip) == ["2048"] and "24.0 GiB of weights" in skip["2048"]


def test_auto_budgets_lie_above_the_gradients():
    """Auto's half and quarter budgets are fractions of the activations above what backward holds
    whatever is spilled: the resident state and the weights' gradients. Counted from the
    resident state alone (the reference's peak above it counts gradients too), the quarter budget
    fell below the gradients on the simulated device and could not be kept."""
    gib = 1 << 30
    # 2 Gi bf16 parameters: 4 GiB of gradients; the reference peaks 10 GiB above 20 resident.
    llm_step, args, models, link = cuda_job(2 * gib)
    rows = [dict(model="m", config="pytorch", seq=1024, status="ok", peak_allocated=30 * gib,
                 base_allocated=20 * gib)]

    def budgets(config):
        spec = llm_step.job_spec(args, models, "m", config, rows, link, 128 * gib, 0)
        return spec["budgets"], spec["budget_basis"]

    quarter, basis = budgets("spillway_auto_quarter")
    half, _ = budgets("spillway_auto_half")
    # 6 GiB of activations at 1024; at 2048 the activations scale, the gradients do not.
    assert quarter == {"1024": int(25.5 * gib), "2048": 27 * gib}
    assert half == {"1024": 27 * gib, "2048": 30 * gib}
    assert "measured" in basis["1024"] and "scaled from 1024" in basis["2048"]
    assert "4096 MiB of gradients" in basis["1024"]
    # No reference row: fractions of the device above the resident state and the gradients.
    rows.clear()
    quarter, basis = budgets("spillway_auto_quarter")
    resident = 3 * 2 * gib * 2  # three times the weights' bytes
    assert quarter["1024"] == int(resident + 4 * gib + 0.25 * (80 * gib - resident - 4 * gib))
    assert basis["1024"].startswith("device memory (no reference)")


def test_next_length_guess_follows_the_training_flops():
    llm_step, job = load_parts()
    w4096 = dict(llm_step.MODELS["cuda"]["llama-w4096"], layers=36, params=8.903e9)
    # Nearly all of a width-4096 stack's FLOPs are its weights': twice the length, about twice
    # the time (a fixed length^1.5 said 2.8 times, and cut Spillway's longest length for time).
    assert 2.0 < job.length_guess(w4096, 2048, 10.0, 4096) / 10.0 < 2.2
    # The 1B shape at 32k-64k tokens is mostly attention's: about three times.
    small = dict(llm_step.MODELS["cuda"]["llama-1b"], params=1.236e9)
    assert 2.8 < job.length_guess(small, 32768, 1.0, 65536) < 3.2
    assert job.length_guess({}, 100, 1.0, 400) == 8.0
