# Shared by the scripts (source it). Picks the Python interpreter that has torch: the first
# `python3` on PATH may be another one (pyenv and the like), while Debian's python3-torch serves
# /usr/bin/python3.
spillway_python() {
  local candidate
  for candidate in "${SPILLWAY_PYTHON:-}" python3 /usr/bin/python3; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c "import torch" >/dev/null 2>&1; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}
