# Shared by the scripts (source it). Picks the Python interpreter the scripts use: SPILLWAY_PYTHON,
# else python3 on PATH (scripts/setup installs requirements.txt there), provided it has a
# supported torch (2.4 and newer).
spillway_python() {
  local candidate
  for candidate in "${SPILLWAY_PYTHON:-}" python3; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c "import sys, torch; v = tuple(int(x) for x in
torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 4))" >/dev/null 2>&1; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

# The compiler cache's CMake arguments (none without ccache), for every build tree the scripts
# configure: one cache outside the clone (ccache's own default directory, or CCACHE_DIR), so CI's
# fresh clones and the several build trees of scripts/test share what was compiled before (the
# static-runtime tree of scripts/check_exports compiles what the Release tree did). CCACHE_BASEDIR
# makes the clone's own paths relative in what ccache hashes, and NOHASHDIR leaves the working
# directory out of it (debug builds), so another clone or tree of the same sources hits.
spillway_launcher_args() {
  command -v ccache >/dev/null 2>&1 || return 0
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-true}
  launcher_args=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
}
