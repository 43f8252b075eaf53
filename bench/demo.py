"""The demo: the same training run with and without Spillway, side by side.

On a machine with CUDA it runs on the GPU; otherwise on Spillway's simulated device (where every
number is the simulated device's accounting, and step times are CPU time)."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# Snapshots and the plot go here (SPILLWAY_DEMO_OUT overrides, e.g. for the test of the demo).
OUT = os.environ.get("SPILLWAY_DEMO_OUT") or os.path.join(os.path.dirname(HERE), "out", "demo")


def run(device, config, extra=()):
    cmd = [sys.executable, os.path.join(HERE, "train_step.py"), "--device", device, "--config",
           config, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"demo: {' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def does_not_fit(device, base):
    """The same run on a device too small for it without offload."""
    limit_mb = -(-int(base["peak_allocated"] * 0.6) // 2**20)  # 60% of the peak, rounded up
    how = ("a simulated device of that capacity" if device == "sim" else
           "torch.cuda.set_per_process_memory_fraction")
    print(f"\nWhen the activations do not fit: the same run with {limit_mb} MiB of device memory "
          f"({how})\n")
    print("| configuration | result | peak held (MiB) | peak allocated (MiB) |"
          " peak reserved (MiB) | to host (MiB) | losses equal |")
    print("|---|---|---:|---:|---:|---:|---|")
    limit = ["--limit-mb", str(limit_mb)]
    for name, config in (("no offload", "default"), ("Spillway auto, default budget", "auto")):
        r = run(device, config, limit)
        if "oom" in r:
            print(f"| {name} | out of memory | | | | | |")
            continue
        equal = r["losses"] == base["losses"]
        print(f"| {name} | completed | {r['peak_held'] / 2**20:.1f} | "
              f"{r['peak_allocated'] / 2**20:.1f} | "
              f"{r['peak_reserved'] / 2**20:.1f} | {r['bytes_to_host'] / 2**20:.1f} | "
              f"{'yes (bitwise)' if equal else 'NO'} |")
        if not equal:
            sys.exit("demo: losses differ from the run without offload")
        if config == "auto" and r["peak_reserved"] > limit_mb << 20:
            sys.exit("demo: Spillway reserved more than the limit")


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
    # Held is what the tensors and the spills still copying need: a spill's block is counted free
    # when the spill is issued, yet nothing may reuse it before its copy has read it. Reserved is
    # what the device holds (what nvidia-smi shows): held plus the cache.
    print(f"| configuration | peak held (MiB) | vs no offload | peak allocated (MiB) | "
          f"peak reserved (MiB) | {time_label} | to host (MiB) | losses equal |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, r in rows:
        print(f"| {name} | {r['peak_held'] / 2**20:.1f} | "
              f"{r['peak_held'] / base['peak_held']:.2f}x | "
              f"{r['peak_allocated'] / 2**20:.1f} | "
              f"{r['peak_reserved'] / 2**20:.1f} | {r['median_step_s']:.3f} | "
              f"{r['bytes_to_host'] / 2**20:.1f} | "
              f"{'yes (bitwise)' if r['losses'] == base['losses'] else 'NO'} |")
    if any(r["losses"] != base["losses"] for _, r in rows):
        sys.exit("demo: losses differ from the run without offload")
    does_not_fit(device, base)
    from spillway import report

    png = report.plot([report.load(without), report.load(with_eager)],
                      ["no offload", "eager"], os.path.join(OUT, "timeline.png"))
    page = os.path.join(OUT, "report.html")
    with open(page, "w", encoding="utf-8") as f:
        f.write(report.html_report(report.load(with_eager), os.path.basename(with_eager)))
    print(f"\nsnapshots (open at pytorch.org/memory_viz): {without}\n  {with_eager}")
    print(f"memory timeline: {png}")
    print(f"the eager run's page (device and host lanes, spills per storage): {page}")
    # The first python3 on PATH may lack torch or the build: scripts/env.sh picks both.
    print(f"report: source scripts/env.sh && python3 -m spillway.report {without} {with_eager}")


if __name__ == "__main__":
    main()
