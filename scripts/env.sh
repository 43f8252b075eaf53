# Source me: `source scripts/env.sh`. Makes `import spillway` work from the build tree, makes the
# environment hook (SPILLWAY_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF=backend:spillway) apply to
# plain `python3 train.py`, and puts the Python that has torch first on PATH as `python3`.
_spillway_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$_spillway_root/scripts/lib.sh"
if _spillway_py=$(spillway_python); then
  mkdir -p "$_spillway_root/build/bin"
  ln -sf "$_spillway_py" "$_spillway_root/build/bin/python3"
  case ":$PATH:" in *":$_spillway_root/build/bin:"*) ;; *) export PATH="$_spillway_root/build/bin:$PATH" ;; esac
else
  echo "spillway: no Python with torch found (run scripts/setup)" >&2
fi
export PYTHONUSERBASE="$_spillway_root/build/python-site"
export PYTHONPATH="$_spillway_root/build/python${PYTHONPATH:+:$PYTHONPATH}"
unset _spillway_root _spillway_py
