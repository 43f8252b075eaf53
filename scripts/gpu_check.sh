#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, a CUDA build of torch (>= 2.4) under its
# python3, cmake and ninja, and no network. Builds Spillway against that torch, runs the C++
# suites (the CUDA conformance cases included), the pytest suite (simulated device and
# device="cuda", the 1-GPU NCCL smoke run included), the native-vs-Spillway allocator benchmark
# and the training-step benchmark on CUDA; writes logs, tables and plots to OUTDIR and prints a
# summary table last. Aims at 8 minutes.
#
#   scripts/gpu_deps                 # beforehand, on a networked Debian 12 machine: build-deps/
#   scripts/gpu_check.sh OUTDIR      # on the GPU machine, with build-deps/ carried along
#
# Every step runs even when an earlier one failed (a failed build skips what needs it; when the
# build against torch fails, a build without the torch layer still runs the C++ suites and the
# CUDA allocator benchmark); the exit status is non-zero when any step failed. The steps share a
# time budget (SPILLWAY_GPU_CHECK_BUDGET_S, default 450 s): each gets at most what is left, and
# one that would start with under 10 s left is reported as NO-TIME, which fails the check.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/gpu_common.sh
source "$root/scripts/gpu_common.sh"  # the step helpers, environment, dependencies and build
gpu_begin "${1:?usage: scripts/gpu_check.sh OUTDIR}" "${SPILLWAY_GPU_CHECK_BUDGET_S:-450}" 32 check
build=$root/build-gpu

# --- environment, dependencies (gpu_common.sh) ------------------------------------------------
gpu_environment ""
gpu_dependencies transformers accelerate pytest pybind11 numpy trl
# pytest from build-deps/prefix (Debian's python3-pytest) for a python3 that lacks it.
if ! "$py" -c 'import pytest' 2>/dev/null && [ -d "$deps/lib/python3/dist-packages" ]; then
  export PYTHONPATH="$deps/lib/python3/dist-packages${PYTHONPATH:+:$PYTHONPATH}"
fi

# --- build -----------------------------------------------------------------------------------
built=0  # 1: with the torch layer; 2: without it (the torch build failed)
if build_step build 330 "$build"; then
  built=1
  adapter=no
  [ -x "$build/bench/spillway_native_compare_bench" ] && adapter=yes
  record "build" PASS "$(elapsed) s; c10 adapter: $adapter"
else
  record "build" FAIL "see build.log (last lines: $(log_end build.log 3))"
  build=$root/build-gpu-notorch
  if build_step build_notorch 200 "$build" -DSPILLWAY_WITH_TORCH=OFF; then
    built=2
    record "build without torch layer" PASS "$(elapsed) s (C++ suites and CUDA bench only)"
  else
    record "build without torch layer" FAIL "see build_notorch.log"
  fi
fi

# --- exports: the toolchain may link libstdc++ statically; none of it may leak ------------------
if [ $built != 0 ]; then
  run_step check_exports 30 "$root/scripts/check_exports" --only "$build"
  rc=$?
  record "shared objects export no C++ runtime" "$(verdict $rc)" "see check_exports.log"
fi

# --- C++ suites ------------------------------------------------------------------------------
if [ $built != 0 ]; then
  # The CUDA cases one at a time, after the rest: a CUDA context another test process creates
  # meanwhile would move the device's free memory under the mem-info case.
  run_step ctest 150 bash -c "ctest --test-dir '$build' --output-on-failure -j 8 --timeout 120 \
    -E CudaTraits; a=\$?; ctest --test-dir '$build' --output-on-failure --timeout 120 \
    -R CudaTraits; b=\$?; exit \$((a || b))"
  rc=$?
  counts=$(grep -E "tests passed|tests failed" "$out/ctest.log" | tr '\n' ' ')
  skipped=$(grep -c "\*\*\*Skipped\|Not Run" "$out/ctest.log")
  cuda_run=$(grep -E "CudaTraits|CudaAllocatorTest" "$out/ctest.log" | grep -c " Passed")
  record "C++ suites" "$(verdict $rc)" \
    "$counts; $skipped skipped; $cuda_run CUDA cases passed"
