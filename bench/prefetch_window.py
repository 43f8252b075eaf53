"""The prefetch window's effect on peak memory and stall time, on the simulated device: the
transformer language model of bench/encoder_lm.py trained under `eager` with fixed windows and
with the default (adaptive) one, each in its own process, side by side with no offload.

    python3 bench/prefetch_window.py [--steps N]

Prints a markdown table. Stall time is how long backward waited for reloads (CPU time of the
simulated device's copy threads against the host's compute: compare rows of one run only).
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(steps, *args):
    cmd = [sys.executable, os.path.join(HERE, "encoder_lm.py"), "--steps", str(steps), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"prefetch_window: {' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    base = run(args.steps, "--offload", "none")
    rows = [("no offload", base)]
    for mb in (0, 4, 16, 64, 256):
        rows.append((f"eager, fixed window {mb} MiB",
                     run(args.steps, "--offload", "eager", "--prefetch-mb", str(mb))))
    rows.append(("eager, adaptive (default)", run(args.steps, "--offload", "eager")))
    # Held: a spill's block counts until its copy has read it.
    print("| configuration | peak held (MiB) | vs no offload | peak allocated (MiB) | stalls | "
          "stall (ms) | bitwise |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, r in rows:
        same = (r["losses"], r["grads"]) == (base["losses"], base["grads"])
        print(f"| {name} | {r['peak_held'] / 2**20:.1f} | "
              f"{r['peak_held'] / base['peak_held']:.2f}x | "
              f"{r['peak_allocated'] / 2**20:.1f} | {r['num_stalls']} | "
              f"{r['stall_us'] / 1000:.1f} | {'yes' if same else 'NO'} |")
    if any((r["losses"], r["grads"]) != (base["losses"], base["grads"]) for _, r in rows):
        sys.exit("prefetch_window: a run with offload differs from the run without")


if __name__ == "__main__":
    main()
