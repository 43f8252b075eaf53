# shellcheck shell=bash
# Shared by scripts/gpu_check.sh and scripts/gpu_bench.sh (source it, with root set to the
# repository): the step helpers and the summary table, the environment report, the dependencies
# (the system's, else build-deps/ from scripts/gpu_deps) and the build against the machine's torch.
# What both scripts do before their own steps is here, so that the two stay in step.
#
# gpu_begin sets the state the helpers share: out (OUTDIR, made, absolute), budget (seconds from
# start), py (the interpreter), summary (the table's rows) and failed (1 once a step failed or had
# no time: the script's exit status).

gpu_begin() {  # gpu_begin OUTDIR BUDGET_S STEP_WIDTH NAME: NAME ("check") names the run in notes
  mkdir -p "$1"
  out=$(cd "$1" && pwd)
  start=$(date +%s)
  budget=$2
  step_width=$3  # the summary's step column
  run_name=$4
  py=${SPILLWAY_GPU_PYTHON:-python3}
  summary=()
  failed=0
}
elapsed() { echo $(($(date +%s) - start)); }
left() { echo $((budget - $(elapsed))); }
record() {  # record STEP RESULT DETAIL
  summary+=("$(printf '| %-*s | %-7s | %s |' "$step_width" "$1" "$2" "$3")")
  # shellcheck disable=SC2034  # failed: the sourcing script's exit status
  case $2 in FAIL | NO-TIME) failed=1 ;; esac
  echo "[$(elapsed) s] $1: $2 $3"
}
run_step() {  # run_step LOGNAME TIMEOUT_S CMD...: output to OUTDIR/LOGNAME.log; 125 = no time
  local log=$out/$1.log limit=$2 rest
  shift 2
  rest=$(left)
  if [ "$rest" -lt 10 ]; then
    echo "not run: the ${run_name}'s ${budget} s budget is spent" >"$log"
    return 125
  fi
  [ "$limit" -gt "$rest" ] && limit=$rest
  timeout "$limit" "$@" >"$log" 2>&1
}
verdict() {  # verdict RC: PASS, FAIL, or NO-TIME when the budget left no time to run it (a
  # failure of the check too: what did not run is not known to pass)
  case $1 in 0) echo PASS ;; 125) echo NO-TIME ;; *) echo FAIL ;; esac
}
log_end() {  # log_end LOGNAME LINES: the log's last lines as one, at most 150 characters
  tail -"$2" "$out/$1" | tr '\n' ' ' | cut -c1-150
}
summary_table() {  # summary_table TITLE: the summary's title, head and rows
  echo
  echo "$1"
  printf '| %-*s | result  | detail |\n' "$step_width" step
  echo "|$(printf '%*s' $((step_width + 2)) '' | tr ' ' -)|---------|--------|"
  printf '%s\n' "${summary[@]}"
}

# --- environment ---------------------------------------------------------------------------
gpu_environment() {  # gpu_environment DETAIL [CMD...]: OUTDIR/env.txt, CMD's output last;
  # printed, and the summary's line, DETAIL at its end
  local more=$1 gpu driver torch_line
  shift
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    "$py" -c 'import torch, sys; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())' 2>&1
    (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | tail -1
    echo "cores $(nproc)"
    echo "nvcc at: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo none)"
    cmake --version 2>&1 | head -1
    "${CXX:-c++}" --version 2>&1 | head -1
    "$py" -c 'import torch.utils; print("torch cmake prefix", torch.utils.cmake_prefix_path)' 2>&1
    [ $# = 0 ] || "$@" 2>&1
  } >"$out/env.txt"
  cat "$out/env.txt"
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  torch_line=$(grep -m1 '^torch [0-9]' "$out/env.txt")
  record "environment" INFO "${gpu:-no GPU}, driver ${driver:-?}; $torch_line$more"
}

# --- dependencies: the system's, else build-deps/ from scripts/gpu_deps ------------------------
pip_wheels() {  # pip_wheels PIP-INSTALL-ARGS...
  local args=(install --no-index --find-links "$wheels" --quiet --no-compile
    --disable-pip-version-check "$@") log rc
  log=$("$py" -m pip "${args[@]}" 2>&1)
  rc=$?
  printf '%s\n' "$log"  # on success too: pip's warnings of conflicts with what was there
  [ $rc = 0 ] && return 0
  case $log in *externally-managed-environment*) ;; *) return 1 ;; esac
  echo "retrying with --break-system-packages"
  "$py" -m pip "${args[@]}" --break-system-packages
}
gpu_dependencies() {  # gpu_dependencies PACKAGE...: sets deps and prefix_path; the wheels step,
  # its summary line naming PACKAGE...'s versions
  local rc torch_was torch_now versions
  # torch's CMake configuration looks for the CUDA toolkit's nvcc.
  [ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH" \
    CUDAToolkit_ROOT=${CUDAToolkit_ROOT:-/usr/local/cuda}
  deps=$root/build-deps/prefix/usr
  prefix_path=""
  if [ -d "$deps" ]; then
    prefix_path="$deps/lib/x86_64-linux-gnu/cmake;$deps/lib/cmake;$deps"
    export LD_LIBRARY_PATH="$deps/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  # Python packages at requirements.txt's pins, from build-deps/wheels alone (gpu_deps wrote the
  # lists there). Into $py's own environment: the machine is new every lease, and its python3 is
  # a venv holding torch, so a --system-site-packages venv made from it would not see torch. A
  # system python3 that refuses (PEP 668) gets --break-system-packages. torch stays: no torch,
  # triton or nvidia-* wheel is there, what needs torch comes --no-deps (nodeps.txt), and it is
  # checked after.
  wheels=$root/build-deps/wheels
  if [ -f "$wheels/requirements.txt" ]; then
    export -f pip_wheels
    export wheels py
    torch_was=$("$py" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1)
    # shellcheck disable=SC2016  # expanded by the child bash
    run_step wheels 120 bash -c 'pip_wheels -r "$wheels/requirements.txt" &&
      pip_wheels --no-deps -r "$wheels/nodeps.txt"'
    rc=$?
    torch_now=$("$py" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1)
    versions=$("$py" -c 'import importlib.metadata as m, sys
def v(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "-"
print(", ".join(n + " " + v(n) for n in sys.argv[1:]))' "$@" 2>&1 | tail -1)
    if [ "$torch_now" != "$torch_was" ]; then
      record "python wheels (build-deps)" FAIL "torch changed: $torch_was -> $torch_now"
    elif [ $rc = 0 ]; then
      record "python wheels (build-deps)" PASS "$versions"
    else
      record "python wheels (build-deps)" "$(verdict $rc)" \
        "now $versions; wheels.log ends: $(log_end wheels.log 3)"
    fi
  else
    record "python wheels (build-deps)" INFO "no build-deps/wheels: the machine's own packages"
  fi
}

# --- build -----------------------------------------------------------------------------------
configure_and_build() {  # configure_and_build BUILD_DIR [CMAKE ARGS...]
  local dir=$1
  shift
  cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DPython3_EXECUTABLE="$(command -v "$py")" -DSPILLWAY_WITH_FUZZ=OFF \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
    -DCMAKE_PREFIX_PATH="$prefix_path" "$@" && cmake --build "$dir" -j "$(nproc)"
}
build_step() {  # build_step LOGNAME TIMEOUT_S BUILD_DIR [CMAKE ARGS...]: run_step's status
  export -f configure_and_build  # run_step runs it under timeout, in a child shell
  export root py prefix_path
  local log=$1 limit=$2
  shift 2
  run_step "$log" "$limit" bash -c 'configure_and_build "$@"' _ "$@"
}
