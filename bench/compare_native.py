"""Turns spillway_native_compare_bench's JSON (--benchmark_out) into a markdown table: PyTorch's
native CUDA allocator and Spillway's side by side, with the ratio (Spillway / native; below 1 is
faster). Fragmentation is 1 - peak allocated / peak reserved.

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


def table(data):
    rows = {}
    for bench in data["benchmarks"]:
        if bench.get("run_type") == "aggregate" and bench.get("aggregate_name") != "median":
            continue
        parts = bench["run_name"].split("/") if "run_name" in bench else bench["name"].split("/")
        case, allocator, arg = parts[0], parts[1], "/".join(parts[2:])
        rows.setdefault((case, arg), {})[allocator] = bench
    lines = ["| case | native ns/op | Spillway ns/op | Spillway / native "
             "| fragmentation native / Spillway |",
             "|---|---|---|---|---|"]
    for (case, arg), by in rows.items():
        if "native" not in by or "spillway" not in by:
            continue
        n, s = per_op_ns(by["native"]), per_op_ns(by["spillway"])
        frag = ""
        if "fragmentation" in by["native"]:
            frag = f'{by["native"]["fragmentation"]:.2f} / {by["spillway"]["fragmentation"]:.2f}'
        lines.append(f"| {case} {arg} | {n:.0f} | {s:.0f} | {s / n:.2f} | {frag} |")
    return "\n".join(lines)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: compare_native.py BENCH_JSON")
    with open(sys.argv[1]) as f:
        data = json.load(f)
    print(table(data))


if __name__ == "__main__":
    main()
