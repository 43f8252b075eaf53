"""The demo: the same training run with and without Spillway, side by side.

On a machine with CUDA it runs on the GPU; otherwise on Spillway's simulated device (where every
number is the simulated device's accounting, and step times are CPU time)."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "out", "demo")


def run(device, config, extra=()):
    cmd = [sys.executable, os.path.join(HERE, "train_step.py"), "--device", device, "--config",
           config, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"demo: {' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    import torch

    device = "cuda" if torch.cuda.is_available() else "sim"
    where = "GPU" if device == "cuda" else "simulated device (no GPU here)"
    print(f"Spillway demo: a small GPT-style model, 4 steps, on the {where}\n")
    os.makedirs(OUT, exist_ok=True)
    without = os.path.join(OUT, "snapshot_no_offload.pickle")
    with_eager = os.path.join(OUT, "snapshot_eager.pickle")
    # On the simulated device the default configuration is Spillway's allocator already.
    base = run(device, "default", ["--snapshot", without] if device == "sim" else [])
    if device == "cuda":
        run(device, "spillway", ["--snapshot", without])
    rows = [("no offload", base)]
    rows.append(("Spillway eager", run(device, "eager", ["--snapshot", with_eager])))
    budget = base["peak_allocated"] // 2
    rows.append((f"Spillway auto, budget {budget / 2**20:.1f} MiB",
                 run(device, "auto", ["--budget", str(budget)])))
    time_label = "median step (s, CPU)" if device == "sim" else "median step (s)"
    print(f"| configuration | peak allocated (MiB) | vs no offload | {time_label} | "
          "to host (MiB) | losses equal |")
    print("|---|---:|---:|---:|---:|---|")
    for name, r in rows:
        print(f"| {name} | {r['peak_allocated'] / 2**20:.1f} | "
              f"{r['peak_allocated'] / base['peak_allocated']:.2f}x | {r['median_step_s']:.3f} | "
              f"{r['bytes_to_host'] / 2**20:.1f} | "
              f"{'yes (bitwise)' if r['losses'] == base['losses'] else 'NO'} |")
    if any(r["losses"] != base["losses"] for _, r in rows):
        sys.exit("demo: losses differ from the run without offload")
    from spillway import report

    png = report.plot([report.load(without), report.load(with_eager)],
                      ["no offload", "eager"], os.path.join(OUT, "timeline.png"))
    print(f"\nsnapshots (open at pytorch.org/memory_viz): {without}\n  {with_eager}")
    print(f"memory timeline: {png}")
    print(f"report: python3 -m spillway.report {without} {with_eager}")


if __name__ == "__main__":
    main()
