"""bench/compare_native.py: the table gpu_check.sh prints for native vs Spillway; and
bench/pipeline_schedules.py and bench/save_overhead.py run."""

import os

import compare_native
from conftest import run_script

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
PIPELINE_SCHEDULES = os.path.join(BENCH, "pipeline_schedules.py")
SAVE_OVERHEAD = os.path.join(BENCH, "save_overhead.py")


def bench(name, cpu_time, **counters):
    return dict(name=name, run_name=name, run_type="iteration", cpu_time=cpu_time,
                time_unit="ns", **counters)


def test_pairs_native_and_spillway_and_takes_their_ratio():
    data = {"benchmarks": [
        bench("CachedMallocFree/native/4KiB", 200.0),
        bench("CachedMallocFree/spillway/4KiB", 100.0),
        bench("RandomAllocations/native/1000", 999.0, per_op=300e-9),
        bench("RandomAllocations/spillway/1000", 999.0, per_op=450e-9),
        bench("TraceReplay/native/tiny_lm_eager", 5.0, per_op=80e-9, fragmentation=0.25),
        bench("TraceReplay/spillway/tiny_lm_eager", 5.0, per_op=40e-9, fragmentation=0.125),
        bench("MultiStreamRecordStream/native/64KiB", 500.0),  # no Spillway row: left out
    ]}
    lines = compare_native.table(data).splitlines()
    assert lines[2] == "| CachedMallocFree 4KiB | 200 | 100 | 0.50 |  |  |"
    assert lines[3] == "| RandomAllocations 1000 | 300 | 450 | 1.50 |  |  |"
    assert lines[4] == "| TraceReplay tiny_lm_eager | 80 | 40 | 0.50 | 0.25 / 0.12 |  |"
    assert len(lines) == 5


def test_uses_the_median_of_repetitions_and_converts_units():
    data = {"benchmarks": [
        dict(bench("CachedMallocFree/native/4KiB", 9.0), run_type="aggregate",
             aggregate_name="mean"),
        dict(bench("CachedMallocFree/native/4KiB", 0.3), run_type="aggregate",
             aggregate_name="median", time_unit="us"),
        dict(bench("CachedMallocFree/spillway/4KiB", 150.0), run_type="aggregate",
             aggregate_name="median"),
    ]}
    lines = compare_native.table(data).splitlines()
    assert lines[2] == "| CachedMallocFree 4KiB | 300 | 150 | 0.50 |  |  |"


def test_names_lose_the_repeats_part_and_the_spread_is_shown():
    """What the benchmark writes with Repetitions(5) and ReportAggregatesOnly: names carry
    "repeats:5", and each case has its median and its cv, here both per operation."""
    def agg(name, which, per_op):
        return dict(bench(name + "/repeats:5", 1.0, per_op=per_op), run_type="aggregate",
                    aggregate_name=which)
    data = {"benchmarks": [
        agg("TraceReplay/native/tiny_lm_eager/warm", "mean", 1.0),
        agg("TraceReplay/native/tiny_lm_eager/warm", "median", 100e-9),
        agg("TraceReplay/native/tiny_lm_eager/warm", "cv", 0.04),
        agg("TraceReplay/spillway/tiny_lm_eager/warm", "median", 70e-9),
        agg("TraceReplay/spillway/tiny_lm_eager/warm", "cv", 0.125),
        agg("TraceReplay/native/tiny_lm_eager/cold", "median", 200e-9),
        agg("TraceReplay/spillway/tiny_lm_eager/cold", "median", 150e-9),
    ]}
    lines = compare_native.table(data).splitlines()
    assert lines[2] == "| TraceReplay tiny_lm_eager/warm | 100 | 70 | 0.70 |  | 4% / 12% |"
    assert lines[3] == "| TraceReplay tiny_lm_eager/cold | 200 | 150 | 0.75 |  |  |"
    assert len(lines) == 4


def test_a_median_stands_for_the_runs_it_sums_up():
    data = {"benchmarks": [
        bench("CachedMallocFree/native/4KiB/repeats:3", 400.0),
        dict(bench("CachedMallocFree/native/4KiB/repeats:3", 200.0), run_type="aggregate",
             aggregate_name="median"),
        bench("CachedMallocFree/native/4KiB/repeats:3", 900.0),
        dict(bench("CachedMallocFree/spillway/4KiB/repeats:3", 100.0), run_type="aggregate",
             aggregate_name="median"),
    ]}
    lines = compare_native.table(data).splitlines()
    assert lines[2] == "| CachedMallocFree 4KiB | 200 | 100 | 0.50 |  |  |"


def test_pipeline_schedules_runs_every_schedule_bitwise():
    """bench/pipeline_schedules.py (docs/benchmarks.md), small, in a process of its own (it installs
    the simulated device): it exits non-zero when a row with offload differs from the same schedule
    without it."""
    out = run_script(f"""
        import runpy, sys
        sys.argv = ["pipeline_schedules.py", "--steps", "2", "--microbatches", "2"]
        runpy.run_path({PIPELINE_SCHEDULES!r}, run_name="__main__")
    """)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 6, out.stdout  # the header, then two rows per schedule
    assert all(row.rstrip().endswith("| yes |") for row in rows[1:]), out.stdout
    assert sum("Spillway eager" in row for row in rows) == 3, out.stdout


def test_save_overhead_measures_each_scheme_and_spills_only_where_it_says():
    """bench/save_overhead.py (docs/benchmarks.md), small, in a process of its own: every row's
    gradient is bitwise the one without hooks, and only the row that spills every save moved bytes
    to the host (the nothing-spilled row measures the bookkeeping alone)."""
    out = run_script(f"""
        import runpy, sys
        sys.argv = ["save_overhead.py", "--saves", "50", "--repeats", "2"]
        runpy.run_path({SAVE_OVERHEAD!r}, run_name="__main__")
    """)
    assert out.returncode == 0, out.stderr
    rows = [line.strip("| ").split(" | ") for line in out.stdout.splitlines()
            if line.startswith("| ") and "---" not in line][1:]
    assert [row[0] for row in rows] == [
        "no hooks", "torch identity hooks", "torch save_on_cpu", "Spillway off",
        "Spillway eager, nothing spilled", "Spillway eager, every save spilled"], out.stdout
    assert all(row[-1] == "yes" for row in rows), out.stdout
    to_host = {row[0]: float(row[-2]) for row in rows}
    assert to_host.pop("Spillway eager, every save spilled") > 0, out.stdout
    assert set(to_host.values()) == {0.0}, out.stdout
