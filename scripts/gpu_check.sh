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
# Every step runs even when an earlier one failed (a failed build skips what needs it); the exit
# status is non-zero when any step failed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$(date +%s)
build=$root/build-gpu
py=${SPILLWAY_GPU_PYTHON:-python3}
declare -a summary=()
failed=0

elapsed() { echo $(($(date +%s) - start)); }
record() {  # record STEP RESULT DETAIL
  summary+=("$(printf '| %-32s | %-7s | %s |' "$1" "$2" "$3")")
  [ "$2" = FAIL ] && failed=1
  echo "[$(elapsed) s] $1: $2 $3"
}
run_step() {  # run_step LOGNAME TIMEOUT_S CMD...: output to OUTDIR/LOGNAME.log
  local log=$out/$1.log limit=$2
  shift 2
  timeout "$limit" "$@" >"$log" 2>&1
}

# --- environment ---------------------------------------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$py" -c 'import torch, sys; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())' 2>&1
  (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | tail -1
  echo "cores $(nproc)"
} >"$out/env.txt"
cat "$out/env.txt"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
torch_line=$(grep '^torch' "$out/env.txt")
record "environment" INFO "${gpu:-no GPU}, driver ${driver:-?}; $torch_line"

# --- dependencies: the system's, else build-deps/ from scripts/gpu_deps ------------------------
# torch's CMake configuration looks for the CUDA toolkit's nvcc.
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH" \
  CUDAToolkit_ROOT=${CUDAToolkit_ROOT:-/usr/local/cuda}
deps=$root/build-deps/prefix/usr
prefix_path=""
if [ -d "$deps" ]; then
  prefix_path="$deps/lib/x86_64-linux-gnu/cmake;$deps/lib/cmake;$deps"
  export LD_LIBRARY_PATH="$deps/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if ! "$py" -c 'import pytest' 2>/dev/null && [ -d "$deps/lib/python3/dist-packages" ]; then
  export PYTHONPATH="$deps/lib/python3/dist-packages${PYTHONPATH:+:$PYTHONPATH}"
fi

# --- build -----------------------------------------------------------------------------------
built=0
if run_step build 330 bash -c "
    cmake -S '$root' -B '$build' -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DPython3_EXECUTABLE=\"\$(command -v $py)\" -DSPILLWAY_WITH_FUZZ=OFF \
      -DCMAKE_PREFIX_PATH='$prefix_path' &&
    cmake --build '$build' -j $(nproc)"; then
  built=1
  adapter=no
  [ -x "$build/bench/spillway_native_compare_bench" ] && adapter=yes
  record "build" PASS "$(elapsed) s; c10 adapter: $adapter"
else
  record "build" FAIL "see build.log (last lines: $(tail -3 "$out/build.log" | tr '\n' ' ' | cut -c1-150))"
fi

# --- C++ suites ------------------------------------------------------------------------------
if [ $built = 1 ]; then
  run_step ctest 150 ctest --test-dir "$build" --output-on-failure -j 8 --timeout 120
  rc=$?
  counts=$(grep -E "tests passed|tests failed" "$out/ctest.log" | tail -1)
  skipped=$(grep -c "\*\*\*Skipped\|Not Run" "$out/ctest.log")
  cuda_run=$(grep -E "Conformance.*Cuda|/Cuda|cuda" "$out/ctest.log" | grep -c "Passed")
  record "C++ suites" "$([ $rc = 0 ] && echo PASS || echo FAIL)" \
    "$counts; $skipped skipped; $cuda_run CUDA cases passed"
fi

# --- pytest: simulated device + cuda + NCCL smoke -------------------------------------------
if [ $built = 1 ]; then
  run_step pytest 240 env PYTHONPATH="$build/python:$root/bench${PYTHONPATH:+:$PYTHONPATH}" \
    SPILLWAY_PYTHON_SITE="$build/python-site" \
    "$py" -m pytest -q -p no:cacheprovider -rs --junitxml="$out/pytest.xml" "$root/tests/python"
  rc=$?
  record "pytest (sim + cuda)" "$([ $rc = 0 ] && echo PASS || echo FAIL)" \
    "$(tail -1 "$out/pytest.log")"
  nccl=$(grep -o 'name="test_nccl[^"]*"[^>]*>\(<skipped\|<failure\|<error\)\?' "$out/pytest.xml" 2>/dev/null | head -1)
  case "$nccl" in
    "") record "NCCL smoke (1 GPU)" FAIL "not found in pytest.xml" ;;
    *"<skipped"*) record "NCCL smoke (1 GPU)" SKIP "see pytest.log" ;;
    *"<failure"* | *"<error"*) record "NCCL smoke (1 GPU)" FAIL "see pytest.log" ;;
    *) record "NCCL smoke (1 GPU)" PASS "" ;;
  esac
fi

# --- benchmarks ------------------------------------------------------------------------------
if [ $built = 1 ] && [ -x "$build/bench/spillway_native_compare_bench" ]; then
  if run_step native_compare_bench 150 "$build/bench/spillway_native_compare_bench" \
      --benchmark_min_time=0.2 --benchmark_out="$out/native_compare.json" \
      --benchmark_out_format=json; then
    "$py" "$root/bench/compare_native.py" "$out/native_compare.json" >"$out/native_compare.md"
    record "native vs Spillway (C++)" PASS "table in native_compare.md"
  else
    record "native vs Spillway (C++)" FAIL "see native_compare_bench.log"
  fi
elif [ $built = 1 ]; then
  record "native vs Spillway (C++)" FAIL "no adapter: torch must be a CUDA build >= 2.4"
fi
if [ $built = 1 ]; then
  run_step allocator_bench_cuda 60 "$build/bench/spillway_allocator_bench" \
    --benchmark_filter=/cuda --benchmark_min_time=0.1 \
    --benchmark_out="$out/allocator_bench_cuda.json" --benchmark_out_format=json
  rc=$?
  cases=$(grep -c '"name": ".*/cuda/' "$out/allocator_bench_cuda.json" 2>/dev/null)
  if [ $rc = 0 ] && [ "${cases:-0}" -gt 0 ]; then
    record "allocator bench (CUDA backend)" PASS "$cases results in allocator_bench_cuda.json"
  else
    record "allocator bench (CUDA backend)" FAIL "no CUDA results: see allocator_bench_cuda.log"
  fi
  rm -f "$root/bench/results/train_step_cuda.json"
  if run_step train_step_bench 200 env PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" \
      "$py" "$root/bench/run_bench.py" --quick &&
      [ -f "$root/bench/results/train_step_cuda.json" ]; then
    cp "$root"/bench/results/train_step_cuda.* "$out/"
    record "training-step bench (cuda)" PASS "table in train_step_bench.log"
  else
    record "training-step bench (cuda)" FAIL "see train_step_bench.log (no CUDA results)"
  fi
fi

# --- summary (last) --------------------------------------------------------------------------
{
  echo
  echo "Spillway GPU check, $(date -u +%Y-%m-%d), $(elapsed) s"
  echo "| step                             | result  | detail |"
  echo "|----------------------------------|---------|--------|"
  printf '%s\n' "${summary[@]}"
  if [ -f "$out/native_compare.md" ]; then
    echo
    cat "$out/native_compare.md"
  fi
} | tee "$out/summary.md"
exit $failed
