"""Host time per save: what the saved-tensor hooks of each scheme cost the thread that runs forward
and backward, where a GPU's host must stay ahead of its kernels. A chain of small elementwise ops
(each saves its input) makes the host the bottleneck on purpose: the hooks' own work shows, and
nothing else.

    python3 bench/save_overhead.py [--saves N] [--elements N] [--repeats N]

On the simulated device, one intra-op thread. The configurations run round-robin, one step each
per round, so that a machine's drift falls on all of them alike; each row is the median step over
the rounds. Prints a markdown table: the median step, the host time per save above the run without
hooks, that time against torch's identity hooks (the floor of any scheme built on saved-tensor
hooks), bytes spilled to the host per step, and whether the gradient is bitwise the one without
hooks. Compare rows of one run only.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

import spillway

# One intra-op thread, as the suites run: host time is what is measured, and torch's thread pools
# would add their own waits to it.
torch.set_num_threads(1)


def identity_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


# (name, context manager factory). `eager` below its default min_bytes (1 MiB) spills nothing: the
# bookkeeping alone; with min_bytes=0 every save is spilled and brought back by the simulated
# link, which a real GPU's copy engines would do off the host.
CONFIGS = (
    ("no hooks", contextlib.nullcontext),
    ("torch identity hooks", identity_hooks),
    ("torch save_on_cpu", torch.autograd.graph.save_on_cpu),
    ("Spillway off", lambda: spillway.offload("off")),
    ("Spillway eager, nothing spilled", lambda: spillway.offload("eager")),
    ("Spillway eager, every save spilled", lambda: spillway.offload("eager", min_bytes=0)),
)


def step(x, saves, context):
    """One forward of `saves` saved elementwise ops inside `context`, and its backward: returns
    the seconds it took and x's gradient."""
    x.grad = None
    start = time.perf_counter()
    with context():
        y = x
        for _ in range(saves):
            y = y.sin()
        loss = y.sum()
    loss.backward()
    return time.perf_counter() - start, x.grad.clone()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=2000, help="saves per step")
    parser.add_argument("--elements", type=int, default=64, help="float32 elements per save")
    parser.add_argument("--repeats", type=int, default=25, help="rounds (steps per configuration)")
    args = parser.parse_args(argv)
    for name in ("saves", "elements", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")

    spillway.install("sim")
    x = torch.randn(args.elements, requires_grad=True)
    times = {name: [] for name, _ in CONFIGS}
    to_host = {name: 0 for name, _ in CONFIGS}
    grads = {}
    for name, context in CONFIGS:  # warm-up round: first calls, caches, the engine's learning
        step(x, args.saves, context)
    for _ in range(args.repeats):
        for name, context in CONFIGS:
            before = spillway.memory_stats()["spillway.bytes_to_host"]
            seconds, grad = step(x, args.saves, context)
            to_host[name] += spillway.memory_stats()["spillway.bytes_to_host"] - before
            times[name].append(seconds)
            grads[name] = grad
    median = {name: statistics.median(values) for name, values in times.items()}
    per_save = {name: (median[name] - median["no hooks"]) / args.saves * 1e6 for name in median}
    floor = per_save["torch identity hooks"]

    print(f"Host time per save: {args.saves} saves of {args.elements} float32 elements a step, "
          f"median of {args.repeats} steps, simulated device, one intra-op thread, torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs")
    print()
    print("| configuration | median step (ms) | host time per save (us) | vs identity hooks "
          "| to host per step (KiB) | gradient bitwise |")
    print("|---|---:|---:|---:|---:|---|")
    for name, _ in CONFIGS:
        ratio = "" if name == "no hooks" or floor <= 0 else f"{per_save[name] / floor:.2f}x"
        extra = "" if name == "no hooks" else f"{per_save[name]:.2f}"
        same = "yes" if torch.equal(grads[name], grads["no hooks"]) else "NO"
        print(f"| {name} | {median[name] * 1e3:.2f} | {extra} | {ratio} | "
              f"{to_host[name] / args.repeats / 1024:.1f} | {same} |")
    return 0 if all(torch.equal(g, grads["no hooks"]) for g in grads.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
