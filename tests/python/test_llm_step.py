"""bench/llm_step.py end to end on the simulated device (the CPU smoke of scripts/gpu_bench.sh):
every configuration has its rows, Spillway's losses equal the reference's bitwise, Spillway
spills, the plot is a PNG, and the out-of-memory frontier is reported."""

import importlib.util
import json
import os
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
    # the reference's frontier), and said how long it stalled.
    for config in bench.SPILLWAY:
        spilled = [r for r in rows if r["config"] == config and r["status"] == "ok"
                   and r.get("to_host_per_step", 0) > 0]
        assert spilled, config
        assert all("stall_per_step_s" in r for r in spilled)
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