fi

# --- pytest: simulated device + cuda + NCCL smoke -------------------------------------------
if [ $built = 1 ]; then
  # One process per test file, so that a crash in one (a segfault ends its process) cannot hide
  # the others' results; SPILLWAY_GPU_CHECK_JOBS files at a time (default: half the cores, at
  # most 8; the GPU cases are small: with 4 at a time on 16 cores this step took 193 s).
  mkdir -p "$out/pytest"
  jobs=${SPILLWAY_GPU_CHECK_JOBS:-$(( $(nproc) / 2 ))}
  [ "$jobs" -ge 1 ] || jobs=1
  [ "$jobs" -le 8 ] || jobs=8
  pytest_file() {  # pytest_file DEADLINE FILE: results in OUTDIR/pytest/NAME.{log,xml,rc}
    local name rest
    name=$(basename "$2" .py)
    rest=$(($1 - $(date +%s)))
    if [ "$rest" -lt 5 ]; then
      echo "not run: the check's time budget is spent" >"$out/pytest/$name.log"
      echo 125 >"$out/pytest/$name.rc"
      return
    fi
    timeout "$rest" env PYTHONPATH="$build/python:$root/bench${PYTHONPATH:+:$PYTHONPATH}" \
      SPILLWAY_PYTHON_SITE="$build/python-site" "$py" -m pytest -q -p no:cacheprovider -rfEs \
      --junitxml="$out/pytest/$name.xml" "$2" >"$out/pytest/$name.log" 2>&1
    echo $? >"$out/pytest/$name.rc"
  }
  export -f pytest_file
  export out build
  limit=$(left)
  [ "$limit" -gt 240 ] && limit=240
  rc=0
  bad_files=()
  no_time=()
  if [ "$limit" -lt 10 ]; then
    rc=125
  else
    printf '%s\n' "$root"/tests/python/test_*.py |
      xargs -P "$jobs" -I{} bash -c 'pytest_file "$0" "$1"' "$(($(date +%s) + limit))" {}
    : >"$out/pytest.log"
    for result in "$out"/pytest/*.rc; do
      name=$(basename "$result" .rc)
      file_rc=$(cat "$result")
      echo "$name: exit $file_rc: $(tail -1 "$out/pytest/$name.log")" >>"$out/pytest.log"
      if [ "$file_rc" = 125 ]; then
        no_time+=("$name")
      elif [ "$file_rc" != 0 ]; then
        bad_files+=("$name")
      fi
    done
    [ ${#no_time[@]} -gt 0 ] && rc=125
    [ ${#bad_files[@]} -gt 0 ] && rc=1
  fi
  totals=$(cat "$out"/pytest/*.log 2>/dev/null | grep -oE "[0-9]+ (passed|failed|skipped|errors?|deselected)" |
    awk '{n[$2] += $1} END {for (k in n) printf "%d %s, ", n[k], k}')
  record "pytest (sim + cuda)" "$(verdict $rc)" \
    "${totals%, }${bad_files[*]:+; failing: ${bad_files[*]}}${no_time[*]:+; not run (no time): ${no_time[*]}}"
  # One line per NCCL case (DDP, FSDP): the test case's tag and what follows it in the XML.
  mapfile -t nccl < <(grep -ho 'name="test_nccl[^"]*"[^>]*>\(<skipped\|<failure\|<error\)\?' \
    "$out"/pytest/*.xml 2>/dev/null)
  if [ ${#nccl[@]} -eq 0 ]; then
    record "NCCL smoke (1 GPU)" "$([ $rc = 125 ] && echo NO-TIME || echo FAIL)" "not in the results"
  fi
  for entry in "${nccl[@]}"; do
    label=$(sed -n 's/^name="[^"[]*\[\([^]"]*\)\].*/\1/p' <<<"$entry")
    name="NCCL smoke (1 GPU${label:+, $label})"
    case "$entry" in
      *"<skipped"*) record "$name" SKIP "see pytest.log" ;;
      *"<failure"* | *"<error"*) record "$name" FAIL "see pytest.log" ;;
      *) record "$name" PASS "" ;;
    esac
  done
