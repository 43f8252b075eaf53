"""The training-step benchmark: the same model under six memory configurations, each in its own
process, side by side. Writes a markdown table to stdout and JSON + PNG to bench/results/.

    scripts/bench [--quick] [--steps N] [--layers N] ...
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

CONFIGS = [
    ("default", "1. PyTorch default allocator"),
    ("spillway", "2. Spillway, no offload"),
    ("eager", "3. Spillway eager"),
    ("auto", "4. Spillway auto, 50% budget"),
    ("save_on_cpu", "5. save_on_cpu(pin_memory=True)"),
    ("checkpoint", "6. checkpointing per layer"),
]


def run(device, config, args, budget=None):
    cmd = [sys.executable, os.path.join(HERE, "train_step.py"), "--device", device,
           "--config", config, "--steps", str(args.steps), "--layers", str(args.layers),
           "--batch", str(args.batch), "--seq", str(args.seq), "--d-model", str(args.d_model)]
    if budget:
        cmd += ["--budget", str(budget)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        # The other configurations still run: one failure should not hide what the rest measure.
        print(f"bench: {config} failed (exit {out.returncode}):\n{out.stderr}", file=sys.stderr)
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else
                f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description="Training-step benchmark")
    parser.add_argument("--quick", action="store_true", help="small model, 3 steps (< 2 min)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=64)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.layers = 3, 4

    import torch

    device = "cuda" if torch.cuda.is_available() else "sim"
    results = {}
    for config, label in CONFIGS:
        if config == "save_on_cpu" and device == "sim":
            results[config] = None  # host memory saving to host memory: no meaning
            continue
        budget = None
        if config == "auto":
            if "error" in results["default"]:
                results[config] = {"error": "not run: configuration 1 failed"}
                continue
            budget = results["default"]["peak_allocated"] // 2
        results[config] = run(device, config, args, budget)

    base = results["default"]
    sim = device == "sim"
    na = "n/a on the simulated device"
    time_label = "median step, CPU time (s)" if sim else "median step (s)"
    title = "simulated device" if sim else torch.cuda.get_device_name()
    print(f"Training-step benchmark on the {title}: TinyLM layers={args.layers} batch={args.batch} "
          f"seq={args.seq} d_model={args.d_model}, {args.steps} steps, "
          f"{datetime.date.today().isoformat()}\n")
    # Held: a spill's block counts until its copy has read it (allocated counts it freed at the
    # spill, crediting copies still in flight).
    print(f"| configuration | peak held (MiB) | peak allocated (MiB) | peak reserved (MiB) | "
          f"{time_label} | to host (MiB) | stall (ms) | losses equal to 1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for config, label in CONFIGS:
        r = results[config]
        if r is None:
            print(f"| {label} | {na} | {na} | {na} | {na} | {na} | {na} | {na} |")
            continue
        if "error" in r:
            print(f"| {label} | FAILED: {r['error']} | | | | | | |")
            continue
        same = "yes (bitwise)" if r["losses"] == base.get("losses") else "NO"
        print(f"| {label} | {r['peak_held'] / 2**20:.1f} | {r['peak_allocated'] / 2**20:.1f} | "
              f"{r['peak_reserved'] / 2**20:.1f} | "
              f"{r['median_step_s']:.3f} | {r['bytes_to_host'] / 2**20:.1f} | "
              f"{r['stall_us'] / 1000:.1f} | {same} |")
    if sim:
        print("\nOn the simulated device configurations 1 and 2 are the same allocator (Spillway's "
              "simulated device is the device), and step times are CPU time with copies competing "
              "for the same cores: they say nothing about GPU step time.")

    os.makedirs(RESULTS, exist_ok=True)
    meta = {"device": title, "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
            "model": {k: getattr(args, k) for k in ("steps", "layers", "batch", "seq", "d_model")}}
    with open(os.path.join(RESULTS, f"train_step_{device}.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    try:
        plot(results, os.path.join(RESULTS, f"train_step_{device}.png"), title, time_label)
        print(f"\nwrote {RESULTS}/train_step_{device}.json and .png")
    except ImportError:  # a GPU machine without matplotlib still gets the table and JSON
        print(f"\nwrote {RESULTS}/train_step_{device}.json (no matplotlib: no plot)")
    failed = [c for c, r in results.items() if r is not None and "error" in r]
    if failed:
        sys.exit(f"bench: configurations failed: {', '.join(failed)}")
    if any(r is not None and r["losses"] != base["losses"] for r in results.values()):
        sys.exit("bench: some configuration's losses differ from configuration 1")


def plot(results, path, title, time_label):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config, label in CONFIGS:
        r = results[config]
        if r is None or "error" in r:
            continue
        ax.scatter(r["median_step_s"], r["peak_held"] / 2**20, s=60)
        ax.annotate(label, (r["median_step_s"], r["peak_held"] / 2**20),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel(time_label)
    ax.set_ylabel("peak held (MiB)")
    ax.set_title(f"Peak memory vs step time ({title})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
