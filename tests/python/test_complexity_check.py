"""bench/complexity.py: the instructions-per-operation check scripts/test runs under valgrind.

A stand-in `valgrind` on PATH writes cachegrind's output format with counts from a chosen cost
model, so the check's arithmetic and its verdicts are tested without valgrind's minutes."""

import os
import stat
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "complexity.py")

FAKE_VALGRIND = textwrap.dedent("""\
    #!{python}
    import sys
    args = sys.argv[1:]
    out = next(a.split("=", 1)[1] for a in args if a.startswith("--cachegrind-out-file="))
    live, pairs = int(args[-2]), int(args[-1])
    model = {model!r}
    if model == "crash":
        sys.exit("valgrind: simulated failure")
    per_op = {{"flat": 1000, "log": 1000 + 100 * len(str(live)), "linear": live}}[model]
    setup = 123456 + 7 * live  # the same in both runs: the difference cancels it
    ir = setup + 2 * pairs * per_op
    ll = 2 * pairs * (live // 1000)  # misses grow with the live set; never checked
    with open(out, "w") as f:
        f.write("desc: I1 cache\\ncmd: x\\nevents: Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw\\n")
        f.write(f"summary: {{ir}} 0 0 0 {{2 * pairs}} {{ll}} 0 0 0\\n")
    """)


def run_check(tmp_path, model, *extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    valgrind = bin_dir / "valgrind"
    valgrind.write_text(FAKE_VALGRIND.format(python=sys.executable, model=model))
    valgrind.chmod(valgrind.stat().st_mode | stat.S_IEXEC)
    build = tmp_path / "build"
    (build / "bench").mkdir(parents=True, exist_ok=True)
    churn = build / "bench" / "spillway_churn_count"
    churn.write_text("#!/bin/sh\nexit 0\n")
    churn.chmod(churn.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run([sys.executable, SCRIPT, str(build), "--pairs", "1000", *extra],
                          capture_output=True, text=True, env=env)


def test_flat_cost_passes_and_reports_per_operation_counts(tmp_path):
    result = run_check(tmp_path, "flat", "--json", str(tmp_path / "out.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = result.stdout.splitlines()
    assert rows[2] == "| 1000 | 1000 | 1.00 | 1.00 | 1.00 | 1.00 |"
    assert rows[4] == "| 100000 | 1000 | 1.00 | 1.67 | 1.00 | 100.00 |"
    assert "within log n" in rows[-1]
    assert (tmp_path / "out.json").exists()


def test_logarithmic_growth_passes(tmp_path):
    result = run_check(tmp_path, "log")
    assert result.returncode == 0, result.stdout + result.stderr


def test_linear_growth_fails_and_names_the_sizes(tmp_path):
    result = run_check(tmp_path, "linear")
    assert result.returncode == 1
    assert "faster than log n at 10000, 100000 live allocations" in result.stdout


def test_a_failing_valgrind_run_is_reported(tmp_path):
    result = run_check(tmp_path, "crash")
    assert result.returncode != 0
    assert "simulated failure" in result.stderr


@pytest.mark.parametrize("pairs", ["10", "-5"])
def test_too_few_pairs_is_refused(tmp_path, pairs):
    result = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--pairs", pairs],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "expected an integer >= 1000" in result.stderr
