#!/usr/bin/env bash
# The LLM benchmark on a GPU (issue #37): on a machine with an NVIDIA GPU, a CUDA build of torch
# (>= 2.4) under its python3, cmake and ninja, and no network. Builds Spillway's Python package
# against that torch (no test or benchmark binaries), installs the carried wheels, then runs
# bench/llm_step.py --device cuda: a Llama-architecture model (transformers, random init, bf16,
# SDPA) at a width-4096 size that fills the GPU and at a 1B size, every memory configuration, the
# link's pinned D2H/H2D bandwidth and each row's physical bound. Writes the logs, llm_step.json,
# llm_step.md and llm_step.png to OUTDIR and prints a summary last. One device call:
#
#   scripts/gpu_deps                 # beforehand, on a networked Debian 12 machine: build-deps/
#   scripts/gpu_bench.sh OUTDIR      # on the GPU machine, with build-deps/ carried along
#
# The whole script stays within SPILLWAY_GPU_BENCH_BUDGET_S (default 500 s): the benchmark gets
# what the build leaves, less SPILLWAY_GPU_BENCH_RESERVE_S (default 25 s) for the plot and the
# summary, and its own time budget cuts the configurations that come last (bench/llm_step.py says
# which, row by row). SPILLWAY_GPU_PYTHON names the interpreter (default python3); extra
# arguments after OUTDIR go to bench/llm_step.py (e.g. --models llama-w4096). The environment,
# dependency and build steps are gpu_check.sh's, from scripts/gpu_common.sh. Exit status: non-zero
# when a step failed or had no time.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/gpu_common.sh
source "$root/scripts/gpu_common.sh"  # the step helpers, environment, dependencies and build
gpu_begin "${1:?usage: scripts/gpu_bench.sh OUTDIR [bench/llm_step.py arguments]}" \
  "${SPILLWAY_GPU_BENCH_BUDGET_S:-500}" 28 bench
shift
build=$root/build-gpu-bench
reserve=${SPILLWAY_GPU_BENCH_RESERVE_S:-25}

# --- environment, dependencies (gpu_common.sh; env.txt adds the host's memory) -------------------
# shellcheck disable=SC2317  # gpu_environment calls it
host_memory() { free -g | head -2; }
gpu_environment "; $(nproc) cores" host_memory
gpu_dependencies transformers accelerate trl torchtune torchao matplotlib

# --- build: the Python package only ------------------------------------------------------------
limit=$(($(left) - 120))  # the benchmark needs its two minutes at least
[ "$limit" -gt 300 ] && limit=300
built=0
if [ "$limit" -lt 30 ]; then
  record "build" NO-TIME "$(left) s left of the ${budget} s budget"
elif build_step build "$limit" "$build" -DSPILLWAY_WITH_TESTS=OFF -DSPILLWAY_WITH_BENCH=OFF &&
    [ -d "$build/python/spillway" ]; then
  built=1
  adapter=$(PYTHONPATH="$build/python" "$py" -c \
    'import spillway; print("yes" if spillway._C.has_cuda_allocator() else "no")' 2>&1 | tail -1)
  record "build" PASS "$(elapsed) s; c10 adapter: $adapter"
else
  record "build" FAIL "see build.log (last lines: $(log_end build.log 3))"
fi

# --- the benchmark -------------------------------------------------------------------------------
bench_rc=125
if [ $built = 1 ]; then
  bench_budget=$(($(left) - reserve))
  if [ "$bench_budget" -lt 60 ]; then
    record "llm_step (cuda)" NO-TIME "$(left) s left"
  else
    # Its own budget ends the matrix (no job outlives it); the timeout is for a hang, and its
    # SIGTERM still leaves the rows that ran in llm_step.json and the summary in the log.
    timeout $((bench_budget + reserve - 5)) env \
      PYTHONPATH="$build/python:$root/bench${PYTHONPATH:+:$PYTHONPATH}" \
      "$py" "$root/bench/llm_step.py" --device cuda --out "$out/llm_step" \
      --budget-s "$bench_budget" "$@" >"$out/llm_step.log" 2>&1
    bench_rc=$?
    counts=""
    if [ -f "$out/llm_step/llm_step.json" ]; then
      counts=$("$py" -c 'import collections, json, sys
rows = json.load(open(sys.argv[1]))["rows"]
c = collections.Counter(r["status"] for r in rows)
print(", ".join(f"{n} {k}" for k, n in sorted(c.items())))' "$out/llm_step/llm_step.json" 2>&1 |
        tail -1)
    fi
    if [ $bench_rc = 0 ] && [ -n "$counts" ]; then
      record "llm_step (cuda)" PASS "rows: $counts; tables in llm_step/llm_step.md"
    else
      record "llm_step (cuda)" "$([ $bench_rc = 124 ] && echo NO-TIME || echo FAIL)" \
        "exit $bench_rc${counts:+; rows so far: $counts}; see llm_step.log (last: $(log_end \
        llm_step.log 2))"
    fi
  fi
else
  record "llm_step (cuda)" FAIL "not run: no build"
fi

# --- what comes back stays small: a log past 2 MiB keeps its head and its end --------------------
find "$out" -name '*.log' -size +2M -print0 | while IFS= read -r -d '' log; do
  { head -c 65536 "$log"; printf '\n[... cut by gpu_bench.sh: %s bytes ...]\n' "$(wc -c <"$log")"
    tail -c 1048576 "$log"; } >"$log.cut" && mv "$log.cut" "$log"
done

# --- summary (last) ------------------------------------------------------------------------------
{
  summary_table \
    "Spillway GPU bench (llm_step), $(date -u +%Y-%m-%d), $(elapsed) s of a ${budget} s budget"
  if [ -f "$out/llm_step.log" ]; then
    echo
    sed -n '/^llm_step summary/,$p' "$out/llm_step.log"
  fi
} | tee "$out/summary.md"
exit $failed
