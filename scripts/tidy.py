"""clang-tidy over the given sources, with a cache of clean results outside the clone.

A file's result depends only on what clang sees: its preprocessed text (every header it
includes), its compile flags, .clang-tidy and the clang-tidy release. That is the cache key, so
a file whose key was found clean before is clean now and is not run again; everything else is.
Preprocessing takes a second where clang-tidy takes ten, which is what keeps lint short in CI's
fresh clones (the cache lives in ~/.cache/spillway/clang-tidy, or SPILLWAY_TIDY_CACHE).

A cold cache (a new machine) has every file to run. --budget SECONDS bounds that: the files
changed in the last commits go first, the rest follow in an order that rotates by day, and no
file starts after the budget is spent; those left are named and checked by a later run. With
no budget every file runs. Only files found clean are cached: a file with a finding runs again
next time, and fails lint again.

Usage: tidy.py --build BUILD_DIR [--tidy clang-tidy] [--jobs 2] [--budget S] FILE...
Exit status: 0 clean (deferred files included), 1 findings, 2 a run that did not finish.
"""

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time


def compile_commands(build):
    with open(os.path.join(build, "compile_commands.json"), encoding="utf-8") as f:
        return {os.path.realpath(e["file"]): e for e in json.load(f)}


def _arguments(entry):
    return entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])


def preprocess_arguments(entry):
    """The file's compile command as a clang preprocessing run to stdout (-P: no line markers,
    which hold the clone's absolute paths)."""
    args, skip = [], False
    for arg in _arguments(entry)[1:]:
        if skip:
            skip = False
            continue
        if arg in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if arg in ("-c", "-MD", "-MMD") or arg.startswith("-fsanitize"):
            continue
        args.append(arg)
    return ["clang++", "-E", "-P", "-w", "-Qunused-arguments"] + args + ["-o", "-"]


def cache_key(entry, root, tidy_version, config):
    pre = subprocess.run(preprocess_arguments(entry), cwd=entry["directory"],
                         capture_output=True, check=False)
    if pre.returncode != 0:
        return None  # clang-tidy will report what fails to parse; nothing to cache
    digest = hashlib.sha256()
    for part in (tidy_version, config,
                 " ".join(_arguments(entry)[1:]).replace(root, "<root>").encode(),
                 pre.stdout.replace(root.encode(), b"<root>")):
        digest.update(hashlib.sha256(part if isinstance(part, bytes) else part.encode()).digest())
    return digest.hexdigest()


def findings_of(output):
    """Our own code's warnings and errors: system headers and the compiler's note on an LTO flag
    it ignores are not findings."""
    lines = set()
    for line in output.splitlines():
        if ("warning:" in line or "error:" in line) and not line.startswith("/usr/") \
                and "ignored-optimization-argument" not in line and "/site-packages/" not in line:
            lines.add(line)
    return sorted(lines)


def order(files, root, now):
    """Files changed in the last 20 commits first, then the rest rotated by the day of the year."""
    recent = subprocess.run(["git", "log", "-20", "--name-only", "--format="], cwd=root,
                            capture_output=True, text=True, check=False).stdout.split()
    recent = {os.path.realpath(os.path.join(root, f)) for f in recent}
    first = [f for f in files if f in recent]
    rest = [f for f in files if f not in recent]
    shift = now.timetuple().tm_yday % len(rest) if rest else 0
    return first + rest[shift:] + rest[:shift]


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", required=True)
    parser.add_argument("--tidy", default="clang-tidy")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--budget", type=float, default=0.0, help="seconds; 0: no bound")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)

    root = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
    cache = os.environ.get("SPILLWAY_TIDY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "spillway",
        "clang-tidy")
    os.makedirs(cache, exist_ok=True)
    commands = compile_commands(args.build)
    tidy_version = subprocess.run([args.tidy, "--version"], capture_output=True, text=True,
                                  check=True).stdout
    with open(os.path.join(root, ".clang-tidy"), encoding="utf-8") as f:
        config = f.read()
    files = [os.path.realpath(os.path.join(root, f)) for f in args.files]
    missing = [f for f in files if f not in commands]
    if missing:
        print("tidy: no compile command for " + ", ".join(missing))
        return 2

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        keys = dict(zip(files, pool.map(
            lambda f: cache_key(commands[f], root, tidy_version, config), files)))
    todo = [f for f in files if keys[f] is None or not os.path.exists(os.path.join(cache, keys[f]))]
    print(f"tidy: {len(files) - len(todo)} of {len(files)} files unchanged since a clean run")

    start = time.monotonic()
    found, deferred, unfinished = [], [], []

    def run(path):
        if args.budget and time.monotonic() - start > args.budget:
            return path, None
        result = subprocess.run([args.tidy, "-p", args.build, "--quiet", path],
                                capture_output=True, text=True, check=False)
        return path, result

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for path, result in pool.map(run, order(todo, root, datetime.date.today())):
            if result is None:
                deferred.append(path)
                continue
            if result.returncode < 0:  # killed by a signal: unchecked, not clean
                unfinished.append(path)
                continue
            lines = findings_of(result.stdout + result.stderr)
            if lines:
                found.extend(lines)
            elif keys[path] is not None:
                open(os.path.join(cache, keys[path]), "w").close()

    for line in sorted(set(found)):
        print(line)
    if deferred:
        print(f"tidy: {len(deferred)} files deferred past the {args.budget:.0f} s budget "
              "(a later run checks them): " + ", ".join(os.path.relpath(p, root) for p in deferred))
    if unfinished:
        print("tidy: clang-tidy did not finish on " + ", ".join(unfinished))
        return 2
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
