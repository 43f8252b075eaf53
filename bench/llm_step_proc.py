"""The parent's processes for bench/llm_step.py: each job in a forked child with a time window
and a guard on the host's available memory, and the flag that a SIGTERM sets to stop them."""

import json
import os
import select
import signal
import sys
import time
import traceback

from llm_step_common import GIB


def meminfo_bytes(key):
    """The /proc/meminfo line `key` ("MemAvailable", "MemTotal") in bytes, or None."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def mem_available():
    return meminfo_bytes("MemAvailable")


def run_forked(fn, spec, timeout_s, log_path, host_guard=0):
    """Runs fn(spec, emit) in a forked child (stdout and stderr to log_path); returns (rows, how it
    ended). The parent never initialises CUDA, so the child may. The child is killed when the
    host's available memory falls below host_guard bytes (pinned memory cannot be swapped out)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("llm_step: CUDA is initialised in the parent; a forked child could "
                           "not use it")
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            # Not the parent's handler: a SIGTERM (the script's timeout) ends the child at once.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.close(r)
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            out = os.fdopen(w, "w", buffering=1)

            def emit(row):
                out.write(json.dumps(row) + "\n")
                out.flush()
            fn(spec, emit)
            code = 0
        except BaseException:  # noqa: BLE001 - reported in the log, the exit code says it
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    rows, buf, ended = [], b"", None
    deadline = time.time() + timeout_s
    status = None
    try:
        while True:
            left = deadline - time.time()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                ended = f"killed after {timeout_s:.0f} s (time budget)"
                break
            if STOP:
                os.kill(pid, signal.SIGKILL)
                ended = STOP["why"]
                break
            ready, _, _ = select.select([r], [], [], min(left, 0.25))
            available = mem_available() if host_guard else None
            if available is not None and available < host_guard:
                os.kill(pid, signal.SIGKILL)
                ended = (f"killed: the host's available memory fell to {available / GIB:.1f} "
                         f"GiB (guard {host_guard / GIB:.1f} GiB)")
                break
            if not ready:
                continue
            chunk = os.read(r, 65536)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                rows.append(json.loads(line))
        os.close(r)
        _, status = os.waitpid(pid, 0)
    finally:
        if status is None:  # interrupted (an exception here): no child outlives the parent
            for step in (lambda: os.close(r), lambda: os.kill(pid, signal.SIGKILL),
                         lambda: os.waitpid(pid, 0)):
                try:
                    step()
                except OSError:
                    pass
    if ended is None and STOP:  # gpu_bench.sh's timeout signals the child too
        ended = STOP["why"]
    if ended is None:
        if os.WIFSIGNALED(status):
            ended = f"died of signal {os.WTERMSIG(status)}"
        elif os.WEXITSTATUS(status) != 0:
            ended = f"exited with status {os.WEXITSTATUS(status)}"
    return rows, ended


def host_ram_bytes():
    return meminfo_bytes("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# Set by the parent's SIGTERM handler (the script's timeout): the job in progress is killed, no
# other starts, and what ran is written. A flag, not an exception raised from the handler: that
# could land where Python ignores exceptions (an at-fork callback, a finaliser) and be lost.
STOP = {}


def job_window(now, deadline, share, grace):
    """(the job's own deadline, when the parent kills it) for a job given `share` seconds at
    `now`, within the matrix's `deadline`: a length in progress may run `grace` seconds past the
    job's deadline, but no job runs past the matrix's, which the report must follow in time."""
    kill_at = min(now + share + grace, deadline)
    return min(now + share, kill_at - grace), kill_at