elif [ $built = 2 ]; then
  record "pytest (sim + cuda)" FAIL "not run: needs the build against torch"
fi

# --- benchmarks ------------------------------------------------------------------------------
if [ $built = 1 ] && [ -x "$build/bench/spillway_native_compare_bench" ]; then
  run_step native_compare_bench 150 "$build/bench/spillway_native_compare_bench" \
    --benchmark_min_time=0.2 --benchmark_out="$out/native_compare.json" \
    --benchmark_out_format=json
  rc=$?
  # The record_stream correctness check the benchmark runs first (native is the control).
  checks=$(grep -o "record_stream check ([a-z]*): [A-Za-z ]*" "$out/native_compare_bench.log" |
    sed 's/record_stream check //' | tr '\n' ';')
  [ -f "$out/native_compare.json" ] &&
    "$py" "$root/bench/compare_native.py" "$out/native_compare.json" >"$out/native_compare.md"
  if [ $rc = 0 ]; then
    record "native vs Spillway (C++)" PASS "record_stream: ${checks%;}; table in native_compare.md"
  else
    record "native vs Spillway (C++)" "$(verdict $rc)" \
      "record_stream: ${checks%;}; see native_compare_bench.log"
  fi
elif [ $built != 0 ]; then
  record "native vs Spillway (C++)" FAIL "no adapter: torch must be a CUDA build >= 2.4"
fi
if [ $built != 0 ]; then
  run_step allocator_bench_cuda 60 "$build/bench/spillway_allocator_bench" \
    --benchmark_filter=/cuda --benchmark_min_time=0.1 \
    --benchmark_out="$out/allocator_bench_cuda.json" --benchmark_out_format=json
  rc=$?
  cases=$(grep -c '"name": ".*/cuda/' "$out/allocator_bench_cuda.json" 2>/dev/null)
  if [ $rc = 0 ] && [ "${cases:-0}" -gt 0 ]; then
    record "allocator bench (CUDA backend)" PASS "$cases results in allocator_bench_cuda.json"
  else
    record "allocator bench (CUDA backend)" "$([ $rc = 125 ] && echo NO-TIME || echo FAIL)" \
      "no CUDA results: see allocator_bench_cuda.log"
  fi
fi
if [ $built = 1 ]; then
  rm -f "$root/bench/results/train_step_cuda.json"
  run_step train_step_bench 200 env PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" \
    "$py" "$root/bench/run_bench.py" --quick
  rc=$?
  [ -f "$root/bench/results/train_step_cuda.json" ] && cp "$root"/bench/results/train_step_cuda.* "$out/"
  if [ $rc = 0 ] && [ -f "$out/train_step_cuda.json" ]; then
    record "training-step bench (cuda)" PASS "table in train_step_bench.log"
  else
    [ $rc = 0 ] && rc=1  # ran, but on no GPU: no CUDA results
    record "training-step bench (cuda)" "$(verdict $rc)" "no CUDA results: see train_step_bench.log"
  fi
fi

# --- summary (last) --------------------------------------------------------------------------
{
  summary_table "Spillway GPU check, $(date -u +%Y-%m-%d), $(elapsed) s"
  if [ -f "$out/native_compare.md" ]; then
    echo
    cat "$out/native_compare.md"
  fi
  if [ -f "$out/train_step_bench.log" ]; then
    echo
    grep '^|' "$out/train_step_bench.log"
  fi
} | tee "$out/summary.md"
exit $failed
