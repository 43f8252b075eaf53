"""Exits 0 when every `name==version` line of a requirements file is installed at that version
(a local build tag such as torch's "+cpu" is ignored), 1 otherwise. With --report, names what
is missing or different. Standard library only: it runs before anything is installed."""

import importlib.metadata
import re
import sys


def unmet(path):
    problems = []
    for line in open(path, encoding="utf-8"):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*==\s*([^\s;]+)", line)
        if match is None:
            problems.append(f"{line}: only name==version lines are understood")
            continue
        name, wanted = match.groups()
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{name}: not installed (wanted {wanted})")
            continue
        if have.split("+", 1)[0] != wanted:
            problems.append(f"{name}: {have} installed, {wanted} wanted")
    return problems


def main(argv):
    report = "--report" in argv
    paths = [a for a in argv if a != "--report"]
    if len(paths) != 1:
        print("usage: requirements_met.py [--report] REQUIREMENTS_FILE", file=sys.stderr)
        return 2
    problems = unmet(paths[0])
    if report:
        for p in problems:
            print(f"setup: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
