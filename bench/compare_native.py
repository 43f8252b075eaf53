"""Turns spillway_native_compare_bench's JSON (--benchmark_out) into a markdown table: PyTorch's
native CUDA allocator and Spillway's side by side, with the ratio (Spillway / native; below 1 is
faster). Fragmentation is 1 - peak allocated / peak reserved. Where the cases were repeated, the
times are the medians, and the last column their spread (coefficient of variation over the
repetitions, native / Spillway).

    python3 bench/compare_native.py native_compare.json > native_compare.md
"""

import json
import sys


def per_op_ns(bench):
    """Time per operation in ns: the per_op counter where the case has one (seconds), else the
    time of one iteration."""
    if "per_op" in bench:
        return bench["per_op"] * 1e9
    scale = {"ns": 1, "us": 1e3, "ms": 1e6, "s": 1e9}[bench.get("time_unit", "ns")]
    return bench["cpu_time"] * scale


def split_name(bench):
    """(case, allocator, argument) of a run: the benchmark's name, less Google Benchmark's own
    parts (repeats:N, min_time:T)."""
    parts = (bench["run_name"] if "run_name" in bench else bench["name"]).split("/")
    parts = [p for p in parts if not p.startswith(("repeats:", "min_time:"))]
    return parts[0], parts[1], "/".join(parts[2:])


def table(data):
    rows = {}
    spread = {}
    for bench in data["benchmarks"]:
        kind = bench.get("aggregate_name") if bench.get("run_type") == "aggregate" else "run"
        if kind not in ("run", "median", "cv"):
            continue
        case, allocator, arg = split_name(bench)
        if kind == "cv":
            spread.setdefault((case, arg), {})[allocator] = bench
            continue
        by = rows.setdefault((case, arg), {})
        # A median stands for its runs (reported too, without ReportAggregatesOnly).
        if kind == "median" or by.get(allocator, {}).get("aggregate_name") != "median":
            by[allocator] = bench
    lines = ["| case | native ns/op | Spillway ns/op | Spillway / native "
             "| fragmentation native / Spillway | spread native / Spillway |",
             "|---|---|---|---|---|---|"]
    for (case, arg), by in rows.items():
        if "native" not in by or "spillway" not in by:
            continue
        n, s = per_op_ns(by["native"]), per_op_ns(by["spillway"])
        frag = ""
        if "fragmentation" in by["native"]:
            frag = f'{by["native"]["fragmentation"]:.2f} / {by["spillway"]["fragmentation"]:.2f}'
        cv = spread.get((case, arg), {})
        var = ""
        if "native" in cv and "spillway" in cv:
            # The cv of the time per operation: its counter where the case has one.
            key = "per_op" if "per_op" in cv["native"] else "cpu_time"
            var = f'{cv["native"][key]:.0%} / {cv["spillway"][key]:.0%}'
        lines.append(f"| {case} {arg} | {n:.0f} | {s:.0f} | {s / n:.2f} | {frag} | {var} |")
    return "\n".join(lines)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: compare_native.py BENCH_JSON")
    with open(sys.argv[1]) as f:
        data = json.load(f)
    print(table(data))


if __name__ == "__main__":
    main()
