"""bench/compare_native.py: the table gpu_check.sh prints for native vs Spillway."""

import compare_native


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
    assert lines[2] == "| CachedMallocFree 4KiB | 200 | 100 | 0.50 |  |"
    assert lines[3] == "| RandomAllocations 1000 | 300 | 450 | 1.50 |  |"
    assert lines[4] == "| TraceReplay tiny_lm_eager | 80 | 40 | 0.50 | 0.25 / 0.12 |"
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
    assert lines[2] == "| CachedMallocFree 4KiB | 300 | 150 | 0.50 |  |"
