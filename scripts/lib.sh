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
