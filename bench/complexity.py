"""Counts what RandomAllocations costs per operation at 1k, 10k and 100k live allocations.

Wall-clock time on a shared machine swings with the neighbours (the 100k case waits on memory,
and the last-level cache is shared), so the log-n property of the allocator is checked here on
counts that do not: valgrind's cachegrind runs `spillway_churn_count` with a fixed cache model,
twice per size (PAIRS and 2 x PAIRS steady-state pairs), and the difference divided by the
operations gives instructions and cache misses per operation. Fails when instructions per
operation grow faster than log(live) from 1k: the mark of a linear scan on the hot path. (The
bound applies to the whole operation, about 1000 instructions, so it catches scans and other
large growth, not a slowly growing term of a few dozen instructions.)
Cache misses are reported, not checked: they grow with the live set by nature.

usage: complexity.py BUILD_DIR [--pairs N] [--json OUT]
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

SIZES = (1000, 10000, 100000)
# A fixed cache model, so the counts are the same on every machine: 32 KiB L1s and a 1 MiB
# last level (this machine's per-core L2).
CACHE_MODEL = ["--I1=32768,8,64", "--D1=32768,8,64", "--LL=1048576,16,64"]


def count(binary, live, pairs, workdir):
    out = os.path.join(workdir, f"cg.{live}.{pairs}")
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", *CACHE_MODEL,
           f"--cachegrind-out-file={out}", binary, str(live), str(pairs)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"complexity: {' '.join(cmd)} failed ({run.returncode}):\n{run.stderr[-2000:]}")
    events = summary = None
    with open(out) as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("summary:"):
                summary = [int(v) for v in line.split()[1:]]
    if events is None or summary is None:
        sys.exit(f"complexity: no summary in {out}")
    counts = dict(zip(events, summary))
    missing = [e for e in ("Ir", "D1mr", "D1mw", "DLmr", "DLmw") if e not in counts]
    if missing:
        sys.exit(f"complexity: {out} lacks the events {', '.join(missing)}")
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build_dir")
    parser.add_argument("--pairs", type=int, default=100000,
                        help="steady-state pairs per measurement, >= 1000 (default 100000)")
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args()
    if args.pairs < 1000:
        parser.error(f"--pairs {args.pairs}: expected an integer >= 1000")
    binary = os.path.join(args.build_dir, "bench", "spillway_churn_count")
    if not os.access(binary, os.X_OK):
        sys.exit(f"complexity: {binary} not found; build first (scripts/build)")
    if shutil.which("valgrind") is None:
        sys.exit("complexity: valgrind not found; run scripts/setup")

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for live in SIZES:
            a = count(binary, live, args.pairs, workdir)
            b = count(binary, live, 2 * args.pairs, workdir)
            ops = 2 * args.pairs  # a free and a malloc per pair
            per_op = {k: (b[k] - a[k]) / ops for k in a}
            rows.append({
                "live": live,
                "instructions_per_op": per_op["Ir"],
                # A difference of two runs can come out a hair below zero where there are no
                # misses at all; a count is never negative.
                "l1_misses_per_op": max(0.0, per_op["D1mr"] + per_op["D1mw"]),
                "ll_misses_per_op": max(0.0, per_op["DLmr"] + per_op["DLmw"]),
            })

    base = rows[0]
    failed = []
    print("| live | instructions / op | x 1k | log-n limit | L1 misses / op "
          "| 1 MiB LL misses / op |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ratio = row["instructions_per_op"] / base["instructions_per_op"]
        limit = math.log(row["live"]) / math.log(base["live"])
        row["ratio"] = ratio
        row["limit"] = limit
        if ratio > limit:
            failed.append(row["live"])
        print(f"| {row['live']} | {row['instructions_per_op']:.0f} | {ratio:.2f} | {limit:.2f} | "
              f"{row['l1_misses_per_op']:.2f} | {row['ll_misses_per_op']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if failed:
        print(f"complexity: instructions per operation grow faster than log n at "
              f"{', '.join(map(str, failed))} live allocations")
        return 1
    print("complexity: instructions per operation within log n from 1k to 100k live")
    return 0


if __name__ == "__main__":
    sys.exit(main())
